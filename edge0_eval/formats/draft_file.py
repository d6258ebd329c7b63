"""Draft vocabulary files (`edge0-eval draft-vocab`): the token ids a draft-token hedge drafts
among, most frequent first (engine/draft.py's `DraftHead`).

File: safetensors `{"ids": int32 [N]}`, metadata `kind = "draft_vocab"`, `vocab_size`,
`format_version`, and where the counts came from.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np

from edge0_eval.errors import CheckpointError
from edge0_eval.formats.safetensors import read_safetensors_header, write_safetensors

DRAFT_KIND = "draft_vocab"
FORMAT_VERSION = 1


def save_draft_vocab(
    path: str | Path, ids: np.ndarray, vocab_size: int, metadata: dict
) -> Path:
    """Write ids (most frequent first) for a vocabulary of `vocab_size`, with `metadata`."""
    meta = {k: str(v) for k, v in metadata.items()} | {
        "kind": DRAFT_KIND,
        "vocab_size": str(int(vocab_size)),
        "format_version": str(FORMAT_VERSION),
    }
    return write_safetensors(
        path, {"ids": mx.array(np.asarray(ids, dtype=np.int32))}, meta
    )


def is_draft_file(path: Path) -> bool:
    """Whether a hedge file is a draft vocabulary (else prerouter heads), from its header."""
    try:
        return read_safetensors_header(path, "hedge", "")[1].get("kind") == DRAFT_KIND
    except CheckpointError:
        return False  # the heads loader reports what is wrong with it


def load_draft_vocab(path: Path, vocab_size: int) -> mx.array:
    """The ids [N] of a draft vocabulary file, checked against the model's vocabulary."""
    fix = "write it again with `edge0-eval draft-vocab`"
    try:
        arrays, meta = mx.load(str(path), return_metadata=True)
    except Exception as exc:  # MLX raises bare RuntimeError/ValueError on bad files
        raise CheckpointError(
            f"{path}: not a readable safetensors file ({exc}); {fix}"
        ) from None
    ids = arrays.get("ids")
    if meta.get("kind") != DRAFT_KIND or ids is None:
        raise CheckpointError(
            f"{path}: not a draft vocabulary (kind {meta.get('kind')!r}, "
            f"arrays {sorted(arrays)}); {fix}"
        )
    if meta.get("format_version") != str(FORMAT_VERSION):
        raise CheckpointError(
            f"{path}: draft vocabulary format_version {meta.get('format_version')!r}; "
            f"this version reads {FORMAT_VERSION}; {fix}"
        )
    if ids.ndim != 1 or ids.size == 0 or not mx.issubdtype(ids.dtype, mx.integer):
        raise CheckpointError(
            f"{path}: ids must be a non-empty 1-D integer array, not "
            f"{ids.dtype} {tuple(ids.shape)}; {fix}"
        )
    values = np.array(ids).astype(np.int64)
    if (
        meta.get("vocab_size") != str(vocab_size)
        or values.min() < 0
        or values.max() >= vocab_size
        or np.unique(values).size != values.size
    ):
        raise CheckpointError(
            f"{path}: ids for a vocabulary of {meta.get('vocab_size')} tokens (range "
            f"{values.min()}..{values.max()}, unique {np.unique(values).size} of "
            f"{values.size}); this model has {vocab_size}; {fix} for this model"
        )
    return mx.array(values.astype(np.int32))
