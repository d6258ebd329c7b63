"""On-disk streaming layout: resident weights, one file of expert bundles, and a versioned index.

A converted model directory holds
  config.json, tokenizer files     carried over from the source checkpoint (config.py)
  resident.safetensors            every weight except the routed experts (mlx-lm names;
                                  model_dir.py checks it)
  experts.bin                     one bundle per (MoE layer, expert), each page-aligned
  experts.index.json              this module's `ExpertIndex`

A bundle holds, in a fixed order, gate/up/down `weight` (packed uint32) and the parts their
quantization has (`scales`; `biases` for affine; `global_scale` for nvfp4 with a per-expert
scale), so one positioned read brings the whole expert. Each projection has its own
quantization (`Quant`: bits, group size, mode), as mlx-lm's mixed recipes give them; a layer's
bundles share one `BundleLayout` (tensor order, offsets, stride), and layers may differ.

Index versions: 1 describes one affine layout for every layer (the original format); 2 a list
of layouts and the layout of each layer. A conversion version 1 can describe is written as
version 1, so builds that predate version 2 still read it.

A bundle's checksum is zlib's CRC-32 (`crc32`, from zlib-ng: the same values as Python's zlib
module at SIMD speed, where a demand read waits for it).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from zlib_ng.zlib_ng import crc32 as crc32  # the index's checksum, re-exported

from edge0_eval.errors import CheckpointError
from edge0_eval.formats.json_files import read_json_file, type_ok

FORMAT = "edge0-experts"
FORMAT_VERSIONS = (1, 2)  # the index versions this build reads and writes
INDEX_NAME = "experts.index.json"
EXPERTS_NAME = "experts.bin"
RESIDENT_NAME = "resident.safetensors"
# the fix for any damaged converted-model file
RECONVERT = "re-run `edge0-eval convert`"
ALIGNMENT = 4096
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")

# numpy has no bfloat16: such tensors travel as raw uint16 and are reinterpreted in MLX.
_NP_DTYPES = {
    "uint32": np.uint32,
    "uint8": np.uint8,
    "float16": np.float16,
    "bfloat16": np.uint16,
    "float32": np.float32,
}
SCALE_DTYPES = ("float16", "bfloat16", "float32")  # affine scales and biases


def align(n: int, alignment: int = ALIGNMENT) -> int:
    return (n + alignment - 1) // alignment * alignment


# -- quantization of one projection ------------------------------------------------------------


@dataclass(frozen=True)
class ModeRule:
    """What mx.quantize accepts in a mode (MLX 0.32's table of quantization modes)."""

    bits: tuple[int, ...]
    group_sizes: tuple[int, ...]
    # scales + biases in the float dtype; otherwise uint8 scales, no biases
    affine: bool
    global_scale: bool = False  # may carry one float32 scale per expert


QUANT_MODES = {
    "affine": ModeRule((1, 2, 3, 4, 5, 6, 8), (32, 64, 128), affine=True),
    "mxfp4": ModeRule((4,), (32,), affine=False),
    "mxfp8": ModeRule((8,), (32,), affine=False),
    "nvfp4": ModeRule((4,), (16,), affine=False, global_scale=True),
}


@dataclass(frozen=True)
class Quant:
    """How one expert projection is quantized (mlx-lm's QuantizedSwitchLinear attributes)."""

    bits: int
    group_size: int
    mode: str = "affine"
    global_scale: bool = False  # nvfp4 with one float32 tensor scale per expert

    @property
    def parts(self) -> tuple[str, ...]:
        """The bundle tensors of a projection quantized this way, in bundle order."""
        parts = ("weight", "scales")
        if self.mode == "affine":
            parts += ("biases",)
        if self.global_scale:
            parts += ("global_scale",)
        return parts

    def part_specs(
        self, out_dim: int, in_dim: int, float_dtype: str
    ) -> dict[str, tuple[list[int], str]]:
        """part -> (per-expert shape, dtype) of an `out_dim x in_dim` weight, as mx.quantize
        returns them (affine scales in the weight's float dtype, the others' uint8)."""
        scale_dtype = float_dtype if self.mode == "affine" else "uint8"
        groups = [out_dim, in_dim // self.group_size]
        specs = {
            "weight": ([out_dim, in_dim * self.bits // 32], "uint32"),
            "scales": (groups, scale_dtype),
            "biases": (groups, scale_dtype),
            "global_scale": ([], "float32"),
        }
        return {part: specs[part] for part in self.parts}

    def problem(self) -> str | None:
        """Why mx.quantize would not accept this, or None."""
        rule = QUANT_MODES.get(self.mode)
        if rule is None:
            return f"mode {self.mode!r} is not one of {', '.join(QUANT_MODES)}"
        if self.bits not in rule.bits or self.group_size not in rule.group_sizes:
            return (
                f"bits {self.bits} / group_size {self.group_size} are not supported by "
                f"{self.mode} (bits {rule.bits}, groups {rule.group_sizes})"
            )
        if self.global_scale and not rule.global_scale:
            return f"mode {self.mode} has no global scale"
        return None

    def describe(self) -> str:
        text = f"{self.bits}-bit group {self.group_size} {self.mode}"
        return text + " with a global scale" if self.global_scale else text


# -- one layer's bundle ------------------------------------------------------------------------


@dataclass
class TensorSpec:
    """One tensor inside a bundle: offset relative to the bundle start."""

    name: str
    shape: list[int]
    dtype: str
    offset: int
    nbytes: int


def layout_names(quant: dict[str, Quant]) -> list[str]:
    """Bundle tensor names in bundle order: projection by projection, its parts in order."""
    return [f"{proj}.{part}" for proj in PROJECTIONS for part in quant[proj].parts]


@dataclass
class BundleLayout:
    """The bundles of one or more layers: each projection's quantization, and the tensors'
    shapes, dtypes and offsets inside a bundle."""

    quant: dict[str, Quant]  # projection -> its quantization
    tensors: list[TensorSpec]
    bundle_bytes: int  # payload of one bundle
    bundle_stride: int  # bytes between bundle starts (payload padded to alignment)

    @classmethod
    def of(
        cls, quant: dict[str, Quant], shapes: dict[str, tuple[list[int], str]]
    ) -> "BundleLayout":
        """The layout of bundles holding `shapes` (name -> per-expert shape, dtype)."""
        tensors, nbytes = make_tensor_specs(layout_names(quant), shapes)
        return cls(dict(quant), tensors, nbytes, align(nbytes))

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.tensors]

    def tensor(self, name: str) -> TensorSpec:
        for spec in self.tensors:
            if spec.name == name:
                return spec
        raise KeyError(name)

    def dims(self, proj: str) -> tuple[int, int]:
        """(out, in) of a projection's unquantized weight."""
        out_dim, packed = self.tensor(f"{proj}.weight").shape
        return out_dim, packed * 32 // self.quant[proj].bits

    @property
    def scale_dtype(self) -> str | None:
        """The float dtype of the affine scales and biases; None when no part is affine."""
        for spec in self.tensors:
            if spec.name.endswith((".scales", ".biases")) and spec.dtype != "uint8":
                return spec.dtype
        return None

    def describe(self) -> str:
        """'4-bit group 64 affine', or per projection when they differ."""
        kinds = {q.describe() for q in self.quant.values()}
        if len(kinds) == 1:
            return kinds.pop()
        return ", ".join(f"{p} {self.quant[p].describe()}" for p in PROJECTIONS)

    def to_json(self) -> dict:
        return {
            "quant": {p: asdict(self.quant[p]) for p in PROJECTIONS},
            "tensors": [asdict(t) for t in self.tensors],
            "bundle_bytes": self.bundle_bytes,
            "bundle_stride": self.bundle_stride,
        }


def describe_layers(layouts) -> str:
    """(layer, BundleLayout) pairs in words: one description, or one per group of layers."""
    groups: dict[str, list[int]] = {}
    for layer, layout in layouts:
        groups.setdefault(layout.describe(), []).append(layer)
    if len(groups) == 1:
        return next(iter(groups))
    return "; ".join(
        f"layer(s) {', '.join(map(str, layers))}: {text}"
        for text, layers in groups.items()
    )


# -- the index ---------------------------------------------------------------------------------


@dataclass
class ExpertIndex:
    model_type: str
    num_experts: int
    # decoder layer indices that have routed experts, in file order
    moe_layers: list[int]
    module_path: str  # e.g. "language_model.model.layers.{layer}.mlp.switch_mlp"
    layouts: list[BundleLayout]
    layer_layouts: list[int]  # per MoE layer (file order): its entry in `layouts`
    file: str = EXPERTS_NAME
    file_size: int = 0
    alignment: int = ALIGNMENT
    # source file name -> {"sha256", "bytes"}
    source: dict = field(default_factory=dict)
    crc32: list[list[int]] = field(default_factory=list)  # [moe layer position][expert]

    @classmethod
    def for_layers(
        cls,
        model_type: str,
        num_experts: int,
        module_path: str,
        by_layer: dict[int, BundleLayout],
    ) -> "ExpertIndex":
        """An index for layers in file order, each with its layout (equal layouts shared);
        crc32 and source are filled in by the writer."""
        layouts, which = [], []
        for layout in by_layer.values():
            if layout not in layouts:
                layouts.append(layout)
            which.append(layouts.index(layout))
        index = cls(
            model_type=model_type,
            num_experts=num_experts,
            moe_layers=list(by_layer),
            module_path=module_path,
            layouts=layouts,
            layer_layouts=which,
        )
        index.file_size = index.expected_file_size()
        return index

    # -- geometry ---------------------------------------------------------------------------
    def layer_position(self, layer: int) -> int:
        try:
            return self._geometry()[0][layer]
        except KeyError:
            raise KeyError(
                f"layer {layer} has no routed experts in this index"
            ) from None

    def layout(self, layer: int) -> BundleLayout:
        """The bundle layout of a MoE layer's experts."""
        return self.layouts[self.layer_layouts[self.layer_position(layer)]]

    def bundle_offset(self, layer: int, expert: int) -> int:
        if not 0 <= expert < self.num_experts:
            raise IndexError(f"expert {expert} out of range 0..{self.num_experts - 1}")
        pos = self.layer_position(layer)
        stride = self.layouts[self.layer_layouts[pos]].bundle_stride
        return self._geometry()[1][pos] + expert * stride

    def _geometry(self) -> tuple[dict[int, int], list[int]]:
        """(layer -> position, byte offset of each layer's first bundle), computed once."""
        cached = getattr(self, "_cached_geometry", None)
        key = (tuple(self.moe_layers), tuple(self.layer_layouts), self.num_experts)
        if cached is None or cached[0] != key:
            starts, offset = [], 0
            for which in self.layer_layouts:
                starts.append(offset)
                offset += self.num_experts * self.layouts[which].bundle_stride
            positions = {layer: i for i, layer in enumerate(self.moe_layers)}
            cached = self._cached_geometry = (key, (positions, starts))
        return cached[1]

    def expected_file_size(self) -> int:
        return sum(
            self.num_experts * self.layouts[w].bundle_stride for w in self.layer_layouts
        )

    @property
    def slot_bytes(self) -> int:
        """Bytes of one slot in every MoE layer (what a slot per layer costs)."""
        return sum(self.layouts[w].bundle_stride for w in self.layer_layouts)

    def describe_quant(self) -> str:
        """The experts' quantization in words, by layer when layers differ."""
        return describe_layers(
            (layer, self.layouts[w])
            for layer, w in zip(self.moe_layers, self.layer_layouts)
        )

    # -- (de)serialisation ------------------------------------------------------------------
    @property
    def format_version(self) -> int:
        """The version `save` writes: 1 when version 1 describes these experts, else 2."""
        return 1 if self._v1_quant() is not None else 2

    def _v1_quant(self) -> Quant | None:
        """The one quantization of every projection when version 1 can describe the index."""
        if len(self.layouts) != 1:
            return None
        kinds = set(self.layouts[0].quant.values())
        quant = kinds.pop() if len(kinds) == 1 else None
        return quant if quant is not None and quant.parts == _V1_PARTS else None

    def to_json(self) -> dict:
        quant = self._v1_quant()
        head = {
            "model_type": self.model_type,
            "num_experts": self.num_experts,
            "moe_layers": list(self.moe_layers),
            "module_path": self.module_path,
        }
        if quant is not None:
            # version 1, field for field as it has always been written
            layout = self.layouts[0]
            body = {
                "bits": quant.bits,
                "group_size": quant.group_size,
                "mode": quant.mode,
                "tensors": [asdict(t) for t in layout.tensors],
                "bundle_bytes": layout.bundle_bytes,
                "bundle_stride": layout.bundle_stride,
            }
        else:
            body = {
                "layouts": [layout.to_json() for layout in self.layouts],
                "layer_layouts": list(self.layer_layouts),
            }
        tail = {
            "file": self.file,
            "file_size": self.file_size,
            "alignment": self.alignment,
            "source": self.source,
            "crc32": self.crc32,
            "format": FORMAT,
            "format_version": 1 if quant is not None else 2,
        }
        return head | body | tail

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
        version = data.get("format_version")
        if version == 1:
            index = cls._from_v1(data, path)
        elif version == 2:
            index = cls._from_v2(data, path)
        else:
            raise CheckpointError(
                f"{path}: format_version {version!r} is not supported (this build reads "
                f"versions {', '.join(map(str, FORMAT_VERSIONS))}); re-run "
                f"`edge0-eval convert` with this build, or use the edge0-eval that wrote it"
            )
        index.validate(directory if check_file else None)
        return index

    @classmethod
    def _from_v1(cls, data: dict, path) -> "ExpertIndex":
        """Version 1: one affine quantization and one bundle layout for every layer."""
        check_index_fields(data, path, _FIELDS_V1, _REQUIRED_V1)
        if data["mode"] != "affine":
            raise CheckpointError(
                f"{path}: mode {data['mode']!r}: format_version 1 describes affine "
                f"experts only; {RECONVERT}"
            )
        for i, t in enumerate(data["tensors"]):
            _check_tensor_entry(t, f"{path}: tensors[{i}]", scalar_ok=False)
        quant = Quant(data["bits"], data["group_size"], data["mode"])
        layout = BundleLayout(
            quant={p: quant for p in PROJECTIONS},
            tensors=[TensorSpec(**t) for t in data["tensors"]],
            bundle_bytes=data["bundle_bytes"],
            bundle_stride=data["bundle_stride"],
        )
        return cls(
            layouts=[layout],
            layer_layouts=[0] * len(data["moe_layers"]),
            **{k: data[k] for k in _COMMON_FIELDS if k in data and k not in _TAGS},
        )

    @classmethod
    def _from_v2(cls, data: dict, path) -> "ExpertIndex":
        """Version 2: layouts, and the layout of each MoE layer."""
        check_index_fields(data, path, _FIELDS_V2, _REQUIRED_V2)
        layouts = [
            _layout_from_json(entry, f"{path}: layouts[{i}]")
            for i, entry in enumerate(data["layouts"])
        ]
        return cls(
            layouts=layouts,
            layer_layouts=list(data["layer_layouts"]),
            **{k: data[k] for k in _COMMON_FIELDS if k in data and k not in _TAGS},
        )

    def validate(self, directory: str | Path | None = None) -> None:
        """Check internal consistency and, given the directory, the expert file's size.

        Each bundle layout is fully determined by its quantization and the tensors' shapes and
        dtypes (parts in order, 64-byte aligned), so any other offset (swapped gate/up,
        overlaps) is a corrupt index.
        """
        where = f"{Path(directory) / INDEX_NAME}" if directory else INDEX_NAME
        if not self.layouts:
            raise CheckpointError(f"{where}: no bundle layouts; {RECONVERT}")
        if len(self.layer_layouts) != len(self.moe_layers) or not all(
            type_ok(w, int) and 0 <= w < len(self.layouts) for w in self.layer_layouts
        ):
            raise CheckpointError(
                f"{where}: layer_layouts {_short(self.layer_layouts)} must name one of the "
                f"{len(self.layouts)} layouts for each of the {len(self.moe_layers)} MoE "
                f"layers; {RECONVERT}"
            )
        unused = sorted(set(range(len(self.layouts))) - set(self.layer_layouts))
        if unused:
            raise CheckpointError(
                f"{where}: layouts {unused} are used by no layer; {RECONVERT}"
            )
        self._check_layouts(where)
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
                f"{where}: crc32 must hold one row of {self.num_experts} checksums per "
                f"MoE layer ({len(self.moe_layers)}); {RECONVERT}"
            )
        if directory is not None:
            self._check_file(Path(directory) / self.file)

    def _check_layouts(self, where: str) -> None:
        """Each layout complete and aligned; all of one expert shape and scale dtype."""
        many = len(self.layouts) > 1
        for i, layout in enumerate(self.layouts):
            at = f"{where}: layouts[{i}]" if many else where
            _check_layout(layout, at)
            if self.alignment != ALIGNMENT or layout.bundle_stride != align(
                layout.bundle_bytes, ALIGNMENT
            ):
                raise CheckpointError(
                    f"{at}: bundle_bytes {layout.bundle_bytes} / bundle_stride "
                    f"{layout.bundle_stride} / alignment {self.alignment} do not "
                    f"match the tensors ({layout.bundle_bytes} bytes, stride "
                    f"{align(layout.bundle_bytes, ALIGNMENT)}); {RECONVERT}"
                )
        first = self.layouts[0]
        for i, layout in enumerate(self.layouts[1:], 1):
            for proj in PROJECTIONS:
                if layout.dims(proj) != first.dims(proj):
                    raise CheckpointError(
                        f"{where}: layouts[{i}] has {proj} {layout.dims(proj)} (out, in) "
                        f"but layouts[0] {first.dims(proj)}: one model has one expert "
                        f"shape; {RECONVERT}"
                    )
        scale_dtypes = {l.scale_dtype for l in self.layouts} - {None}
        if len(scale_dtypes) > 1:
            raise CheckpointError(
                f"{where}: scales/biases mix dtypes {sorted(scale_dtypes)} across "
                f"layers; a conversion writes one; {RECONVERT}"
            )

    def _check_file(self, path: Path) -> None:
        """The expert file exists with the size the index gives."""
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


# -- field checks ------------------------------------------------------------------------------

_V1_PARTS = ("weight", "scales", "biases")

_POSITIVE = (int, lambda v: v > 0, "a positive integer")
# field -> (JSON type, check, what it must be); the fields both versions have
_COMMON_FIELDS = {
    "model_type": (str, bool, "a model type string"),
    "num_experts": _POSITIVE,
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
    "file": (
        str,
        lambda v: bool(v) and "/" not in v and v not in (".", ".."),
        "a file name beside the index",
    ),
    "file_size": (int, lambda v: v >= 0, "a byte count"),
    "alignment": _POSITIVE,
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
_TAGS = ("format", "format_version")  # checked on load, not kept on the index
_FIELDS_V1 = _COMMON_FIELDS | {
    "bits": _POSITIVE,
    "group_size": _POSITIVE,
    "mode": (str, bool, "a quantization mode such as 'affine'"),
    "tensors": (list, bool, "a list of tensor entries"),
    "bundle_bytes": _POSITIVE,
    "bundle_stride": _POSITIVE,
}
_FIELDS_V2 = _COMMON_FIELDS | {
    "layouts": (list, bool, "a non-empty list of bundle layouts"),
    "layer_layouts": (
        list,
        lambda v: all(type_ok(x, int) and x >= 0 for x in v),
        "a list of layout numbers, one per MoE layer",
    ),
}
_HEAD = ("model_type", "num_experts", "moe_layers", "module_path")
_REQUIRED_V1 = _HEAD + tuple(
    "bits group_size mode tensors bundle_bytes bundle_stride".split()
)
_REQUIRED_V2 = _HEAD + ("layouts", "layer_layouts")
_TENSOR_KEYS = {"name", "shape", "dtype", "offset", "nbytes"}
_QUANT_KEYS = {"bits", "group_size", "mode", "global_scale"}
_LAYOUT_KEYS = {"quant", "tensors", "bundle_bytes", "bundle_stride"}


def check_index_fields(data: dict, path, fields=None, required=None) -> None:
    """Types and ranges of every index field, before any dataclass or numpy sees them
    (version 1's fields unless others are given)."""
    fields = _FIELDS_V1 if fields is None else fields
    required = _REQUIRED_V1 if required is None else required
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise CheckpointError(f"{path}: unknown field(s) {unknown}; {RECONVERT}")
    for key in required:
        if key not in data:
            raise CheckpointError(
                f"{path}: required field {key!r} is missing; {RECONVERT}"
            )
    for key, value in data.items():
        kind, ok, want = fields[key]
        good = type_ok(value, int) if kind is int else isinstance(value, kind)
        if not good or not ok(value):
            raise CheckpointError(
                f"{path}: field {key!r} is {_short(value)}; it must be {want}; "
                f"{RECONVERT}"
            )


def _check_tensor_entry(t, where: str, scalar_ok: bool) -> None:
    """One tensor entry's keys and value types (a scalar shape only where a part is one)."""
    if not isinstance(t, dict) or set(t) != _TENSOR_KEYS:
        raise CheckpointError(
            f"{where} must be an object with name, shape, dtype, offset, nbytes; "
            f"{RECONVERT}"
        )
    if not isinstance(t["dtype"], str) or t["dtype"] not in _NP_DTYPES:
        raise CheckpointError(
            f"{where} ({t['name']!r}) has dtype {_short(t['dtype'])}; known: "
            f"{', '.join(_NP_DTYPES)}"
        )
    if not (
        isinstance(t["name"], str)
        and isinstance(t["shape"], list)
        and (t["shape"] or scalar_ok)
        and all(type_ok(d, int) and d > 0 for d in t["shape"])
        and type_ok(t["offset"], int)
        and t["offset"] >= 0
        and type_ok(t["nbytes"], int)
        and t["nbytes"] > 0
    ):
        raise CheckpointError(
            f"{where} has a bad name, shape, offset or nbytes ({_short(t)}); "
            f"{RECONVERT}"
        )


def _layout_from_json(entry, where: str) -> BundleLayout:
    """One version 2 layout entry, its value types checked."""
    if not isinstance(entry, dict) or set(entry) != _LAYOUT_KEYS:
        raise CheckpointError(
            f"{where} must be an object with {', '.join(sorted(_LAYOUT_KEYS))}; "
            f"{RECONVERT}"
        )
    quant = entry["quant"]
    if not isinstance(quant, dict) or set(quant) != set(PROJECTIONS):
        raise CheckpointError(
            f"{where}.quant must give each of {', '.join(PROJECTIONS)} its "
            f"quantization; {RECONVERT}"
        )
    for proj, q in quant.items():
        if not (
            isinstance(q, dict)
            and set(q) == _QUANT_KEYS
            and type_ok(q["bits"], int)
            and type_ok(q["group_size"], int)
            and isinstance(q["mode"], str)
            and isinstance(q["global_scale"], bool)
        ):
            raise CheckpointError(
                f"{where}.quant.{proj} is {_short(q)}; it must be an object with "
                f"integer bits and group_size, a mode and a boolean global_scale; "
                f"{RECONVERT}"
            )
    tensors = entry["tensors"]
    if not isinstance(tensors, list) or not tensors:
        raise CheckpointError(f"{where}.tensors must be a list of tensor entries")
    for i, t in enumerate(tensors):
        _check_tensor_entry(t, f"{where}.tensors[{i}]", scalar_ok=True)
    for key in ("bundle_bytes", "bundle_stride"):
        if not (type_ok(entry[key], int) and entry[key] > 0):
            raise CheckpointError(
                f"{where}.{key} is {_short(entry[key])}; it must be a positive "
                f"integer; {RECONVERT}"
            )
    return BundleLayout(
        quant={p: Quant(**quant[p]) for p in PROJECTIONS},
        tensors=[TensorSpec(**t) for t in tensors],
        bundle_bytes=entry["bundle_bytes"],
        bundle_stride=entry["bundle_stride"],
    )


def _short(value) -> str:
    text = repr(value)
    return text if len(text) < 80 else text[:77] + "..."


def _check_layout(layout: BundleLayout, where) -> None:
    """Quantizations MLX accepts, the tensors that follow from them (names, shapes, dtypes,
    offsets), and gate/up/down shapes that fit together."""
    for proj in PROJECTIONS:
        problem = layout.quant[proj].problem()
        if problem is not None:
            raise CheckpointError(f"{where}: {proj}: {problem}; {RECONVERT}")
    names, want_names = layout.names, layout_names(layout.quant)
    if names != want_names:
        raise CheckpointError(
            f"{where}: bundle tensors {names} are not {want_names} in that order; "
            f"{RECONVERT}"
        )
    for proj in PROJECTIONS:
        _check_projection(layout, proj, where)
    gate, up, down = (layout.dims(p) for p in PROJECTIONS)
    if gate != up:
        raise CheckpointError(
            f"{where}: gate_proj {list(gate)} and up_proj {list(up)} (out, in) differ"
        )
    inter, hidden = gate
    if down != (hidden, inter):
        raise CheckpointError(
            f"{where}: down_proj {layout.tensor('down_proj.weight').shape} does not map "
            f"the experts' {inter} features back to {hidden}; {RECONVERT}"
        )
    want, nbytes = make_tensor_specs(
        names, {t.name: (t.shape, t.dtype) for t in layout.tensors}
    )
    for spec, good in zip(layout.tensors, want):
        if (spec.offset, spec.nbytes) != (good.offset, good.nbytes):
            raise CheckpointError(
                f"{where}: tensor {spec.name} is at offset {spec.offset} ({spec.nbytes} "
                f"bytes) but the bundle layout puts it at {good.offset} ({good.nbytes} "
                f"bytes): offsets swapped, overlapping or sized wrong; {RECONVERT}"
            )
    if layout.bundle_bytes != nbytes:
        raise CheckpointError(
            f"{where}: bundle_bytes {layout.bundle_bytes} does not match the tensors "
            f"({nbytes} bytes); {RECONVERT}"
        )


def _check_projection(layout: BundleLayout, proj: str, where) -> None:
    """One projection's parts against its quantization."""
    quant = layout.quant[proj]
    w, s = layout.tensor(f"{proj}.weight"), layout.tensor(f"{proj}.scales")
    if w.dtype != "uint32":
        raise CheckpointError(
            f"{where}: {w.name} is {w.dtype}; packed weights are uint32"
        )
    if (
        len(w.shape) != 2
        or len(s.shape) != 2
        or s.shape[0] != w.shape[0]
        or w.shape[1] * 32 != s.shape[1] * quant.group_size * quant.bits
    ):
        raise CheckpointError(
            f"{where}: {proj} shapes weight {w.shape} / scales {s.shape} do not fit "
            f"{quant.describe()} groups; {RECONVERT}"
        )
    if quant.mode == "affine":
        b = layout.tensor(f"{proj}.biases")
        if s.dtype not in SCALE_DTYPES or b.dtype != s.dtype or b.shape != s.shape:
            raise CheckpointError(
                f"{where}: {proj} scales {s.dtype} {s.shape} / biases {b.dtype} "
                f"{b.shape}: affine scales and biases are one of "
                f"{', '.join(SCALE_DTYPES)}, alike in shape and dtype; {RECONVERT}"
            )
    elif s.dtype != "uint8":
        raise CheckpointError(
            f"{where}: {s.name} is {s.dtype}; {quant.mode} scales are uint8; "
            f"{RECONVERT}"
        )
    if quant.global_scale:
        g = layout.tensor(f"{proj}.global_scale")
        if g.shape != [] or g.dtype != "float32":
            raise CheckpointError(
                f"{where}: {g.name} is {g.dtype} {g.shape}; a per-expert global scale "
                f"is one float32; {RECONVERT}"
            )
    scale_dtypes = {
        t.dtype for t in layout.tensors if t.name.endswith((".scales", ".biases"))
    } - {"uint8"}
    if len(scale_dtypes) > 1:
        raise CheckpointError(
            f"{where}: scales/biases mix dtypes {sorted(scale_dtypes)}; a conversion "
            f"writes one; {RECONVERT}"
        )


def make_tensor_specs(
    names: list[str], shapes: dict[str, tuple[list[int], str]]
) -> tuple[list[TensorSpec], int]:
    """Lay out the bundle tensors `names` in that order, each 64-byte aligned. Returns specs,
    bytes."""
    specs, offset = [], 0
    for name in names:
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


def pack_bundle(layout: BundleLayout, arrays: dict[str, np.ndarray]) -> bytes:
    """Serialise one expert's tensors into a bundle of `bundle_stride` bytes."""
    buf = bytearray(layout.bundle_stride)
    for spec in layout.tensors:
        arr = np.asarray(arrays[spec.name])  # ascontiguousarray makes a scalar 1-d
        raw = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
        if raw.size != spec.nbytes or list(arr.shape) != spec.shape:
            raise CheckpointError(
                f"tensor {spec.name}: shape {list(arr.shape)} / {raw.size} bytes does not match "
                f"the index ({spec.shape} / {spec.nbytes})"
            )
        buf[spec.offset : spec.offset + spec.nbytes] = raw.tobytes()
    return bytes(buf)


def bundle_views(layout: BundleLayout) -> dict[str, tuple[int, int, type, tuple]]:
    """Where each tensor lies in a bundle: name -> (start, end, numpy dtype, shape) (bfloat16
    as raw uint16), worked out once for a layout and applied to every bundle read."""
    return {
        spec.name: (
            spec.offset,
            spec.offset + spec.nbytes,
            _NP_DTYPES[spec.dtype],
            tuple(spec.shape),
        )
        for spec in layout.tensors
    }


def unpack_bundle(layout: BundleLayout, buf) -> dict[str, np.ndarray]:
    """Zero-copy numpy views of one bundle's tensors (bfloat16 as raw uint16)."""
    mem = memoryview(buf)
    return {
        name: np.frombuffer(mem[start:end], dtype=dtype).reshape(shape)
        for name, (start, end, dtype, shape) in bundle_views(layout).items()
    }
