"""What every stage keeps on disk and how it resumes: checkpoints (parameters + optimizer state +
JSON metadata in one safetensors file, written atomically so a kill never leaves a half-written
checkpoint), fingerprints of the inputs, the resume rule, report paths and the test hooks."""

from __future__ import annotations

import hashlib
import json
import os
import signal
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from edge0_eval.errors import CheckpointError

# -- checkpoint files ------------------------------------------------------------------------------


def save_training_state(
    path: Path, params: dict[str, mx.array], optimizer, meta: dict[str, object]
) -> None:
    """`params` under "params.", the optimizer state under "opt."; `meta` values JSON-encoded."""
    arrays = {f"params.{k}": v for k, v in params.items()}
    arrays.update({f"opt.{k}": v for k, v in tree_flatten(optimizer.state)})
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp.safetensors")
    mx.save_safetensors(
        str(tmp), arrays, metadata={k: json.dumps(v) for k, v in meta.items()}
    )
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_training_state(path: Path) -> tuple[dict[str, mx.array], dict, dict]:
    """(params, optimizer state tree, meta) of a checkpoint; one clear error if unreadable."""
    try:
        arrays, raw = mx.load(str(path), return_metadata=True)
        meta = {k: json.loads(v) for k, v in raw.items()}
        int(meta["step"])
    except Exception as exc:
        raise CheckpointError(
            f"training checkpoint {path} is unreadable ({exc}); rerun with --fresh"
        ) from None
    params = {
        k[len("params.") :]: v for k, v in arrays.items() if k.startswith("params.")
    }
    opt = tree_unflatten(
        [(k[4:], v) for k, v in arrays.items() if k.startswith("opt.")]
    )
    return params, opt, meta


# -- the resume rule -------------------------------------------------------------------------------


def begin(state_path: Path, resume: bool, fresh: bool) -> None:
    """--resume insists that a checkpoint exists; --fresh drops it."""
    if resume and not state_path.is_file():
        raise CheckpointError(f"--resume: no training checkpoint at {state_path}")
    if fresh and state_path.is_file():
        state_path.unlink()


def check_fingerprint(state_path: Path, saved: dict, current: dict) -> None:
    """A checkpoint written with other settings or inputs never resumes silently."""
    if saved != current:
        diff = sorted(
            k for k in set(saved) | set(current) if saved.get(k) != current.get(k)
        )
        raise CheckpointError(
            f"{state_path} was written with other settings or inputs "
            f"({', '.join(diff)} differ); rerun the original command to "
            f"resume, or add --fresh to start over"
        )


def announce_resume(verb: str, state_path: Path, step: int, steps: int) -> None:
    print(f"{verb}: resuming from {state_path} at step {step}/{steps}", flush=True)


class Interrupted(Exception):
    """Raised by the in-process test hook `stop_after` (a simulated kill after that step)."""


def after_step(step: int, stop_after: int | None, kill_after: int | None) -> None:
    """Test hooks, run after a step's checkpoint: SIGKILL this process (`kill_after`, a real
    kill) or raise Interrupted (`stop_after`, in process) once `step` is reached."""
    if kill_after is not None and step == kill_after:
        os.kill(os.getpid(), signal.SIGKILL)
    if stop_after is not None and step >= stop_after:
        raise Interrupted(f"stopped after step {step}")


# -- fingerprints ----------------------------------------------------------------------------------


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


_MODEL_JSON = (
    "config.json experts.index.json tokenizer.json tokenizer_config.json "
    "model.safetensors.index.json"
).split()


def model_fingerprint(model: str | Path) -> dict:
    """The model's own files only (adapters, heads and reports written beside it are not)."""
    model = Path(model)
    out = {"path": str(model.resolve())}
    for p in sorted(model.iterdir()):
        if not p.is_file():
            continue
        if p.name in _MODEL_JSON:
            out[p.name] = sha256_file(p)
        elif p.name in ("resident.safetensors", "experts.bin") or (
            p.name.startswith("model") and p.suffix == ".safetensors"
        ):
            out[p.name] = [p.stat().st_size, p.stat().st_mtime_ns]
    return out


def digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


# -- reports ---------------------------------------------------------------------------------------


def write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def report_paths(out: Path) -> tuple[Path, Path]:
    stem = out.name.removesuffix(".safetensors")
    return out.with_name(f"{stem}.report.json"), out.with_name(f"{stem}.report.md")
