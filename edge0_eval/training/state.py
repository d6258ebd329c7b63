"""Training checkpoints shared by every stage: parameters + optimizer state + JSON metadata in
one safetensors file, written atomically so a kill never leaves a half-written checkpoint."""

from __future__ import annotations

import json
import os
from pathlib import Path

import mlx.core as mx

from edge0_eval.errors import CheckpointError


def save_training_state(path: Path, params: dict[str, mx.array], optimizer,
                        meta: dict[str, object]) -> None:
    """`params` under "params.", the optimizer state under "opt."; `meta` values JSON-encoded."""
    from mlx.utils import tree_flatten

    arrays = {f"params.{k}": v for k, v in params.items()}
    arrays.update({f"opt.{k}": v for k, v in tree_flatten(optimizer.state)})
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp.safetensors")
    mx.save_safetensors(str(tmp), arrays, metadata={k: json.dumps(v) for k, v in meta.items()})
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_training_state(path: Path) -> tuple[dict[str, mx.array], dict, dict]:
    """(params, optimizer state tree, meta) of a checkpoint; one clear error if unreadable."""
    from mlx.utils import tree_unflatten

    try:
        arrays, raw = mx.load(str(path), return_metadata=True)
        meta = {k: json.loads(v) for k, v in raw.items()}
        int(meta["step"])
    except Exception as exc:
        raise CheckpointError(f"training checkpoint {path} is unreadable ({exc}); rerun with "
                              f"--fresh") from None
    params = {k[len("params."):]: v for k, v in arrays.items() if k.startswith("params.")}
    opt = tree_unflatten([(k[4:], v) for k, v in arrays.items() if k.startswith("opt.")])
    return params, opt, meta
