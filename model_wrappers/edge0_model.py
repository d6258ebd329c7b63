"""OpenCompass model for the Edge0 streaming engine: the student arm (int4 experts from disk)."""

from __future__ import annotations

import os
from dataclasses import fields
from pathlib import Path
from typing import Any, Dict, List

import mlx.core as mx
from mlx_lm.utils import load_tokenizer
from opencompass.registry import MODELS

from edge0_eval.engine.engine import Engine
from edge0_eval.engine.mlx_compat import wired_limit
from edge0_eval.engine.options import EngineOptions, MissingAdapterError
from edge0_eval.errors import ConfigError
from edge0_eval.evaluation.fidelity import model_logprobs

from .chat import ChatModelBase

# Per-sample engine figures gathered under "pool" in each sample's stats.
POOL_KEYS = ('decode_hit_rate', 'cache_hit_rate', 'decode_bytes_read', 'prefill_bytes_read',
             'bytes_per_token', 'reads_per_token', 'blocked_load_ms_per_step', 'bytes_read',
             'evictions', 'rss_gib')


def engine_fields() -> tuple[str, ...]:
    """Every EngineOptions field: each one is settable from a model config."""
    return tuple(f.name for f in fields(EngineOptions))


def resolve_engine_options(path: str, **options) -> EngineOptions:
    """The student's EngineOptions from config keys, checked against its directory.

    Runs before anything is loaded (the preflight calls it from
    `model_wrappers.partitioner`), so a missing file or a bad option is one clear error, not a
    failed task. Adapters are resolved by `EngineOptions.resolve`; the student requires its
    LoRA adapter (an evaluation must not score the base model by accident): `no_lora=True` for
    an ablation arm.
    """
    unknown = sorted(set(options) - set(engine_fields()))
    if unknown:
        raise ConfigError(f'unknown student options {unknown}; engine options are '
                          f'{", ".join(engine_fields())}')
    if not path:
        raise ConfigError('student path is empty')
    if not os.path.isdir(path):
        raise ConfigError(f'student directory {path} does not exist')
    if not os.path.isfile(os.path.join(path, 'experts.index.json')):
        raise ConfigError(f'{path} is not a converted Edge0 model (no experts.index.json); '
                          f'run `edge0-eval convert TEACHER {path}` first')
    opts = EngineOptions(**options)
    try:
        opts.resolve(path, require_lora=True)
    except MissingAdapterError as exc:
        raise MissingAdapterError(f'student {exc}') from None   # the preflight names the arm
    return opts


@MODELS.register_module()
class Edge0Model(ChatModelBase):
    """The Edge0 student: `edge0_eval.engine.engine.Engine` over a converted model directory.

    Every EngineOptions field is a config key, with EngineOptions' default (mode, top_k,
    expert_budget_mib, slots_per_layer, lora_path, prerouter_path, no_lora, no_prerouter,
    io_throttle_mbps, ...); adapters are found as `EngineOptions.resolve` documents, and the
    LoRA adapter is required (see `resolve_engine_options`).
    """

    arm = 'student'

    def __init__(self, path: str, cold_cache: bool = False, **kwargs):
        # cold_cache: evict the expert file from the page cache before every sample, so each
        # sample's speed is a cold figure; otherwise the page cache is left as the OS keeps it.
        self.cold_cache = cold_cache
        engine = {k: kwargs.pop(k) for k in engine_fields() if k in kwargs}
        gen = kwargs.get('generation_kwargs') or {}
        engine.setdefault('seed', int(gen.get('seed') or 0))
        self.engine_options = resolve_engine_options(path, **engine)
        self.engine = None
        super().__init__(path=path, **kwargs)

    @staticmethod
    def _check_sampling(s: Dict[str, Any]) -> None:
        """The engine samples with temperature/top_p only; refuse options it would ignore."""
        used = [k for k, on in (('top_k', s['top_k'] != 0), ('min_p', s['min_p'] != 0.0),
                                ('repetition_penalty', s['repetition_penalty'] is not None))
                if on]
        if used:
            raise ConfigError(f'student: the engine does not support {used}; keep the '
                              f'generation settings of both arms to temperature/top_p')

    def _load(self, tokenizer_only: bool):
        if tokenizer_only:
            return load_tokenizer(Path(self.path))
        self._check_sampling(self.sampling)
        self.engine = Engine.load(self.path, self.engine_options)
        return self.engine.tokenizer

    def _generate_tokens(self, prompt_ids: List[int], max_tokens: int, stop_ids: set,
                         stop_words: List[str]) -> tuple[List[int], Dict[str, Any]]:
        s = self.sampling
        mx.random.seed(int(s['seed']))
        mx.reset_peak_memory()  # the engine reports the peak since this point: per sample
        evicted = self.cold_cache and self.engine.store.evict_page_cache()
        with wired_limit(self.engine.model):
            result = self.engine.generate(prompt_ids, max_tokens,
                                          temperature=float(s['temperature']),
                                          top_p=float(s['top_p']),
                                          stop_token_ids=set(stop_ids))
        tokens = [int(t) for t in result.tokens]
        # Engine.generate ends on a stop token and includes it: it is not part of the answer.
        finish = 'length'
        if tokens and tokens[-1] in stop_ids:
            tokens = tokens[:-1]
            finish = 'stop_token'
        stats = result.stats
        return tokens, {
            'prefill_tok_s': stats.get('prefill_tok_s'),
            'decode_tok_s': stats.get('decode_tok_s'),
            'peak_memory_gib': stats.get('peak_memory_gib'),
            'finish_reason': finish,
            'cache': 'cold' if evicted else 'not evicted',
            'pool': {k: stats[k] for k in POOL_KEYS if k in stats} or None,
            'engine': {k: v for k, v in stats.items() if isinstance(v, (int, float, str))},
        }

    def fidelity_logprobs(self, prompt_ids, tokens, topk_ids) -> dict:
        """Teacher-forced log-probs on the served decode path (datasets/edge0_fidelity.py)."""
        return model_logprobs(self.engine, prompt_ids, tokens, topk_ids)

    def __del__(self):
        engine = getattr(self, 'engine', None)
        if engine is not None:
            try:
                engine.close()
            except Exception:
                pass
