"""Per-row sampling: each row draws from its own key, never from MLX's global RNG.

A row's key is `mx.random.key(seed)`, split once per generated token, so its samples depend on
its seed, its prompt and its own logits only: the same prompt and seed give the same sample
alone or in any batch, at any position in it (OpenCompass runs stay reproducible at any
`batch_size`). Filters and penalties are mlx-lm's (`sampling_options.py`). The engine
(`RowSampler`) and the mlx-lm teacher (model_wrappers/mlx_lm_model.py: `row_sampler`, with
mlx-lm's own logits processors) share them.
"""

from __future__ import annotations

import inspect
from typing import Callable, Mapping, Sequence

import mlx.core as mx
from mlx_lm.sample_utils import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    greedy_sampler,
    make_logits_processors,
)

from edge0_eval.engine.sampling_options import PENALTIES, check_filters, check_penalties

# mlx-lm's own default window of a penalty whose *_context_size is not given.
_MLX_CONTEXT = {
    p: inspect.signature(make_logits_processors)
    .parameters[p.replace("penalty", "context_size")]
    .default
    for p in PENALTIES
}


def row_sampler(
    seed: int,
    temperature: float,
    top_p: float = 1.0,
    min_p: float = 0.0,
    top_k: int = 0,
) -> Callable[[mx.array], mx.array]:
    """mlx-lm's sampler chain (make_sampler's filters, same order) drawing from its own key:
    logprobs -> token ids. Greedy needs no key: mlx-lm's argmax."""
    if temperature == 0:
        return greedy_sampler
    filters = []
    if 0 < top_p < 1.0:
        filters.append(lambda x: apply_top_p(x, top_p))
    if min_p != 0.0:
        filters.append(lambda x: apply_min_p(x, min_p))
    if top_k > 0:
        filters.append(lambda x: apply_top_k(x, top_k))
    return _KeyedSampler(mx.random.key(int(seed)), temperature, filters)


class _KeyedSampler:
    """Draws from its own key, split once per sample; `next_key` is the key the next sample
    will draw with (a draft hedge reproduces that sample's noise before the logits exist).

    One row, [V] (the engine) or [1, V] (mlx-lm's generate_step and BatchGenerator), is always
    drawn as a [V] vector: MLX 0.32's CPU categorical draws a [1, V] row by inverse CDF (one
    uniform) but [V] by Gumbel-max, so the shape would change the token drawn from the same
    logits and key. As [V] both arms draw alike and the draw is mlx-lm's `make_sampler` chain
    on that vector with MLX's global stream at this key."""

    def __init__(self, key: mx.array, temperature: float, filters: list):
        self._key, self.temperature, self._filters = key, temperature, filters

    def next_key(self) -> mx.array:
        return mx.random.split(self._key)[1]

    def __call__(self, logprobs: mx.array) -> mx.array:
        if logprobs.size != logprobs.shape[-1]:
            raise ValueError(
                f"a row sampler draws one row, not logprobs {logprobs.shape}"
            )
        self._key, key = mx.random.split(self._key)
        row = logprobs.reshape(-1)
        for f in self._filters:
            row = f(row)
        # categorical(x, key) of a [V] x is argmax(x + gumbel((V,), key)): `draft_noise`
        # relies on it
        token = mx.random.categorical(row * (1.0 / self.temperature), key=key)
        return token.reshape(logprobs.shape[:-1])


class RowSampler:
    """One engine row's sampler on logits, as mlx-lm's generate_step does it: the penalties
    (make_logits_processors) on the row's history, then the filter chain (top-p, min-p, top-k,
    temperature) drawing from the row's own key, as the teacher arm's.

    prompt: the row's prompt ids; the history a penalty sees is the prompt followed by every
    token this sampler drew (only the last tokens any penalty looks at are kept).
    penalties: `sampling_options.PENALTY_KEYS` options (None or {}: none).
    """

    def __init__(
        self,
        temperature: float,
        top_p: float,
        seed: int,
        top_k: int = 0,
        min_p: float = 0.0,
        *,
        prompt: Sequence[int] = (),
        penalties: Mapping | None = None,
    ):
        check_filters(top_k, min_p)
        penalties = check_penalties(penalties or {})
        self.temperature = float(temperature)
        self._sample = row_sampler(
            seed,
            self.temperature,
            top_p=float(top_p),
            min_p=float(min_p),
            top_k=int(top_k),
        )
        self._processors = make_logits_processors(**penalties)
        self._window = max(
            (
                penalties.get(p.replace("penalty", "context_size"), _MLX_CONTEXT[p])
                for p in PENALTIES
                if p in penalties
            ),
            default=0,
        )
        prompt = list(prompt)
        self._recent = (
            mx.array(prompt[max(len(prompt) - self._window, 0) :], dtype=mx.int32)
            if self._processors
            else None
        )

    def draft_noise(self, vocab: int) -> mx.array | None:
        """The Gumbel noise [vocab] the next sample adds to logits / temperature (the filters
        and penalties aside); None when greedy."""
        if self.temperature == 0:
            return None
        return mx.random.gumbel((vocab,), key=self._sample.next_key())

    def __call__(self, logits: mx.array) -> mx.array:
        """logits [V] (one row) -> the token id, a lazy scalar."""
        if self._processors:
            rows = logits[None]  # a new array: the processors write into it, not logits
            for processor in self._processors:
                rows = processor(self._recent, rows)
            logits = rows[0]
        token = self._sample(logits - mx.logsumexp(logits, keepdims=True))
        if self._processors:
            recent = mx.concatenate([self._recent, token.reshape(1).astype(mx.int32)])
            self._recent = recent[max(recent.shape[0] - self._window, 0) :]
        return token
