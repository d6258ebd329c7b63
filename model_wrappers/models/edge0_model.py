"""OpenCompass model for the Edge0 streaming engine: the student arm (int4 experts from disk)."""

from __future__ import annotations

import os
import time
from dataclasses import fields
from pathlib import Path
from typing import Any, Dict, List

import mlx.core as mx
from mlx_lm.generate import wired_limit
from mlx_lm.utils import load_tokenizer
from opencompass.registry import MODELS

from edge0_eval import Engine, EngineOptions
from edge0_eval.engine.batch import Answer, sample_stats
from edge0_eval.engine.inputs import penalties_of
from edge0_eval.engine.options import MissingAdapterError
from edge0_eval.errors import ConfigError
from edge0_eval.evaluation.fidelity.scoring import model_logprobs

from .chat import ChatModelBase


def engine_fields() -> tuple[str, ...]:
    """Every EngineOptions field: each one is settable from a model config."""
    return tuple(f.name for f in fields(EngineOptions))


def resolve_engine_options(path: str, **options) -> EngineOptions:
    """The student's EngineOptions from config keys, checked against its directory.

    Runs before anything is loaded (the preflight calls it from
    `model_wrappers.partitioners.partitioner`), so a missing file or a bad option is one clear
    error, not a failed task. Adapters are resolved by `EngineOptions.resolve`; the student
    requires its LoRA adapter (an evaluation must not score the base model by accident):
    `no_lora=True` for an ablation arm.
    """
    if (
        "top_k" in options
    ):  # the routing width's old key: refused, never taken as sampling
        raise ConfigError(
            "student option top_k is experts_per_token now (the routing width, a "
            "config's num_experts_per_tok); sampling's top_k goes in generation_kwargs"
        )
    unknown = sorted(set(options) - set(engine_fields()))
    if unknown:
        raise ConfigError(
            f"unknown student options {unknown}; engine options are "
            f"{', '.join(engine_fields())}"
        )
    if not path:
        raise ConfigError("student path is empty")
    if not os.path.isdir(path):
        raise ConfigError(f"student directory {path} does not exist")
    if not os.path.isfile(os.path.join(path, "experts.index.json")):
        raise ConfigError(
            f"{path} is not a converted Edge0 model (no experts.index.json); "
            f"run `edge0-eval convert TEACHER {path}` first"
        )
    opts = EngineOptions(**options)
    try:
        opts.resolve(path, require_lora=True)
    except MissingAdapterError as exc:
        raise MissingAdapterError(
            f"student {exc}"
        ) from None  # the preflight names the arm
    return opts


@MODELS.register_module()
class Edge0Model(ChatModelBase):
    """The Edge0 student: `edge0_eval.engine.engine.Engine` over a converted model directory.

    Every EngineOptions field is a config key, with EngineOptions' default (mode,
    experts_per_token,
    expert_budget_mib, slots_per_layer, lora_path, prerouter_path, no_lora, no_prerouter,
    io_throttle_mbps, ...); adapters are found as `EngineOptions.resolve` documents, and the
    LoRA adapter is required (see `resolve_engine_options`).
    """

    arm = "student"

    def __init__(self, path: str, cold_cache: bool = False, **kwargs):
        # cold_cache: evict the expert file from the page cache before every batch (every
        # sample at batch_size 1), so speeds are cold figures; otherwise the page cache is left
        # as the OS keeps it.
        self.cold_cache = cold_cache
        engine = {k: kwargs.pop(k) for k in engine_fields() if k in kwargs}
        gen = kwargs.get("generation_kwargs") or {}
        engine.setdefault("seed", int(gen.get("seed") or 0))
        self.engine_options = resolve_engine_options(path, **engine)
        self.engine = None
        super().__init__(path=path, **kwargs)

    def _sampling(self) -> Dict[str, Any]:
        """The engine's sampling arguments: mlx-lm's filters and penalties, as the teacher's."""
        s = self.sampling
        return dict(
            temperature=float(s["temperature"]),
            top_p=float(s["top_p"]),
            top_k=int(s["top_k"]),
            min_p=float(s["min_p"]),
            penalties=penalties_of(s),
        )

    def _load(self, tokenizer_only: bool):
        if tokenizer_only:
            return load_tokenizer(Path(self.path))
        self.engine = Engine.load(self.path, self.engine_options)
        return self.engine.tokenizer

    def _generate_batch(
        self,
        prompts: List[List[int]],
        max_tokens: int,
        stop_ids: set,
        stop_words: List[str],
        seeds: List[int],
    ) -> List[Answer]:
        """The prompts as rows of Engine.generate_batch, each on its own seed, each ended by
        its stop rule while it decodes (a stop string included: nothing after it is
        decoded)."""
        mx.reset_peak_memory()  # the engine reports the peak since this point
        evicted = self.cold_cache and self.engine.store.evict_page_cache()
        cache = "cold" if evicted else "not evicted"
        start = time.perf_counter()
        with wired_limit(self.engine.model):
            results = self.engine.generate_batch(
                prompts,
                max_tokens,
                stop_token_ids=set(stop_ids),
                stop_words=stop_words,
                seeds=list(seeds),
                **self._sampling(),
            )
        batch_wall = round(time.perf_counter() - start, 4)
        answers = []
        for result in results:
            e = result.stats
            prefill = e["batch_prefill_s"]
            stats = sample_stats(e, result.finish, cache)
            stats.update(
                # The row's own time: its prefill and the wall time of its decode steps.
                wall_s=e["prefill_s"] + e["decode_wall_s"],
                batch_wall_s=batch_wall,
                batch_prefill_tok_s=(
                    round(sum(map(len, prompts)) / prefill, 2) if prefill else 0.0
                ),
                batch_decode_tok_s=round(float(e["batch_decode_tok_s"]), 2),
            )
            answers.append(
                Answer(
                    result.output, result.text, result.finish, result.stop_word, stats
                )
            )
        return answers

    def fidelity_logprobs(self, items: list[dict]) -> list[dict]:
        """Teacher-forced log-probs of fidelity items (datasets/edge0_fidelity.py), scored
        together by the set's scorer (evaluation.fidelity.scoring.model_logprobs)."""
        return model_logprobs(self.engine, items)

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            try:
                engine.close()
            except Exception:
                pass
