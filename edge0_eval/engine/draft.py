"""Draft-token hedge: guess the next token from a slice of the LM head, before the LM head runs.

A draft vocabulary file (`edge0-eval draft-vocab`) lists token ids, most frequent first. The
`DraftHead` applies the model's final norm and the LM head's rows for those ids (a row slice of
the same weights, with the head's LoRA if it has one) to the last layer's output and takes the
argmax. Next-token prerouter heads evaluated at that draft are a hedge whose sets are the routing
itself whenever the served token is the draft (engine/prerouted.py). Routing never depends on the
draft: it only decides which bundles start loading before the token exists.

File: safetensors `{"ids": int32 [N]}`, metadata `kind = "draft_vocab"`, `vocab_size`,
`format_version`, and where the counts came from.
"""

from __future__ import annotations

import copy
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from edge0_eval.formats.safetensors import read_safetensors_header, write_safetensors
from edge0_eval.engine.lora import LoRALinear
from edge0_eval.errors import CheckpointError

DRAFT_KIND = "draft_vocab"
FORMAT_VERSION = 1


def save_draft_vocab(path: str | Path, ids: np.ndarray, vocab_size: int, metadata: dict) -> Path:
    meta = {k: str(v) for k, v in metadata.items()} | {
        "kind": DRAFT_KIND, "vocab_size": str(int(vocab_size)),
        "format_version": str(FORMAT_VERSION)}
    return write_safetensors(path, {"ids": mx.array(np.asarray(ids, dtype=np.int32))}, meta)


def is_draft_file(path: Path) -> bool:
    """Whether a hedge file is a draft vocabulary (else prerouter heads), from its header."""
    try:
        return read_safetensors_header(path, "hedge", "")[1].get("kind") == DRAFT_KIND
    except CheckpointError:
        return False            # the heads loader reports what is wrong with it


def load_draft_vocab(path: Path, vocab_size: int) -> mx.array:
    """The ids [N] of a draft vocabulary file, checked against the model's vocabulary."""
    fix = "write it again with `edge0-eval draft-vocab`"
    try:
        arrays, meta = mx.load(str(path), return_metadata=True)
    except Exception as exc:          # MLX raises bare RuntimeError/ValueError on bad files
        raise CheckpointError(f"{path}: not a readable safetensors file ({exc}); {fix}") from None
    ids = arrays.get("ids")
    if meta.get("kind") != DRAFT_KIND or ids is None:
        raise CheckpointError(f"{path}: not a draft vocabulary (kind {meta.get('kind')!r}, "
                              f"arrays {sorted(arrays)}); {fix}")
    if meta.get("format_version") != str(FORMAT_VERSION):
        raise CheckpointError(f"{path}: draft vocabulary format_version "
                              f"{meta.get('format_version')!r}; this version reads "
                              f"{FORMAT_VERSION}; {fix}")
    if ids.ndim != 1 or ids.size == 0 or not mx.issubdtype(ids.dtype, mx.integer):
        raise CheckpointError(f"{path}: ids must be a non-empty 1-D integer array, not "
                              f"{ids.dtype} {tuple(ids.shape)}; {fix}")
    values = np.array(ids).astype(np.int64)
    if meta.get("vocab_size") != str(vocab_size) or values.min() < 0 or \
            values.max() >= vocab_size or np.unique(values).size != values.size:
        raise CheckpointError(f"{path}: ids for a vocabulary of {meta.get('vocab_size')} tokens "
                              f"(range {values.min()}..{values.max()}, unique "
                              f"{np.unique(values).size} of {values.size}); this model has "
                              f"{vocab_size}; {fix} for this model")
    return mx.array(values.astype(np.int32))


def row_slice(head: nn.Module, ids: mx.array) -> nn.Module:
    """A copy of an output layer (Linear, QuantizedLinear, Embedding or QuantizedEmbedding used
    as a linear, or a LoRALinear around one) holding only the rows `ids`."""
    if isinstance(head, LoRALinear):
        out = copy.copy(head)
        out.linear = row_slice(head.linear, ids)
        out.lora_B = head.lora_B[ids]
        return out
    if not isinstance(head.get("weight"), mx.array):
        raise TypeError(f"cannot slice the rows of a {type(head).__name__} output layer")
    out = copy.copy(head)
    for name in ("weight", "scales", "biases", "bias"):
        if out.get(name) is not None:
            out[name] = head[name][ids]
    return out


def _rows(head: nn.Module) -> int:
    return _rows(head.linear) if isinstance(head, LoRALinear) else int(head.weight.shape[0])


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
            scale = mx.array([[1.0 / s.temperature if s.temperature > 0 else 1.0]
                              for s in samplers])
            gumbel = mx.stack([mx.zeros(self.ids.shape) if g is None else g[self.ids]
                               for g in noise])
            logits = logits.astype(mx.float32) * scale + gumbel
        return self.ids[mx.argmax(logits, axis=-1)]
