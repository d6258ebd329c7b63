"""On-disk streaming layout: resident weights, one file of expert bundles, and a versioned index.

A converted model directory holds
  config.json, tokenizer files     carried over from the source checkpoint (config.py)
  resident.safetensors            every weight except the routed experts (mlx-lm names;
                                  model_dir.py checks it)
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
from edge0_eval.formats.json_files import read_json_file, type_ok

FORMAT = "edge0-experts"
FORMAT_VERSION = 1
INDEX_NAME = "experts.index.json"
EXPERTS_NAME = "experts.bin"
RESIDENT_NAME = "resident.safetensors"
RECONVERT = (
    "re-run `edge0-eval convert`"  # the fix for any damaged converted-model file
)
ALIGNMENT = 4096
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
PARTS = ("weight", "scales", "biases")
TENSOR_ORDER = tuple(f"{p}.{q}" for p in PROJECTIONS for q in PARTS)

# numpy has no bfloat16: such tensors travel as raw uint16 and are reinterpreted in MLX.
_NP_DTYPES = {
    "uint32": np.uint32,
    "float16": np.float16,
    "bfloat16": np.uint16,
    "float32": np.float32,
}


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
    moe_layers: list[
        int
    ]  # decoder layer indices that have routed experts, in file order
    module_path: str  # e.g. "language_model.model.layers.{layer}.mlp.switch_mlp"
    bits: int
    group_size: int
    mode: str
    tensors: list[TensorSpec]
    bundle_bytes: int  # payload of one bundle
    bundle_stride: int  # bytes between bundle starts (payload padded to alignment)
    file: str = EXPERTS_NAME
    file_size: int = 0
    alignment: int = ALIGNMENT
    source: dict = field(
        default_factory=dict
    )  # source file name -> {"sha256", "bytes"}
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
            raise KeyError(
                f"layer {layer} has no routed experts in this index"
            ) from None

    def bundle_offset(self, layer: int, expert: int) -> int:
        if not 0 <= expert < self.num_experts:
            raise IndexError(f"expert {expert} out of range 0..{self.num_experts - 1}")
        return (
            self.layer_position(layer) * self.num_experts + expert
        ) * self.bundle_stride

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
        data = read_json_file(path, "expert index", RECONVERT)
        if data.get("format") != FORMAT:
            raise CheckpointError(
                f"{path}: format {data.get('format')!r} is not {FORMAT!r}"
            )
        if data.get("format_version") != FORMAT_VERSION:
            raise CheckpointError(
                f"{path}: format_version {data.get('format_version')!r} is not supported "
                f"(this build reads version {FORMAT_VERSION}); re-run `edge0-eval convert`"
            )
        check_index_fields(data, path)
        data = dict(data)
        data["tensors"] = [TensorSpec(**t) for t in data["tensors"]]
        index = cls(**data)
        index.validate(directory if check_file else None)
        return index

    def validate(self, directory: str | Path | None = None) -> None:
        """Check internal consistency and, given the directory, the expert file's size.

        The bundle layout is fully determined by the tensors' shapes and dtypes (TENSOR_ORDER,
        64-byte aligned), so any other offset (swapped gate/up, overlaps) is a corrupt index.
        """
        where = f"{Path(directory) / INDEX_NAME}" if directory else INDEX_NAME
        names = [t.name for t in self.tensors]
        if names != list(TENSOR_ORDER):
            raise CheckpointError(
                f"{where}: bundle tensors {names} are not {list(TENSOR_ORDER)} "
                f"in that order; {RECONVERT}"
            )
        _check_quant(self, where)
        want, nbytes = make_tensor_specs(
            {t.name: (t.shape, t.dtype) for t in self.tensors}
        )
        for spec, good in zip(self.tensors, want):
            if (spec.offset, spec.nbytes) != (good.offset, good.nbytes):
                raise CheckpointError(
                    f"{where}: tensor {spec.name} is at offset {spec.offset} ({spec.nbytes} "
                    f"bytes) but the bundle layout puts it at {good.offset} ({good.nbytes} "
                    f"bytes): offsets swapped, overlapping or sized wrong; {RECONVERT}"
                )
        if (
            self.bundle_bytes != nbytes
            or self.alignment != ALIGNMENT
            or self.bundle_stride != align(nbytes, ALIGNMENT)
        ):
            raise CheckpointError(
                f"{where}: bundle_bytes {self.bundle_bytes} / bundle_stride "
                f"{self.bundle_stride} / alignment {self.alignment} do not "
                f"match the tensors ({nbytes} bytes, stride "
                f"{align(nbytes, ALIGNMENT)}); {RECONVERT}"
            )
        if len(set(self.moe_layers)) != len(
            self.moe_layers
        ) or self.moe_layers != sorted(self.moe_layers):
            raise CheckpointError(
                f"{where}: moe_layers {self.moe_layers} must be distinct and "
                f"ascending; {RECONVERT}"
            )
        if self.file_size != self.expected_file_size():
            raise CheckpointError(
                f"{where}: file_size {self.file_size} does not match "
                f"{len(self.moe_layers)} layers x {self.num_experts} experts"
            )
        if self.crc32 and (
            len(self.crc32) != len(self.moe_layers)
            or any(len(row) != self.num_experts for row in self.crc32)
        ):
            raise CheckpointError(
                f"{where}: crc32 must hold one row of {self.num_experts} "
                f"checksums per MoE layer ({len(self.moe_layers)}); "
                f"{RECONVERT}"
            )
        if directory is not None:
            path = Path(directory) / self.file
            if not path.is_file():
                raise CheckpointError(
                    f"{path} is missing (the expert file {INDEX_NAME} names "
                    f"in 'file'); re-run `edge0-eval convert`"
                )
            actual = path.stat().st_size
            if actual != self.file_size:
                raise CheckpointError(
                    f"{path} is {actual} bytes but {INDEX_NAME} says {self.file_size}: "
                    f"the file is truncated or belongs to another conversion; re-run convert"
                )


# What mx.quantize accepts: mode -> (bits, group sizes); scales dtype per mode.
QUANT_MODES = {"affine": ((2, 3, 4, 5, 6, 8), (32, 64, 128))}
_HALF = ("float16", "bfloat16", "float32")

# field -> (JSON type, check, what it must be)
_FIELDS = {
    "model_type": (str, bool, "a model type string"),
    "num_experts": (int, lambda v: v > 0, "a positive integer"),
    "moe_layers": (
        list,
        lambda v: len(v) > 0 and all(type_ok(x, int) and x >= 0 for x in v),
        "a non-empty list of layer numbers",
    ),
    "module_path": (
        str,
        lambda v: "{layer}" in v,
        "a path template containing {layer}",
    ),
    "bits": (int, lambda v: v > 0, "a positive integer"),
    "group_size": (int, lambda v: v > 0, "a positive integer"),
    "mode": (str, bool, "a quantization mode such as 'affine'"),
    "tensors": (list, bool, "a list of tensor entries"),
    "bundle_bytes": (int, lambda v: v > 0, "a positive integer"),
    "bundle_stride": (int, lambda v: v > 0, "a positive integer"),
    "file": (
        str,
        lambda v: bool(v) and "/" not in v and v not in (".", ".."),
        "a file name beside the index",
    ),
    "file_size": (int, lambda v: v >= 0, "a byte count"),
    "alignment": (int, lambda v: v > 0, "a positive integer"),
    "source": (dict, lambda v: True, "an object"),
    "crc32": (
        list,
        lambda v: all(
            isinstance(r, list) and all(type_ok(c, int) and 0 <= c < 2**32 for c in r)
            for r in v
        ),
        "a list of rows of 32-bit checksums",
    ),
    "format": (str, bool, "'edge0-experts'"),
    "format_version": (int, bool, "an integer"),
}
_REQUIRED = (
    "model_type",
    "num_experts",
    "moe_layers",
    "module_path",
    "bits",
    "group_size",
    "mode",
    "tensors",
    "bundle_bytes",
    "bundle_stride",
)


def check_index_fields(data: dict, path) -> None:
    """Types and ranges of every index field, before any dataclass or numpy sees them."""
    unknown = sorted(set(data) - set(_FIELDS))
    if unknown:
        raise CheckpointError(f"{path}: unknown field(s) {unknown}; {RECONVERT}")
    for key in _REQUIRED:
        if key not in data:
            raise CheckpointError(
                f"{path}: required field {key!r} is missing; {RECONVERT}"
            )
    for key, value in data.items():
        kind, ok, want = _FIELDS[key]
        good = type_ok(value, int) if kind is int else isinstance(value, kind)
        if not good or not ok(value):
            raise CheckpointError(
                f"{path}: field {key!r} is {_short(value)}; it must be {want}; "
                f"{RECONVERT}"
            )
    for i, t in enumerate(data["tensors"]):
        if not isinstance(t, dict) or set(t) != {
            "name",
            "shape",
            "dtype",
            "offset",
            "nbytes",
        }:
            raise CheckpointError(
                f"{path}: tensors[{i}] must be an object with name, shape, "
                f"dtype, offset, nbytes; {RECONVERT}"
            )
        if not isinstance(t["dtype"], str) or t["dtype"] not in _NP_DTYPES:
            raise CheckpointError(
                f"{path}: tensors[{i}] ({t['name']!r}) has dtype "
                f"{_short(t['dtype'])}; known: {', '.join(_NP_DTYPES)}"
            )
        if not (
            isinstance(t["name"], str)
            and isinstance(t["shape"], list)
            and t["shape"]
            and all(type_ok(d, int) and d > 0 for d in t["shape"])
            and type_ok(t["offset"], int)
            and t["offset"] >= 0
            and type_ok(t["nbytes"], int)
            and t["nbytes"] > 0
        ):
            raise CheckpointError(
                f"{path}: tensors[{i}] has a bad name, shape, offset or nbytes "
                f"({_short(t)}); {RECONVERT}"
            )


def _short(value) -> str:
    text = repr(value)
    return text if len(text) < 80 else text[:77] + "..."


def _check_quant(index: "ExpertIndex", where) -> None:
    """Bits/group/mode MLX can serve, and tensor shapes/dtypes that follow from them."""
    if index.mode not in QUANT_MODES:
        raise CheckpointError(
            f"{where}: mode {index.mode!r} is not supported (supported: "
            f"{', '.join(QUANT_MODES)}); {RECONVERT}"
        )
    bits, groups = QUANT_MODES[index.mode]
    if index.bits not in bits or index.group_size not in groups:
        raise CheckpointError(
            f"{where}: bits {index.bits} / group_size {index.group_size} are "
            f"not supported by {index.mode} (bits {bits}, groups {groups}); "
            f"{RECONVERT}"
        )
    specs = {t.name: t for t in index.tensors}
    halves = set()
    for proj in PROJECTIONS:
        w, s, b = (specs[f"{proj}.{p}"] for p in PARTS)
        if w.dtype != "uint32":
            raise CheckpointError(
                f"{where}: {w.name} is {w.dtype}; packed weights are uint32"
            )
        if (
            len(w.shape) != 2
            or s.shape != b.shape
            or len(s.shape) != 2
            or s.shape[0] != w.shape[0]
            or w.shape[1] * 32 != s.shape[1] * index.group_size * index.bits
        ):
            raise CheckpointError(
                f"{where}: {proj} shapes weight {w.shape} / scales {s.shape} / biases {b.shape} "
                f"do not fit {index.bits}-bit groups of {index.group_size}; {RECONVERT}"
            )
        for spec in (s, b):
            if spec.dtype not in _HALF:
                raise CheckpointError(
                    f"{where}: {spec.name} is {spec.dtype}; scales and biases "
                    f"are one of {', '.join(_HALF)}"
                )
            halves.add(spec.dtype)
    if len(halves) > 1:
        raise CheckpointError(
            f"{where}: scales/biases mix dtypes {sorted(halves)}; a conversion "
            f"writes one; {RECONVERT}"
        )
    gate, up, down = (specs[f"{p}.weight"] for p in PROJECTIONS)
    if gate.shape != up.shape:
        raise CheckpointError(
            f"{where}: gate_proj {gate.shape} and up_proj {up.shape} differ"
        )
    inter = gate.shape[0]
    hidden = gate.shape[1] * 32 // index.bits
    if down.shape[0] != hidden or down.shape[1] * 32 // index.bits != inter:
        raise CheckpointError(
            f"{where}: down_proj {down.shape} does not map the experts' "
            f"{inter} features back to {hidden}; {RECONVERT}"
        )


def make_tensor_specs(
    shapes: dict[str, tuple[list[int], str]],
) -> tuple[list[TensorSpec], int]:
    """Lay out the bundle tensors in TENSOR_ORDER, each 64-byte aligned. Returns specs, bytes."""
    specs, offset = [], 0
    for name in TENSOR_ORDER:
        shape, dtype = shapes[name]
        nbytes = int(np.prod(shape)) * np.dtype(_NP_DTYPES[dtype]).itemsize
        offset = align(offset, 64)
        specs.append(
            TensorSpec(
                name=name, shape=list(shape), dtype=dtype, offset=offset, nbytes=nbytes
            )
        )
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
        buf[spec.offset : spec.offset + spec.nbytes] = raw.tobytes()
    return bytes(buf)


def unpack_bundle(index: ExpertIndex, buf) -> dict[str, np.ndarray]:
    """Zero-copy numpy views of one bundle's tensors (bfloat16 as raw uint16)."""
    mem = memoryview(buf)
    out = {}
    for spec in index.tensors:
        view = np.frombuffer(
            mem[spec.offset : spec.offset + spec.nbytes], dtype=_NP_DTYPES[spec.dtype]
        )
        out[spec.name] = view.reshape(spec.shape)
    return out
