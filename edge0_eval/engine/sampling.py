"""Per-row sampling: each row draws from its own key, never from MLX's global RNG.

A row's key is `mx.random.key(seed)`, split once per generated token, so its samples depend on
its seed and its own logits only: the same prompt and seed give the same sample alone or in any
batch, at any position in it (OpenCompass runs stay reproducible at any `batch_size`).
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.sample_utils import apply_top_p


class RowSampler:
    """One row's sampler: greedy at temperature 0, else top-p then categorical on its own key."""

    def __init__(self, temperature: float, top_p: float, seed: int):
        self.temperature, self.top_p = float(temperature), float(top_p)
        self._key = mx.random.key(seed) if self.temperature > 0 else None

    def __call__(self, logits: mx.array) -> mx.array:
        """logits [V] (one row) -> the token id, a lazy scalar."""
        logprobs = logits - mx.logsumexp(logits, keepdims=True)
        if self._key is None:
            return mx.argmax(logprobs, axis=-1)
        if 0 < self.top_p < 1.0:
            logprobs = apply_top_p(logprobs, self.top_p)
        self._key, sub = mx.random.split(self._key)
        return mx.random.categorical(logprobs * (1.0 / self.temperature), key=sub)
