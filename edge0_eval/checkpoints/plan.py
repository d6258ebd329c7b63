"""What the converted model looks like, decided before a byte is written.

mlx-lm's own model class for the config is built lazily (its random init is never evaluated) to
learn names, shapes and, for a float source, the quantization plan `mlx_lm.utils.quantize_model`
would apply (same predicate, so routers stay 8-bit; same config). A quantized source is checked
against the model and repacked as it is.
"""

from __future__ import annotations

import contextlib
import io
import re
from dataclasses import dataclass

from mlx.utils import tree_flatten
from mlx_lm.models.switch_layers import SwitchGLU
from mlx_lm.utils import _get_classes, quantize_model

from edge0_eval.checkpoints.source import Checkpoint
from edge0_eval.engine.families import FAMILIES
from edge0_eval.errors import CheckpointError, ConfigError
from edge0_eval.engine.layout import (
    ALIGNMENT, PARTS, PROJECTIONS, ExpertIndex, align, make_tensor_specs,
)

# The families the engine serves are the ones convert accepts.
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)
DEFAULT_BITS = 4
DEFAULT_GROUP_SIZE = 64
SUPPORTED_BITS = (2, 3, 4, 5, 6, 8)
SUPPORTED_GROUP_SIZES = (32, 64, 128)


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
    model_class, args_class = _get_classes(config)
    return model_class(args_class.from_dict(config))


def switch_layers(model) -> dict[int, Switch]:
    """decoder layer -> its routed experts, for every layer of `model` that has them."""
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
