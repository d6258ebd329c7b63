"""Draft-token hedge: guess the next token from a slice of the LM head, before the LM head runs.

A draft vocabulary file (`edge0-eval draft-vocab`) lists token ids, most frequent first. The
`DraftHead` applies the model's final norm and the LM head's rows for those ids (a row slice of
the same weights, with the head's LoRA if it has one) to the last layer's output and takes the
argmax. Next-token prerouter heads evaluated at that draft are a hedge whose sets are the routing
itself whenever the served token is the draft (engine/routing.py). Routing never depends on the
draft: it only decides which bundles start loading before the token exists.

The file (`{"ids": int32 [N]}` and its metadata) is formats/draft_file.py's.
"""

from __future__ import annotations

import copy

import mlx.core as mx
import mlx.nn as nn

from edge0_eval.engine.lora import LoRALinear


def row_slice(head: nn.Module, ids: mx.array) -> nn.Module:
    """A copy of an output layer (Linear, QuantizedLinear, Embedding or QuantizedEmbedding used
    as a linear, or a LoRALinear around one) holding only the rows `ids`."""
    if isinstance(head, LoRALinear):
        out = copy.copy(head)
        out.linear = row_slice(head.linear, ids)
        out.lora_B = head.lora_B[ids]
        return out
    if not isinstance(head.get("weight"), mx.array):
        raise TypeError(
            f"cannot slice the rows of a {type(head).__name__} output layer"
        )
    out = copy.copy(head)
    for name in ("weight", "scales", "biases", "bias"):
        if out.get(name) is not None:
            out[name] = head[name][ids]
    return out


def _rows(head: nn.Module) -> int:
    return (
        _rows(head.linear)
        if isinstance(head, LoRALinear)
        else int(head.weight.shape[0])
    )


class DraftHead:
    """norm(h at the last position) -> the argmax token among `ids`, one per row; a sampled
    row adds the noise its sampler will draw (`RowSampler.draft_noise`) to logits /
    temperature, as the sample itself will."""

    def __init__(self, norm: nn.Module, head: nn.Module, tied: bool, ids: mx.array):
        self.norm, self.ids, self.tied = norm, ids, tied
        self.vocab = _rows(head)
        self.head = row_slice(head, ids)
        mx.eval(self.head.parameters())

    def __call__(self, h: mx.array, samplers: list | None = None) -> mx.array:
        x = self.norm(h[:, -1])
        logits = self.head.as_linear(x) if self.tied else self.head(x)
        if samplers and any(s.temperature > 0 for s in samplers):
            noise = [s.draft_noise(self.vocab) for s in samplers]
            scale = mx.array(
                [[1.0 / s.temperature if s.temperature > 0 else 1.0] for s in samplers]
            )
            gumbel = mx.stack(
                [mx.zeros(self.ids.shape) if g is None else g[self.ids] for g in noise]
            )
            logits = logits.astype(mx.float32) * scale + gumbel
        return self.ids[mx.argmax(logits, axis=-1)]
