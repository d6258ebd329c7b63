"""Shared OpenCompass plumbing for the teacher (mlx-lm) and student (Edge0 engine) wrappers.

Both arms go through this one class so prompt handling, chat templating, stop words, sampling
options and per-sample statistics are identical; the subclasses only differ in how tokens are
generated; MLX is imported by the subclasses' modules only.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Dict, List, Optional

import torch  # opencompass.models.base imports it already: no extra cost
from opencompass.models.base import BaseModel
from opencompass.models.base_api import APITemplateParser
from opencompass.utils.logging import get_logger

from edge0_eval.engine.batch import Answer, stop_token_ids
from edge0_eval.engine.inputs import (
    FILTER_KEYS,
    PENALTY_KEYS,
    chat_ids,
    chat_text,
    check_filters,
    check_penalties,
    check_temperature,
    fit_prompt,
    penalties_of,
    row_seed,
    to_messages,
)
from edge0_eval.errors import ConfigError

# HUMAN/BOT/SYSTEM items of an OpenCompass PromptList map onto chat roles. SYSTEM is a reserved
# role so a dataset's `begin=[dict(role='SYSTEM', ...)]` reaches the chat template as a system
# message instead of being folded into the user turn.
DEFAULT_META_TEMPLATE = dict(
    round=[
        dict(role="HUMAN", api_role="HUMAN"),
        dict(role="BOT", api_role="BOT", generate=True),
    ],
    reserved_roles=[dict(role="SYSTEM", api_role="SYSTEM")],
)

# Sampling options both arms understand (edge0_eval/engine/inputs.py: mlx-lm's
# filters and penalties). Anything else in generation_kwargs is refused at construction so a
# typo cannot silently change one arm's decoding.
SAMPLING_KEYS = (*FILTER_KEYS, *PENALTY_KEYS, "do_sample", "seed")


def sampling_options(generation_kwargs: Dict[str, Any], arm: str) -> Dict[str, Any]:
    """Validate generation kwargs and resolve them to explicit sampling options."""
    unknown = sorted(set(generation_kwargs) - set(SAMPLING_KEYS) - {"max_new_tokens"})
    if unknown:
        raise ConfigError(
            f"{arm}: unsupported generation_kwargs {unknown}; "
            f"supported: {', '.join(SAMPLING_KEYS)}"
        )
    opts = {
        "temperature": 0.0,
        "top_p": 1.0,
        "top_k": 0,
        "min_p": 0.0,
        "seed": 0,
        **{key: None for key in PENALTY_KEYS},
    }
    for key in opts:
        if generation_kwargs.get(key) is not None:
            opts[key] = generation_kwargs[key]
    if generation_kwargs.get("do_sample") is False:
        opts["temperature"] = 0.0
    if not 0 < opts["top_p"] <= 1:
        raise ConfigError(f"{arm}: top_p must be in (0, 1], not {opts['top_p']!r}")
    try:
        check_temperature(opts["temperature"])
        check_filters(opts["top_k"], opts["min_p"])
        check_penalties(penalties_of(opts))
    except ConfigError as exc:
        raise ConfigError(f"{arm}: generation_kwargs: {exc}") from None
    return opts


def check_sample_indices(sample_indices, count: int, arm: str) -> List[int]:
    """One whole number >= 0 per prompt (None: sample 0 of every prompt)."""
    if sample_indices is None:
        return [0] * count
    samples = list(sample_indices)
    if len(samples) != count or any(
        isinstance(j, bool) or not isinstance(j, int) or j < 0 for j in samples
    ):
        raise ConfigError(
            f"{arm}: sample_indices must hold one whole number >= 0 per prompt "
            f"({count}), not {samples!r}"
        )
    return samples


class SampleStatsLog:
    """Per-sample stats of an OpenCompass model (in-process or served): kept until the inferencer
    pops them, and appended as JSON lines to `stats_jsonl` when it is set."""

    arm: str
    stats_jsonl: Optional[str]
    sample_stats: List[Dict[str, Any]]

    def _record(self, stats: Dict[str, Any]) -> None:
        stats = {"arm": self.arm, **stats}
        self.sample_stats.append(stats)
        if self.stats_jsonl:
            os.makedirs(
                os.path.dirname(os.path.abspath(self.stats_jsonl)), exist_ok=True
            )
            with open(self.stats_jsonl, "a", encoding="utf-8") as f:
                f.write(json.dumps(stats) + "\n")

    def pop_sample_stats(self) -> List[Dict[str, Any]]:
        """Per-sample stats recorded since the last call (the inferencer writes them out)."""
        out, self.sample_stats = self.sample_stats, []
        return out


class ChatModelBase(SampleStatsLog, BaseModel):
    """An OpenCompass chat model: chat template, stop words, sampling and per-sample stats.

    Subclasses implement `_load()` (returns the tokenizer) and either
    `_generate_tokens(prompt_ids, max_tokens, stop_ids, stop_words, seed) -> Answer` (one
    prompt) or `_generate_batch(prompts, max_tokens, stop_ids, stop_words, seeds)` (the batch
    OpenCompass hands `generate`: `batch_size` prompts per call). Each row stops by the one
    rule (engine.batch.StopRule) while it decodes, and its Answer holds its text (cut at its
    stop string), finish reason and figures. Every row's output and sample must equal the same
    prompt's alone: its seed is `row_seed(seed, its prompt, its sample index)`.

    Args (beyond BaseModel's):
        generation_kwargs: sampling options (see SAMPLING_KEYS); identical keys for both arms.
        stop_words: strings that end a generation; the text is trimmed at the first one.
        chat_template_kwargs: extra arguments for the tokenizer's chat template, e.g.
            dict(enable_thinking=True).
        stats_jsonl: optional path; every sample's stats are also appended there as JSON lines.
    """

    arm = "model"

    def __init__(
        self,
        path: str,
        max_seq_len: int = 32768,
        tokenizer_only: bool = False,
        meta_template: Optional[Dict] = None,
        generation_kwargs: Optional[Dict] = None,
        stop_words: Optional[List[str]] = None,
        chat_template_kwargs: Optional[Dict] = None,
        stats_jsonl: Optional[str] = None,
        **kwargs,
    ):
        super().__init__(
            path=path,
            max_seq_len=max_seq_len,
            tokenizer_only=tokenizer_only,
            meta_template=meta_template,
            generation_kwargs=generation_kwargs or {},
        )
        self.logger = get_logger()
        if kwargs:
            # A misspelt option would otherwise change one arm's behaviour silently.
            raise ConfigError(f"{self.arm}: unknown model options {sorted(kwargs)}")
        self.template_parser = APITemplateParser(meta_template or DEFAULT_META_TEMPLATE)
        self.sampling = sampling_options(self.generation_kwargs, self.arm)
        self.stop_words = [s for s in (stop_words or []) if s]
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.stats_jsonl = stats_jsonl
        self.sample_stats: List[Dict[str, Any]] = []
        self.tokenizer = self._load(tokenizer_only)

    # -- subclass hooks ----------------------------------------------------------------------
    def _load(self, tokenizer_only: bool):
        raise NotImplementedError

    def _generate_tokens(
        self,
        prompt_ids: List[int],
        max_tokens: int,
        stop_ids: set,
        stop_words: List[str],
        seed: int,
    ) -> Answer:
        raise NotImplementedError

    def _generate_batch(
        self,
        prompts: List[List[int]],
        max_tokens: int,
        stop_ids: set,
        stop_words: List[str],
        seeds: List[int],
    ) -> List[Answer]:
        """One Answer per prompt, in prompt order; by default one prompt at a time."""
        answers = []
        for ids, seed in zip(prompts, seeds):
            start = time.perf_counter()
            answer = self._generate_tokens(ids, max_tokens, stop_ids, stop_words, seed)
            answer.stats = {"wall_s": time.perf_counter() - start, **answer.stats}
            answers.append(answer)
        return answers

    # -- prompt handling ---------------------------------------------------------------------
    def chat_text(self, prompt: Any) -> str:
        return chat_text(self.tokenizer, to_messages(prompt), self.chat_template_kwargs)

    def encode_prompt(self, prompt: Any) -> List[int]:
        return chat_ids(self.tokenizer, to_messages(prompt), self.chat_template_kwargs)

    def get_token_len(self, prompt: Any) -> int:
        return len(self.encode_prompt(prompt))

    def encode(self, prompt: str):
        return torch.tensor([self.tokenizer.encode(prompt, add_special_tokens=False)])

    def decode(self, tokens) -> str:
        return self.tokenizer.decode(list(tokens))

    def _fit_prompt(self, ids: List[int], max_out_len: int) -> List[int]:
        """Keep the head and tail of an over-long prompt (OpenCompass's 'mid' truncation)."""
        fitted = fit_prompt(ids, self.max_seq_len, max_out_len)
        if len(fitted) < len(ids):
            self.logger.warning(
                f"{self.arm}: prompt of {len(ids)} tokens cut to {len(fitted)} "
                f"(max_seq_len {self.max_seq_len} - max_out_len {max_out_len})"
            )
        return fitted

    # -- OpenCompass entry points ------------------------------------------------------------
    def generate(
        self,
        inputs: List[Any],
        max_out_len: int,
        min_out_len: Optional[int] = None,
        stopping_criteria: Optional[List[str]] = None,
        sample_indices: Optional[List[int]] = None,
        **kwargs,
    ) -> List[str]:
        """sample_indices: per input, which of its question's repeats it is (the inferencer
        passes them; None: 0 for every input). A repeat draws its own seed (`row_seed`)."""
        if self.tokenizer_only:
            raise RuntimeError(f"{self.arm} was built with tokenizer_only=True")
        if kwargs:
            self.logger.debug(f"{self.arm}: ignoring per-call kwargs {sorted(kwargs)}")
        samples = check_sample_indices(sample_indices, len(inputs), self.arm)
        stop_words = list(
            dict.fromkeys(self.stop_words + list(stopping_criteria or []))
        )
        stop_ids = stop_token_ids(self.tokenizer, stop_words)
        prompts = [self._fit_prompt(self.encode_prompt(p), max_out_len) for p in inputs]
        seeds = [
            row_seed(self.sampling["seed"], ids, j) for ids, j in zip(prompts, samples)
        ]
        start = time.perf_counter()
        rows = self._generate_batch(prompts, max_out_len, stop_ids, stop_words, seeds)
        wall = time.perf_counter() - start
        if len(rows) != len(prompts):
            raise RuntimeError(
                f"{self.arm}: {len(rows)} outputs for {len(prompts)} prompts"
            )
        outputs = []
        for ids, seed, sample, answer in zip(prompts, seeds, samples, rows):
            # wall_s: this row's own time (from the call's start in a batch); batch_* keys
            # hold the figures of the whole batch it ran in.
            stats = dict(answer.stats)
            stats = {
                "prompt_tokens": len(ids),
                "tokens": len(answer.output),
                "wall_s": round(float(stats.pop("wall_s", wall)), 4),
                "stop_word": answer.stop_word,
                "seed": seed,
                "sample": sample,
                "batch_size": len(prompts),
                **stats,
                "finish_reason": answer.finish,
            }
            self._record(stats)
            outputs.append(answer.text)
        return outputs
