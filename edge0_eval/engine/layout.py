"""On-disk streaming layout: resident weights, one file of expert bundles, and a versioned index.

A converted model directory holds
  config.json, tokenizer files     carried over from the source checkpoint
  resident.safetensors            every weight except the routed experts (mlx-lm names)
  experts.bin                     one bundle per (MoE layer, expert), each page-aligned
  experts.index.json              this module's `ExpertIndex`

A bundle holds, in a fixed order, gate/up/down `weight` (packed uint32), `scales` and `biases`
of one expert, so one positioned read brings the whole expert. The order of tensors inside a
bundle and their byte offsets are the same for every bundle and recorded once in the index.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from edge0_eval.errors import CheckpointError

FORMAT = "edge0-experts"
FORMAT_VERSION = 1
INDEX_NAME = "experts.index.json"
EXPERTS_NAME = "experts.bin"
RESIDENT_NAME = "resident.safetensors"
ALIGNMENT = 4096
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
PARTS = ("weight", "scales", "biases")
TENSOR_ORDER = tuple(f"{p}.{q}" for p in PROJECTIONS for q in PARTS)

# numpy has no bfloat16: such tensors travel as raw uint16 and are reinterpreted in MLX.
_NP_DTYPES = {"uint32": np.uint32, "float16": np.float16, "bfloat16": np.uint16,
              "float32": np.float32}


def align(n: int, alignment: int = ALIGNMENT) -> int:
    return (n + alignment - 1) // alignment * alignment


@dataclass
class TensorSpec:
    """One tensor inside a bundle: offset relative to the bundle start."""

    name: str
    shape: list[int]
    dtype: str
    offset: int
    nbytes: int


@dataclass
class ExpertIndex:
    model_type: str
    num_experts: int
    moe_layers: list[int]          # decoder layer indices that have routed experts, in file order
    module_path: str               # e.g. "language_model.model.layers.{layer}.mlp.switch_mlp"
    bits: int
    group_size: int
    mode: str
    tensors: list[TensorSpec]
    bundle_bytes: int              # payload of one bundle
    bundle_stride: int             # bytes between bundle starts (payload padded to alignment)
    file: str = EXPERTS_NAME
    file_size: int = 0
    alignment: int = ALIGNMENT
    source: dict = field(default_factory=dict)   # source file name -> {"sha256", "bytes"}
    crc32: list[list[int]] = field(default_factory=list)  # [moe layer position][expert]
    format: str = FORMAT
    format_version: int = FORMAT_VERSION

    # -- geometry ---------------------------------------------------------------------------
    def layer_position(self, layer: int) -> int:
        try:
            return self._positions[layer]
        except AttributeError:
            self._positions = {l: i for i, l in enumerate(self.moe_layers)}
            return self.layer_position(layer)
        except KeyError:
            raise KeyError(f"layer {layer} has no routed experts in this index") from None

    def bundle_offset(self, layer: int, expert: int) -> int:
        if not 0 <= expert < self.num_experts:
            raise IndexError(f"expert {expert} out of range 0..{self.num_experts - 1}")
        return (self.layer_position(layer) * self.num_experts + expert) * self.bundle_stride

    def expected_file_size(self) -> int:
        return len(self.moe_layers) * self.num_experts * self.bundle_stride

    def tensor(self, name: str) -> TensorSpec:
        for spec in self.tensors:
            if spec.name == name:
                return spec
        raise KeyError(name)

    # -- (de)serialisation ------------------------------------------------------------------
    def to_json(self) -> dict:
        data = asdict(self)
        data.pop("_positions", None)
        return data

    def save(self, directory: str | Path) -> Path:
        path = Path(directory) / INDEX_NAME
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1))
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, directory: str | Path, check_file: bool = True) -> "ExpertIndex":
        directory = Path(directory)
        path = directory / INDEX_NAME
        if not path.is_file():
            raise CheckpointError(
                f"{path} not found: {directory} is not a converted Edge0 model; "
                f"run `edge0-eval convert SRC {directory}` first"
            )
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"{path} is not valid JSON ({exc}); re-run convert") from None
        if data.get("format") != FORMAT:
            raise CheckpointError(f"{path}: format {data.get('format')!r} is not {FORMAT!r}")
        if data.get("format_version") != FORMAT_VERSION:
            raise CheckpointError(
                f"{path}: format_version {data.get('format_version')!r} is not supported "
                f"(this build reads version {FORMAT_VERSION}); re-run `edge0-eval convert`"
            )
        try:
            data["tensors"] = [TensorSpec(**t) for t in data["tensors"]]
            index = cls(**data)
        except (TypeError, KeyError) as exc:
            raise CheckpointError(f"{path}: malformed index ({exc}); re-run convert") from None
        index.validate(directory if check_file else None)
        return index

    def validate(self, directory: str | Path | None = None) -> None:
        """Check internal consistency and, given the directory, the expert file's size."""
        where = f"{Path(directory) / INDEX_NAME}" if directory else INDEX_NAME
        names = [t.name for t in self.tensors]
        if sorted(names) != sorted(TENSOR_ORDER):
            raise CheckpointError(f"{where}: bundle tensors {names} are not {list(TENSOR_ORDER)}")
        end = 0
        for spec in self.tensors:
            want = int(np.prod(spec.shape)) * np.dtype(_NP_DTYPES[spec.dtype]).itemsize
            if spec.nbytes != want or spec.offset < end:
                raise CheckpointError(f"{where}: tensor {spec.name} has inconsistent size/offset")
            end = spec.offset + spec.nbytes
        if end > self.bundle_bytes or self.bundle_stride < self.bundle_bytes:
            raise CheckpointError(f"{where}: bundle size {self.bundle_bytes} inconsistent")
        if self.file_size != self.expected_file_size():
            raise CheckpointError(f"{where}: file_size {self.file_size} does not match "
                                  f"{len(self.moe_layers)} layers x {self.num_experts} experts")
        if directory is not None:
            path = Path(directory) / self.file
            if not path.is_file():
                raise CheckpointError(f"{path} is missing; re-run `edge0-eval convert`")
            actual = path.stat().st_size
            if actual != self.file_size:
                raise CheckpointError(
                    f"{path} is {actual} bytes but {INDEX_NAME} says {self.file_size}: "
                    f"the file is truncated or belongs to another conversion; re-run convert"
                )


def make_tensor_specs(shapes: dict[str, tuple[list[int], str]]) -> tuple[list[TensorSpec], int]:
    """Lay out the bundle tensors in TENSOR_ORDER, each 64-byte aligned. Returns specs, bytes."""
    specs, offset = [], 0
    for name in TENSOR_ORDER:
        shape, dtype = shapes[name]
        nbytes = int(np.prod(shape)) * np.dtype(_NP_DTYPES[dtype]).itemsize
        offset = align(offset, 64)
        specs.append(TensorSpec(name=name, shape=list(shape), dtype=dtype, offset=offset,
                                nbytes=nbytes))
        offset += nbytes
    return specs, offset


def pack_bundle(index: ExpertIndex, arrays: dict[str, np.ndarray]) -> bytes:
    """Serialise one expert's tensors into a bundle of `bundle_stride` bytes."""
    buf = bytearray(index.bundle_stride)
    for spec in index.tensors:
        arr = np.ascontiguousarray(arrays[spec.name])
        raw = arr.view(np.uint8).reshape(-1)
        if raw.size != spec.nbytes or list(arr.shape) != spec.shape:
            raise CheckpointError(
                f"tensor {spec.name}: shape {list(arr.shape)} / {raw.size} bytes does not match "
                f"the index ({spec.shape} / {spec.nbytes})"
            )
        buf[spec.offset: spec.offset + spec.nbytes] = raw.tobytes()
    return bytes(buf)


def unpack_bundle(index: ExpertIndex, buf) -> dict[str, np.ndarray]:
    """Zero-copy numpy views of one bundle's tensors (bfloat16 as raw uint16)."""
    mem = memoryview(buf)
    out = {}
    for spec in index.tensors:
        view = np.frombuffer(mem[spec.offset: spec.offset + spec.nbytes],
                             dtype=_NP_DTYPES[spec.dtype])
        out[spec.name] = view.reshape(spec.shape)
    return out


def numpy_dtype(dtype: str):
    return _NP_DTYPES[dtype]
