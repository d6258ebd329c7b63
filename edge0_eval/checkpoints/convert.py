"""`edge0-eval convert SRC OUT`: an mlx-lm MoE checkpoint -> the int4 streaming layout.

OUT holds `resident.safetensors` (every non-expert weight, mlx-lm names), `experts.bin` +
`experts.index.json` (one page-aligned bundle per (MoE layer, expert), see `layout.py`), the
config and the tokenizer files.

- A quantized SRC (config has "quantization") is repacked bit for bit: nothing is requantized.
- An fp16/bf16/fp32 SRC is quantized exactly as `mlx_lm.utils.quantize_model` would (same
  predicate, so routers stay 8-bit; same config), but one tensor / one layer's experts at a time.

The whole model is never held in memory: source tensors are read one at a time, the mlx-lm model is
built lazily (its random init is never evaluated) only to learn names, shapes and the
quantization plan, and experts are converted and written one decoder layer at a time.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import re
import shutil
import tempfile
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edge0_eval.errors import CheckpointError, ConfigError
from edge0_eval.engine.layout import (
    ALIGNMENT, EXPERTS_NAME, PARTS, PROJECTIONS, RESIDENT_NAME, ExpertIndex, align,
    make_tensor_specs, pack_bundle,
)

SUPPORTED_MODEL_TYPES = ("qwen3_5_moe", "bailing_hybrid", "qwen2_moe")
DEFAULT_BITS = 4
DEFAULT_GROUP_SIZE = 64
SUPPORTED_BITS = (2, 3, 4, 5, 6, 8)
SUPPORTED_GROUP_SIZES = (32, 64, 128)

# Files in SRC that are weights (or weight indexes) and so are not copied to OUT.
_WEIGHT_FILE = re.compile(r"(\.safetensors|\.safetensors\.index\.json|\.bin|\.pt|\.pth|\.gguf"
                          r"|\.npz|\.h5|\.msgpack|\.ckpt)$")

# safetensors dtype code -> (our dtype string, numpy dtype). bfloat16 travels as raw uint16.
_ST_DTYPES = {
    "F16": ("float16", np.float16), "BF16": ("bfloat16", np.uint16), "F32": ("float32", np.float32),
    "F64": ("float64", np.float64), "U32": ("uint32", np.uint32), "I32": ("int32", np.int32),
    "U8": ("uint8", np.uint8), "I8": ("int8", np.int8), "U16": ("uint16", np.uint16),
    "I16": ("int16", np.int16), "I64": ("int64", np.int64), "U64": ("uint64", np.uint64),
    "BOOL": ("bool", np.bool_),
}


# -- reading the source ------------------------------------------------------------------------

class SafetensorsFile:
    """One safetensors file: header parsed and checked up front, tensors read on demand."""

    def __init__(self, path: Path):
        self.path = path
        size = path.stat().st_size
        try:
            with open(path, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise ValueError("shorter than the 8-byte header length")
                n = int.from_bytes(head, "little")
                if n > size - 8 or n > 100 * 2**20:
                    raise ValueError(f"header length {n} exceeds the file size {size} "
                                     f"(truncated?)")
                header = json.loads(f.read(n))
            header.pop("__metadata__", None)
            self._data_start = 8 + n
            self.tensors: dict[str, tuple[str, list[int], int, int]] = {}
            for name, info in header.items():
                code, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
                if code not in _ST_DTYPES:
                    raise ValueError(f"tensor {name} has unsupported dtype {code}")
                want = int(np.prod(shape)) * np.dtype(_ST_DTYPES[code][1]).itemsize
                if end - begin != want or begin < 0:
                    raise ValueError(f"tensor {name}: offsets {begin}..{end} do not match its shape")
                if self._data_start + end > size:
                    raise ValueError(f"tensor {name} ends at byte {self._data_start + end} "
                                     f"but the file has {size} bytes (truncated?)")
                self.tensors[name] = (code, list(shape), begin, end)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"{path} is not a valid safetensors file ({exc}); "
                                  f"re-download or re-save the checkpoint") from None

    def dtype(self, name: str) -> str:
        return _ST_DTYPES[self.tensors[name][0]][0]

    def shape(self, name: str) -> list[int]:
        return self.tensors[name][1]

    def nbytes(self, name: str) -> int:
        _, _, begin, end = self.tensors[name]
        return end - begin

    def array(self, name: str) -> np.ndarray:
        """The tensor read into a fresh numpy array (bfloat16 as uint16).

        A plain read rather than a memory map: mapped pages would count as this process's
        memory until the kernel drops them, while a read buffer is freed as soon as it is used.
        """
        code, shape, begin, end = self.tensors[name]
        dtype = np.dtype(_ST_DTYPES[code][1])
        with open(self.path, "rb") as f:
            f.seek(self._data_start + begin)
            arr = np.fromfile(f, dtype=dtype, count=(end - begin) // dtype.itemsize)
        if arr.nbytes != end - begin:
            raise CheckpointError(f"{self.path} is truncated (it changed while being read?)")
        return arr.reshape(shape)


class Checkpoint:
    """An mlx-lm checkpoint directory: config plus tensors spread over one or more shards."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"{self.path} not found or not a directory: SRC must be an "
                                  f"mlx-lm checkpoint directory")
        config_path = self.path / "config.json"
        if not config_path.is_file():
            raise CheckpointError(f"{config_path} not found: SRC must be an mlx-lm checkpoint "
                                  f"directory (config.json + *.safetensors)")
        try:
            from mlx_lm.utils import _decode_tagged_floats

            self.config = _decode_tagged_floats(json.loads(config_path.read_text()))
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"{config_path} is not valid JSON ({exc})") from None
        self.files = [SafetensorsFile(p) for p in self._weight_files()]
        self._where: dict[str, SafetensorsFile] = {}
        for f in self.files:
            for name in f.tensors:
                self._where[name] = f

    def _weight_files(self) -> list[Path]:
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            try:
                names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (json.JSONDecodeError, KeyError, AttributeError) as exc:
                raise CheckpointError(f"{index} is malformed ({exc})") from None
            missing = [n for n in names if not (self.path / n).is_file()]
            if missing:
                raise CheckpointError(f"{index} lists shard(s) missing from {self.path}: "
                                      f"{', '.join(missing)}")
            return [self.path / n for n in names]
        files = sorted(self.path.glob("model*.safetensors")) or sorted(self.path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"no *.safetensors weights in {self.path}")
        return files

    @property
    def model_type(self) -> str:
        return self.config.get("model_type", "")

    @property
    def quantization(self) -> dict | None:
        return self.config.get("quantization")

    def names(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def shape(self, name: str) -> list[int]:
        return self._where[name].shape(name)

    def dtype(self, name: str) -> str:
        return self._where[name].dtype(name)

    def nbytes(self, name: str) -> int:
        return self._where[name].nbytes(name)

    def array(self, name: str) -> np.ndarray:
        return self._where[name].array(name)

    def mx_array(self, name: str):
        """The tensor in MLX with its true dtype (bfloat16 reinterpreted from raw uint16)."""
        import mlx.core as mx

        arr = mx.array(self.array(name))
        return arr.view(mx.bfloat16) if self.dtype(name) == "bfloat16" else arr

    def source_files(self) -> list[Path]:
        return [self.path / "config.json"] + [f.path for f in self.files]


def to_numpy(arr) -> np.ndarray:
    """MLX -> numpy, bfloat16 as raw uint16 (numpy has no bfloat16)."""
    import mlx.core as mx

    if arr.dtype == mx.bfloat16:
        arr = arr.view(mx.uint16)
    return np.array(arr, copy=False)


# -- what the converted model looks like -------------------------------------------------------

@dataclass
class Switch:
    """One layer's routed experts as the (unquantized) mlx-lm model declares them."""

    path: str                                  # "...layers.{L}.mlp.switch_mlp"
    num_experts: int
    dims: dict[str, tuple[int, int]]           # projection -> (out, in)


@dataclass
class Plan:
    """Everything decided before a byte is written."""

    config: dict                      # config.json for OUT
    copy_config: bool                 # True: copy SRC's config.json verbatim
    switches: dict[int, Switch]       # decoder layer -> routed experts, in file order
    bits: int
    group_size: int
    specs: dict[str, tuple[list[int], str]]    # bundle tensor name -> per-expert shape, dtype
    resident_names: list[str]                  # source tensors that are not routed experts
    quantize_resident: dict[str, tuple[int, int, str]]  # module path -> (group, bits, mode)
    mode: str = "affine"

    @property
    def moe_layers(self) -> list[int]:
        return list(self.switches)

    @property
    def num_experts(self) -> int:
        return next(iter(self.switches.values())).num_experts

    @property
    def module_path(self) -> str:
        """The switch path with "{layer}" in place of the layer number."""
        path = next(iter(self.switches.values())).path
        return re.sub(r"layers\.\d+\.", "layers.{layer}.", path, count=1)


def build_lazy_model(config: dict):
    """mlx-lm's model for `config`; parameters stay unevaluated, so this costs no memory."""
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    return model_class(args_class.from_dict(config))


def switch_layers(model) -> dict[int, Switch]:
    """decoder layer -> its routed experts, for every layer of `model` that has them."""
    from mlx_lm.models.switch_layers import SwitchGLU

    found = {}
    for path, module in model.named_modules():
        if isinstance(module, SwitchGLU):
            layer = int(re.search(r"layers\.(\d+)\.", path).group(1))
            dims = {p: tuple(getattr(module, p).weight.shape[1:]) for p in PROJECTIONS}
            found[layer] = Switch(path, getattr(module, PROJECTIONS[0]).weight.shape[0], dims)
    return dict(sorted(found.items()))


def quantized_modules(model) -> dict[str, tuple[int, int, str]]:
    """module path -> (group_size, bits, mode) for every quantized module of `model`."""
    return {path: (m.group_size, m.bits, m.mode) for path, m in model.named_modules()
            if hasattr(m, "bits") and hasattr(m, "group_size") and "scales" in m}


def lazy_quantize(model, config: dict, group_size: int, bits: int):
    """`mlx_lm.utils.quantize_model` on a lazy model: the exact config and per-module plan."""
    from mlx_lm.utils import quantize_model

    # quantize_model prints a bits-per-weight line; for a lazy model it means nothing.
    with contextlib.redirect_stdout(io.StringIO()):
        return quantize_model(model, config, group_size, bits)


def check_model_type(model_type: str, where) -> None:
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(f"{where}: model_type {model_type!r} is not supported; "
                              f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")


def make_plan(ckpt: Checkpoint, bits: int | None, group_size: int | None) -> Plan:
    """Decide names, shapes and quantization for OUT, checking SRC against mlx-lm's model."""
    check_model_type(ckpt.model_type, ckpt.path / "config.json")
    model = build_lazy_model(ckpt.config)
    switches = switch_layers(model)
    if not switches:
        raise CheckpointError(f"{ckpt.path}: the config describes no routed-expert layers")
    expert_prefixes = tuple(s.path + "." for s in switches.values())
    resident = [n for n in ckpt.names() if not n.startswith(expert_prefixes)]
    if ckpt.quantization is not None:
        config, qbits, qgroup, specs = _plan_quantized(ckpt, bits, group_size, switches)
        return Plan(config, True, switches, qbits, qgroup, specs, resident, {})
    config, qmodel, specs = _plan_float(ckpt, model, bits, group_size, switches)
    qmods = {p: q for p, q in quantized_modules(qmodel).items()
             if not p.startswith(expert_prefixes)}
    return Plan(config, False, switches, config["quantization"]["bits"],
                config["quantization"]["group_size"], specs, resident, qmods)


def _require(ckpt: Checkpoint, name: str, shape: list[int] | None = None) -> None:
    if name not in ckpt:
        raise CheckpointError(f"{ckpt.path}: expert tensor {name} is missing (is SRC an mlx-lm "
                              f"checkpoint of this config, with post-sanitize weight names?)")
    if shape is not None and list(ckpt.shape(name)) != list(shape):
        raise CheckpointError(f"{ckpt.path}: {name} has shape {ckpt.shape(name)}, "
                              f"the config implies {list(shape)}")


def _same_for_all_layers(ckpt, layer, specs, layer_specs):
    if specs is not None and layer_specs != specs:
        raise CheckpointError(f"{ckpt.path}: layer {layer} experts differ in shape/dtype from "
                              f"earlier layers; one bundle layout is needed for all layers")
    return layer_specs


def _plan_quantized(ckpt, bits, group_size, switches):
    """SRC already quantized: learn bits/group from the packed shapes; nothing is requantized."""
    quant = ckpt.quantization
    found, specs, expected = set(), None, set()
    for layer, sw in switches.items():
        layer_specs = {}
        for proj, (out_dim, in_dim) in sw.dims.items():
            base = f"{sw.path}.{proj}"
            override = quant.get(base)
            mode = (override if isinstance(override, dict) else quant).get("mode", "affine")
            if mode != "affine":
                raise CheckpointError(f"{ckpt.path}: experts are quantized in mode {mode!r}; "
                                      f"only 'affine' (scales + biases) is supported")
            for part in PARTS:
                _require(ckpt, f"{base}.{part}")
                expected.add(f"{base}.{part}")
            if ckpt.dtype(f"{base}.weight") != "uint32" or ckpt.shape(f"{base}.scales")[-1] == 0:
                raise CheckpointError(f"{ckpt.path}: {base}.weight is not a packed uint32 tensor")
            qbits = ckpt.shape(f"{base}.weight")[-1] * 32 // in_dim
            qgroup = in_dim // ckpt.shape(f"{base}.scales")[-1]
            found.add((qbits, qgroup))
            E = sw.num_experts
            _require(ckpt, f"{base}.weight", [E, out_dim, in_dim * qbits // 32])
            _require(ckpt, f"{base}.scales", [E, out_dim, in_dim // qgroup])
            _require(ckpt, f"{base}.biases", [E, out_dim, in_dim // qgroup])
            layer_specs[f"{proj}.weight"] = ([out_dim, in_dim * qbits // 32], "uint32")
            for part in ("scales", "biases"):
                layer_specs[f"{proj}.{part}"] = ([out_dim, in_dim // qgroup],
                                                 ckpt.dtype(f"{base}.{part}"))
        specs = _same_for_all_layers(ckpt, layer, specs, layer_specs)
    if len(found) != 1:
        raise CheckpointError(f"{ckpt.path}: experts use mixed quantization {sorted(found)}; "
                              f"the streaming layout needs one bits/group size for all experts")
    prefixes = tuple(s.path + "." for s in switches.values())
    stray = sorted(n for n in ckpt.names() if n.startswith(prefixes) and n not in expected)
    if stray:
        raise CheckpointError(f"{ckpt.path}: unsupported routed-expert tensor {stray[0]}; "
                              f"bundles hold only {', '.join(PARTS)} of {', '.join(PROJECTIONS)}")
    qbits, qgroup = found.pop()
    for flag, given, have in (("--bits", bits, qbits), ("--group-size", group_size, qgroup)):
        if given is not None and given != have:
            raise ConfigError(f"{ckpt.path} is already quantized ({qbits} bits, group {qgroup}); "
                              f"{flag} {given} would need requantization, which convert does not "
                              f"do: drop {flag} or start from an fp16/bf16 checkpoint")
    return ckpt.config, qbits, qgroup, specs


def _plan_float(ckpt, model, bits, group_size, switches):
    """SRC in fp16/bf16/fp32: quantize the lazy model with mlx-lm to get config and plan."""
    from mlx.utils import tree_flatten

    bits = DEFAULT_BITS if bits is None else bits
    group_size = DEFAULT_GROUP_SIZE if group_size is None else group_size
    if bits not in SUPPORTED_BITS:
        raise ConfigError(f"--bits {bits} is not supported; choose one of {SUPPORTED_BITS}")
    if group_size not in SUPPORTED_GROUP_SIZES:
        raise ConfigError(f"--group-size {group_size} is not supported; "
                          f"choose one of {SUPPORTED_GROUP_SIZES}")

    # SRC must hold exactly the model's parameters (names and shapes), as strict loading needs.
    expert_prefixes = tuple(s.path + "." for s in switches.values())
    want = dict(tree_flatten(model.parameters()))
    for name, value in want.items():
        if name not in ckpt:
            kind = "expert" if name.startswith(expert_prefixes) else "model"
            raise CheckpointError(f"{ckpt.path}: {kind} tensor {name} is missing (is SRC an "
                                  f"mlx-lm checkpoint of this config, with post-sanitize names?)")
        if list(ckpt.shape(name)) != list(value.shape):
            raise CheckpointError(f"{ckpt.path}: {name} has shape {ckpt.shape(name)}, "
                                  f"the config implies {list(value.shape)}")
    extra = sorted(set(ckpt.names()) - set(want))
    if extra:
        raise CheckpointError(f"{ckpt.path}: {len(extra)} tensor(s) the model does not have, e.g. "
                              f"{extra[0]} (a partly quantized checkpoint without a 'quantization' "
                              f"config is not supported)")

    qmodel, qconfig = lazy_quantize(model, ckpt.config, group_size, bits)
    qmods = quantized_modules(qmodel)
    specs = None
    for layer, sw in switches.items():
        layer_specs = {}
        for proj, (out_dim, in_dim) in sw.dims.items():
            q = qmods.get(f"{sw.path}.{proj}")
            if q is None:
                raise ConfigError(f"--group-size {group_size} does not divide the expert input "
                                  f"dimension {in_dim} of {sw.path}.{proj}")
            dtype = ckpt.dtype(f"{sw.path}.{proj}.weight")
            if dtype not in ("float16", "bfloat16", "float32"):
                raise CheckpointError(f"{ckpt.path}: {sw.path}.{proj}.weight is {dtype}, expected "
                                      f"a float tensor (or a 'quantization' entry in config.json)")
            g, b, _ = q
            layer_specs[f"{proj}.weight"] = ([out_dim, in_dim * b // 32], "uint32")
            layer_specs[f"{proj}.scales"] = ([out_dim, in_dim // g], dtype)
            layer_specs[f"{proj}.biases"] = ([out_dim, in_dim // g], dtype)
        specs = _same_for_all_layers(ckpt, layer, specs, layer_specs)
    return qconfig, qmodel, specs


# -- writing -----------------------------------------------------------------------------------

def file_digest(path: Path, stop: threading.Event | None = None) -> dict:
    """{"sha256", "bytes"} of a file; gives up early (returns {}) once `stop` is set."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 * 2**20):
            if stop is not None and stop.is_set():
                return {}
            h.update(chunk)
    return {"sha256": h.hexdigest(), "bytes": path.stat().st_size}


def _digests(paths: list[Path], stop: threading.Event) -> dict[str, dict]:
    return {p.name: file_digest(p, stop) for p in paths}


def new_index(plan: Plan, model_type: str) -> ExpertIndex:
    """An ExpertIndex for the plan's bundle geometry (crc32 and source filled in later)."""
    tensors, nbytes = make_tensor_specs(plan.specs)
    index = ExpertIndex(
        model_type=model_type, num_experts=plan.num_experts, moe_layers=plan.moe_layers,
        module_path=plan.module_path, bits=plan.bits, group_size=plan.group_size,
        mode=plan.mode, tensors=tensors, bundle_bytes=nbytes,
        bundle_stride=align(nbytes, ALIGNMENT),
    )
    index.file_size = index.expected_file_size()
    return index


class BundleWriter:
    """Appends bundles to experts.bin in (layer, expert) order, recording their crc32."""

    def __init__(self, path: Path, index: ExpertIndex):
        self.index = index
        self.file = open(path, "wb")
        index.crc32 = []

    def write_layer(self, layer: int, expert_arrays) -> None:
        """`expert_arrays(e)` -> {bundle tensor name: numpy array} for expert e of `layer`."""
        crcs = []
        for e in range(self.index.num_experts):
            if self.file.tell() != self.index.bundle_offset(layer, e):
                raise RuntimeError(f"bundle ({layer}, {e}) would land at the wrong offset")
            bundle = pack_bundle(self.index, expert_arrays(e))
            crcs.append(zlib.crc32(bundle))
            self.file.write(bundle)
        self.index.crc32.append(crcs)

    def close(self) -> None:
        self.file.close()


def copy_side_files(src: Path, dst: Path) -> None:
    """Tokenizer, generation config, chat template, code...: every regular non-weight file."""
    for path in sorted(src.iterdir()):
        if path.is_file() and path.name != "config.json" and not _WEIGHT_FILE.search(path.name):
            shutil.copy2(path, dst / path.name)


def check_out_empty(out: str | Path) -> Path:
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out} exists and is not empty; choose a new directory or remove it")
    return out


@contextlib.contextmanager
def output_dir(out: str | Path):
    """Build OUT in a temp dir next to it; rename into place on success, remove on failure.

    A failed or interrupted write leaves nothing behind, and a non-empty OUT is refused.
    """
    out = check_out_empty(out)
    parent = out.parent if str(out.parent) else Path(".")
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=parent))
    try:
        yield tmp
        if out.exists():
            out.rmdir()
        tmp.chmod(0o755)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def check_free_space(directory: Path, needed: int) -> None:
    free = shutil.disk_usage(directory).free
    if free < needed:
        raise CheckpointError(f"not enough free space in {directory}: need about "
                              f"{needed / 1e9:.2f} GB, {free / 1e9:.2f} GB free")


def _write_resident(ckpt: Checkpoint, plan: Plan, path: Path) -> None:
    """Non-expert weights: copied, or quantized per tensor exactly as quantize_model does."""
    import mlx.core as mx

    out = {}
    for name in plan.resident_names:
        module, _, leaf = name.rpartition(".")
        q = plan.quantize_resident.get(module)
        if q is not None and leaf == "weight":
            group, bits, mode = q
            # What QuantizedLinear/QuantizedEmbedding.from_* do with the weight.
            w, scales, *biases = mx.quantize(ckpt.mx_array(name), group, bits, mode=mode)
            out[f"{module}.weight"], out[f"{module}.scales"] = w, scales
            if biases:
                out[f"{module}.biases"] = biases[0]
            mx.eval(w, scales, *biases)
        else:
            out[name] = ckpt.mx_array(name)
    mx.save_safetensors(str(path), out, metadata={"format": "mlx"})


def _expert_source(ckpt: Checkpoint, plan: Plan, layer: int):
    """expert e -> its bundle arrays, for one layer (quantizing the layer first if SRC is fp)."""
    import mlx.core as mx

    path = plan.switches[layer].path
    if ckpt.quantization is not None:
        stacked = {f"{p}.{q}": ckpt.array(f"{path}.{p}.{q}") for p in PROJECTIONS for q in PARTS}
    else:
        stacked = {}
        for proj in PROJECTIONS:
            # Exactly what QuantizedSwitchLinear._quantize does with the stacked [E, out, in].
            parts = mx.quantize(ckpt.mx_array(f"{path}.{proj}.weight"), plan.group_size,
                                plan.bits, mode=plan.mode)
            mx.eval(*parts)
            for part, value in zip(PARTS, parts):
                stacked[f"{proj}.{part}"] = to_numpy(value)
    return lambda e: {name: value[e] for name, value in stacked.items()}


def convert(src: str | Path, out: str | Path, bits: int | None = None,
            group_size: int | None = None, progress: bool = True) -> Path:
    """Convert checkpoint `src` into the streaming layout at `out`. Returns `out`.

    `bits`/`group_size` default to 4/64 for a float SRC; for a quantized SRC they must be
    omitted or match it (it is repacked, never requantized).
    """
    from tqdm import tqdm

    check_out_empty(out)         # the cheapest check first
    ckpt = Checkpoint(src)
    plan = make_plan(ckpt, bits, group_size)
    index = new_index(plan, ckpt.model_type)
    with output_dir(out) as tmp:
        resident_bytes = sum(ckpt.nbytes(n) for n in plan.resident_names)
        check_free_space(tmp, index.file_size + resident_bytes)
        # Hash SRC in the background: hashlib releases the GIL, so it overlaps conversion.
        stop, pool = threading.Event(), ThreadPoolExecutor(max_workers=1)
        digests = pool.submit(_digests, ckpt.source_files(), stop)
        try:
            _write_resident(ckpt, plan, tmp / RESIDENT_NAME)
            writer = BundleWriter(tmp / EXPERTS_NAME, index)
            try:
                for layer in tqdm(plan.moe_layers, desc="convert experts", unit="layer",
                                  disable=not progress):
                    writer.write_layer(layer, _expert_source(ckpt, plan, layer))
            finally:
                writer.close()
            index.source = digests.result()
        finally:
            stop.set()           # on failure, do not wait for a full hash of SRC
            pool.shutdown()
        index.validate(tmp)
        index.save(tmp)
        if plan.copy_config:
            shutil.copy2(ckpt.path / "config.json", tmp / "config.json")
        else:
            from mlx_lm.utils import save_config

            save_config(plan.config, tmp / "config.json")
        copy_side_files(ckpt.path, tmp)
    return Path(out)


# -- CLI ---------------------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", help=f"mlx-lm checkpoint directory "
                                    f"({', '.join(SUPPORTED_MODEL_TYPES)})")
    parser.add_argument("out", help="output directory (must not exist or be empty)")
    parser.add_argument("--bits", type=int, default=None,
                        help=f"bits for a float SRC (default {DEFAULT_BITS}); a quantized SRC "
                             f"is repacked as it is")
    parser.add_argument("--group-size", type=int, default=None,
                        help=f"quantization group size for a float SRC (default "
                             f"{DEFAULT_GROUP_SIZE})")


def run(args: argparse.Namespace) -> int:
    out = convert(args.src, args.out, bits=args.bits, group_size=args.group_size)
    index = ExpertIndex.load(out)
    print(f"wrote {out}: {len(index.moe_layers)} MoE layers x {index.num_experts} experts, "
          f"{index.bits}-bit group {index.group_size}, {index.file_size / 1e9:.2f} GB of experts")
    return 0
