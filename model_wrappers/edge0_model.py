"""OpenCompass model for the Edge0 streaming engine: the student arm (int4 experts from disk)."""

from __future__ import annotations

import inspect
import os
from typing import Any, Dict, List

from opencompass.registry import MODELS

from edge0_eval.errors import ConfigError

from .chat import ChatModelBase

# Adapter files looked up inside the student directory when no explicit path is given
# (the engine's own default for the prerouter heads is the same name).
LORA_NAME = 'lora.safetensors'
PREROUTER_NAME = 'prerouter.safetensors'
# Per-sample engine figures gathered under "pool" in each sample's stats.
POOL_KEYS = ('decode_hit_rate', 'cache_hit_rate', 'decode_bytes_read', 'prefill_bytes_read',
              'bytes_per_token', 'reads_per_token', 'blocked_load_ms_per_step', 'bytes_read',
              'evictions', 'rss_gib')


def engine_fields() -> tuple[str, ...]:
    """Every EngineOptions field: each one is settable from a model config."""
    from dataclasses import fields

    from edge0_eval.engine.engine import EngineOptions
    return tuple(f.name for f in fields(EngineOptions))


def resolve_engine_options(path: str, **options) -> dict:
    """Check a student directory, its adapters and options; return the EngineOptions fields.

    Runs before anything is loaded (configs call it at parse time through
    `model_wrappers.config_env.preflight`), so a missing file is one clear error, not a failed
    task. The LoRA adapter defaults to `<path>/lora.safetensors`, the prerouter heads (prerouted
    mode) to `<path>/prerouter.safetensors`; `no_lora` / `no_prerouter` turn them off.
    """
    from edge0_eval.engine.engine import EngineOptions

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
    opts.validate()

    def adapter(explicit, name, disabled, what, flag):
        if disabled:
            return None
        candidate = explicit or os.path.join(path, name)
        if not os.path.isfile(candidate):
            raise ConfigError(f'student {what} {candidate} is missing; train it, pass its path, '
                              f'or set {flag}=True for an ablation arm')
        return candidate

    opts.lora_path = adapter(opts.lora_path, LORA_NAME, opts.no_lora, 'LoRA adapter',
                             'no_lora')
    # Only the prerouted mode uses the prerouter heads.
    opts.prerouter_path = adapter(opts.prerouter_path, PREROUTER_NAME,
                                  opts.no_prerouter or opts.mode != 'prerouted',
                                  'prerouter heads', 'no_prerouter')
    from dataclasses import asdict
    return asdict(opts)


@MODELS.register_module()
class Edge0Model(ChatModelBase):
    """The Edge0 student: `edge0_eval.engine.engine.Engine` over a converted model directory.

    Every EngineOptions field is a config key (mode, top_k, expert_budget_mib,
    slots_per_layer, lora_path, prerouter_path, no_lora, no_prerouter, io_throttle_mbps, ...).
    Adapters default to `<path>/lora.safetensors` and `<path>/prerouter.safetensors`.
    """

    arm = 'student'

    def __init__(self, path: str, mode: str = 'prerouted', cold_cache: bool = False, **kwargs):
        # cold_cache: evict the expert file from the page cache before every sample, so each
        # sample's speed is a cold figure; otherwise the page cache is left as the OS keeps it.
        self.cold_cache = cold_cache
        engine = {k: kwargs.pop(k) for k in engine_fields() if k in kwargs}
        gen = kwargs.get('generation_kwargs') or {}
        engine.setdefault('seed', int(gen.get('seed') or 0))
        self.engine_options = resolve_engine_options(path, mode=mode, **engine)
        self.engine = None
        self._extra_sampling: Dict[str, Any] = {}
        super().__init__(path=path, **kwargs)

    def _load(self, tokenizer_only: bool):
        if tokenizer_only:
            from pathlib import Path

            from mlx_lm.utils import load_tokenizer
            return load_tokenizer(Path(self.path))
        from edge0_eval.engine.engine import Engine, EngineOptions

        self._check_sampling_supported(Engine.generate)
        self.engine = Engine.load(self.path, EngineOptions(**self.engine_options))
        return self.engine.tokenizer

    def _check_sampling_supported(self, generate) -> None:
        """The engine's generate() takes temperature/top_p; refuse options it would ignore."""
        accepted = set(inspect.signature(generate).parameters)
        s = self.sampling
        wanted = {'top_k': s['top_k'] != 0, 'min_p': s['min_p'] != 0.0,
                  'repetition_penalty': s['repetition_penalty'] is not None}
        missing = [k for k, used in wanted.items() if used and k not in accepted]
        if missing:
            raise ConfigError(f'student: the engine does not support {missing}; keep the '
                              f'generation settings of both arms to temperature/top_p')
        self._extra_sampling = {k: s[k] for k, used in wanted.items() if used}

    def _generate_tokens(self, prompt_ids: List[int], max_tokens: int, stop_ids: set,
                         stop_words: List[str]) -> tuple[List[int], Dict[str, Any]]:
        import mlx.core as mx

        s = self.sampling
        mx.random.seed(int(s['seed']))
        mx.reset_peak_memory()  # the engine reports the peak since this point: per sample
        evicted = self.cold_cache and self.engine.store.evict_page_cache()
        result = self.engine.generate(prompt_ids, max_tokens,
                                      temperature=float(s['temperature']),
                                      top_p=float(s['top_p']),
                                      stop_token_ids=set(stop_ids),
                                      **self._extra_sampling)
        tokens = [int(t) for t in result.tokens]
        finish = 'length' if len(tokens) >= max_tokens else 'stop_token'
        # Some engines return the stop token itself: it is not part of the answer.
        if tokens and tokens[-1] in stop_ids:
            tokens = tokens[:-1]
            finish = 'stop_token'
        stats = dict(getattr(result, 'stats', None) or {})
        if not stats:
            stats = dict(self.engine.stats())
        return tokens, {
            'prefill_tok_s': stats.get('prefill_tok_s'),
            'decode_tok_s': stats.get('decode_tok_s'),
            'peak_memory_gib': stats.get('peak_memory_gib'),
            'finish_reason': stats.get('finish_reason', finish),
            'cache': 'cold' if evicted else 'not evicted',
            'pool': {k: stats[k] for k in POOL_KEYS if k in stats} or None,
            'engine': {k: v for k, v in stats.items() if isinstance(v, (int, float, str))},
        }

    def fidelity_logprobs(self, prompt_ids, tokens, topk_ids) -> dict:
        """Teacher-forced log-probs on the served decode path (datasets/edge0_fidelity.py)."""
        from edge0_eval.evaluation.fidelity import model_logprobs   # MLX: only with a model
        return model_logprobs(self.engine, prompt_ids, tokens, topk_ids)

    def __del__(self):
        engine = getattr(self, 'engine', None)
        if engine is not None:
            try:
                engine.close()
            except Exception:
                pass
