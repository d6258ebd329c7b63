"""Reading a checkpoint mlx-lm loads: safetensors headers checked up front (the format check of
formats/safetensors.py), tensors read lazily.

The tensors are MLX's lazy loads (`mx.load` reads a tensor's bytes only when it is evaluated),
passed through the model's own mlx-lm `sanitize` as `mlx_lm.load` does, so every layout mlx-lm
loads (mlx-vlm conversions with vision and MTP weights, original Hugging Face names, fused or
per-expert experts) arrives under the model's names. `convert` takes each tensor once, so it holds
one tensor (or one layer's experts) at a time.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.utils import _decode_tagged_floats

from edge0_eval.errors import CheckpointError
from edge0_eval.formats.safetensors import read_safetensors_header


class Checkpoint:
    """A checkpoint directory: config plus lazily read tensors spread over one or more shards.

    Until `sanitize` runs, the tensors carry the file's names; after it, the model's.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(
                f"{self.path} not found or not a directory: SRC must be a "
                f"checkpoint directory mlx-lm loads"
            )
        config_path = self.path / "config.json"
        if not config_path.is_file():
            raise CheckpointError(
                f"{config_path} not found: SRC must be a checkpoint directory "
                f"mlx-lm loads (config.json + *.safetensors)"
            )
        try:
            self.config = _decode_tagged_floats(json.loads(config_path.read_text()))
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"{config_path} is not valid JSON ({exc})") from None
        if not isinstance(self.config, dict):
            raise CheckpointError(f"{config_path} is not a JSON object")
        self.files = self._weight_files()
        self.weights: dict[str, mx.array] = {}
        for f in self.files:
            # The header by the format's rules first: MLX is never handed a malformed one.
            read_safetensors_header(
                f, "checkpoint shard", "re-download or re-save the checkpoint"
            )
            try:
                self.weights.update(mx.load(str(f)))
            except (RuntimeError, ValueError) as exc:
                raise CheckpointError(
                    f"{f} cannot be read by MLX ({exc}); re-download "
                    f"or re-save the checkpoint"
                ) from None

    def _weight_files(self) -> list[Path]:
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            try:
                names = sorted(
                    set(json.loads(index.read_text())["weight_map"].values())
                )
            except (json.JSONDecodeError, KeyError, AttributeError, TypeError) as exc:
                raise CheckpointError(f"{index} is malformed ({exc})") from None
            missing = [n for n in names if not (self.path / n).is_file()]
            if missing:
                raise CheckpointError(
                    f"{index} lists shard(s) missing from {self.path}: "
                    f"{', '.join(missing)}"
                )
            return [self.path / n for n in names]
        files = sorted(self.path.glob("model*.safetensors")) or sorted(
            self.path.glob("*.safetensors")
        )
        if not files:
            raise CheckpointError(f"no *.safetensors weights in {self.path}")
        return files

    def sanitize(self, model) -> None:
        """Rename, split, stack and drop tensors exactly as `mlx_lm.load` does for `model`.

        Lazy: nothing is read; a fused or per-expert source tensor is read when the first
        tensor made from it is taken.
        """
        if not hasattr(model, "sanitize"):
            return
        try:
            self.weights = model.sanitize(dict(self.weights))
        except (KeyError, ValueError, IndexError, TypeError) as exc:
            raise CheckpointError(
                f"{self.path}: mlx-lm's sanitize for model_type {self.model_type!r} failed "
                f"({type(exc).__name__}: {exc}); the weights do not match config.json (a shard "
                f"missing, or another model's config?)"
            ) from None

    @property
    def model_type(self) -> str:
        return self.config.get("model_type", "")

    @property
    def quantization(self) -> dict | None:
        return self.config.get("quantization")

    def names(self) -> list[str]:
        return list(self.weights)

    def __contains__(self, name: str) -> bool:
        return name in self.weights

    def shape(self, name: str) -> list[int]:
        return list(self.weights[name].shape)

    def dtype(self, name: str) -> str:
        return str(self.weights[name].dtype).rpartition(".")[2]

    def nbytes(self, name: str) -> int:
        return self.weights[name].nbytes

    def take(self, name: str) -> mx.array:
        """The tensor, read now and forgotten here, so its memory goes when the caller drops it."""
        arr = self.weights.pop(name)
        try:
            mx.eval(arr)
        except (RuntimeError, ValueError) as exc:
            raise CheckpointError(
                f"{self.path}: reading {name} failed ({exc}); the file "
                f"changed or is damaged: re-download it"
            ) from None
        return arr

    def source_files(self) -> list[Path]:
        return [self.path / "config.json"] + list(self.files)


def to_numpy(arr) -> np.ndarray:
    """MLX -> numpy, bfloat16 as raw uint16 (numpy has no bfloat16)."""
    if arr.dtype == mx.bfloat16:
        arr = arr.view(mx.uint16)
    return np.array(arr, copy=False)
