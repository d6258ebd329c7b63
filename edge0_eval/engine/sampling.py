"""Per-row sampling: each row draws from its own key, never from MLX's global RNG.

A row's key is `mx.random.key(seed)`, split once per generated token, so its samples depend on
its seed and its own logits only: the same prompt and seed give the same sample alone or in any
batch, at any position in it (OpenCompass runs stay reproducible at any `batch_size`). The
engine and the mlx-lm teacher (model_wrappers/mlx_lm_model.py) share `row_sampler`.
"""

from __future__ import annotations

from typing import Callable

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, greedy_sampler

from edge0_eval.errors import ConfigError


def row_sampler(seed: int, temperature: float, top_p: float = 1.0, min_p: float = 0.0,
                top_k: int = 0) -> Callable[[mx.array], mx.array]:
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
    will draw with (a draft hedge reproduces that sample's noise before the logits exist)."""

    def __init__(self, key: mx.array, temperature: float, filters: list):
        self._key, self.temperature, self._filters = key, temperature, filters

    def next_key(self) -> mx.array:
        return mx.random.split(self._key)[1]

    def __call__(self, logprobs: mx.array) -> mx.array:
        self._key, key = mx.random.split(self._key)
        for f in self._filters:
            logprobs = f(logprobs)
        # categorical(x, key) is argmax(x + gumbel(x.shape, key)): `draft_noise` relies on it
        return mx.random.categorical(logprobs * (1.0 / self.temperature), key=key)


def check_filters(top_k, min_p) -> None:
    """top_k a whole number >= 0 (0: off), min_p in [0, 1) (0: off), as mlx-lm's sampler takes."""
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ConfigError(f"top_k must be a whole number >= 0 (0: off), not {top_k!r}")
    if isinstance(min_p, bool) or not isinstance(min_p, (int, float)) or not 0 <= min_p < 1:
        raise ConfigError(f"min_p must be a number in [0, 1) (0: off), not {min_p!r}")


class RowSampler:
    """One engine row's sampler on logits: mlx-lm's chain (top-p, min-p, top-k, temperature)
    drawing from the row's own key, as the teacher arm's."""

    def __init__(self, temperature: float, top_p: float, seed: int, top_k: int = 0,
                 min_p: float = 0.0):
        check_filters(top_k, min_p)
        self.temperature = float(temperature)
        self._sample = row_sampler(seed, self.temperature, top_p=float(top_p),
                                   min_p=float(min_p), top_k=int(top_k))

    def draft_noise(self, vocab: int) -> mx.array | None:
        """The Gumbel noise [vocab] the next sample adds to logits / temperature (the filters
        aside); None when greedy."""
        if self.temperature == 0:
            return None
        return mx.random.gumbel((vocab,), key=self._sample.next_key())

    def __call__(self, logits: mx.array) -> mx.array:
        """logits [V] (one row) -> the token id, a lazy scalar."""
        return self._sample(logits - mx.logsumexp(logits, keepdims=True))
