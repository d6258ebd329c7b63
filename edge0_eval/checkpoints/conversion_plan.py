"""What the converted model looks like, decided before a byte is written.

mlx-lm's own model class for the config is built lazily (its random init is never evaluated);
the source's tensors go through its `sanitize`, and must then be exactly the model's parameters
(names and shapes, after quantizing the model as `mlx_lm.load` does for a quantized source), so
anything neither used nor dropped stops convert before a byte is written. A float source gets the
quantization plan `mlx_lm.utils.quantize_model` would apply (same predicate, so routers stay 8-bit;
same config); a quantized one is repacked as it is.
"""

from __future__ import annotations

import contextlib
import io
import re
from dataclasses import dataclass

import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.switch_layers import SwitchGLU
from mlx_lm.utils import _get_classes, infer_quant_config, quantize_model

from edge0_eval.checkpoints.source import Checkpoint
from edge0_eval.engine.families import FAMILIES
from edge0_eval.errors import CheckpointError, ConfigError
from edge0_eval.formats.layout import (
    ALIGNMENT,
    PARTS,
    PROJECTIONS,
    ExpertIndex,
    align,
    make_tensor_specs,
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

    path: str  # "...layers.{L}.mlp.switch_mlp"
    num_experts: int
    dims: dict[str, tuple[int, int]]  # projection -> (out, in)


@dataclass
class Plan:
    """Everything decided before a byte is written."""

    config: dict  # config.json for OUT
    copy_config: bool  # True: copy SRC's config.json verbatim
    switches: dict[int, Switch]  # decoder layer -> routed experts, in file order
    bits: int
    group_size: int
    specs: dict[
        str, tuple[list[int], str]
    ]  # bundle tensor name -> per-expert shape, dtype
    resident_names: list[str]  # source tensors that are not routed experts
    quantize_resident: dict[
        str, tuple[int, int, str]
    ]  # module path -> (group, bits, mode)
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
            found[layer] = Switch(
                path, getattr(module, PROJECTIONS[0]).weight.shape[0], dims
            )
    return dict(sorted(found.items()))


def quantized_modules(model) -> dict[str, tuple[int, int, str]]:
    """module path -> (group_size, bits, mode) for every quantized module of `model`."""
    return {
        path: (m.group_size, m.bits, m.mode)
        for path, m in model.named_modules()
        if hasattr(m, "bits") and hasattr(m, "group_size") and "scales" in m
    }


def lazy_quantize(model, config: dict, group_size: int, bits: int):
    """`mlx_lm.utils.quantize_model` on a lazy model: the exact config and per-module plan."""
    # quantize_model prints a bits-per-weight line; for a lazy model it means nothing.
    with contextlib.redirect_stdout(io.StringIO()):
        return quantize_model(model, config, group_size, bits)


def check_model_type(model_type: str, where) -> None:
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(
            f"{where}: model_type {model_type!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )


def make_plan(ckpt: Checkpoint, bits: int | None, group_size: int | None) -> Plan:
    """Decide names, shapes and quantization for OUT, checking SRC against mlx-lm's model."""
    check_model_type(ckpt.model_type, ckpt.path / "config.json")
    _refuse_load_time_quantization(ckpt)
    model = build_lazy_model(ckpt.config)
    ckpt.sanitize(model)
    switches = switch_layers(model)
    if not switches:
        raise CheckpointError(
            f"{ckpt.path}: the config describes no routed-expert layers"
        )
    expert_prefixes = tuple(s.path + "." for s in switches.values())
    if ckpt.quantization is not None:
        quantize_as_loaded(model, ckpt)
    check_tensors(ckpt, model, expert_prefixes)
    resident = [n for n in ckpt.names() if not n.startswith(expert_prefixes)]
    if ckpt.quantization is not None:
        qbits, qgroup, specs = _plan_quantized(ckpt, model, bits, group_size, switches)
        return Plan(ckpt.config, True, switches, qbits, qgroup, specs, resident, {})
    config, qmodel, specs = _plan_float(ckpt, model, bits, group_size, switches)
    qmods = {
        p: q
        for p, q in quantized_modules(qmodel).items()
        if not p.startswith(expert_prefixes)
    }
    return Plan(
        config,
        False,
        switches,
        config["quantization"]["bits"],
        config["quantization"]["group_size"],
        specs,
        resident,
        qmods,
    )


def _refuse_load_time_quantization(ckpt: Checkpoint) -> None:
    """Formats mlx-lm converts while loading (fp8, mxfp4, AWQ, GPTQ ... from Hugging Face)."""
    qc = ckpt.config.get("quantization_config") or ckpt.config.get(
        "text_config", {}
    ).get("quantization_config")
    if ckpt.quantization is None and isinstance(qc, dict):
        raise CheckpointError(
            f"{ckpt.path / 'config.json'} has a Hugging Face quantization_config (quant_method "
            f"{qc.get('quant_method')!r}), which mlx-lm converts only while loading; convert it "
            f"to MLX first (mlx_lm.convert --hf-path SRC --mlx-path DIR, or start from the "
            f"bf16 checkpoint) and run edge0-eval convert on DIR"
        )


def quantize_as_loaded(model, ckpt: Checkpoint) -> None:
    """Quantize the lazy model module by module as `mlx_lm.load` does for a quantized source:
    the config's per-module entry if there is one, else the bits, group and mode the stored
    tensors were packed with, and modules without stored scales left as they are."""
    quant = ckpt.quantization

    def predicate(path, module):
        if path in quant:
            return quant[path]
        if not hasattr(module, "to_quantized") or f"{path}.scales" not in ckpt:
            return False
        try:
            return infer_quant_config(path, module, ckpt.weights)
        except (ValueError, KeyError) as exc:
            raise CheckpointError(f"{ckpt.path}: {exc}") from None

    nn.quantize(
        model,
        group_size=quant.get("group_size", DEFAULT_GROUP_SIZE),
        bits=quant.get("bits", DEFAULT_BITS),
        mode=quant.get("mode", "affine"),
        class_predicate=predicate,
    )


def _examples(names: list[str]) -> str:
    return ", ".join(names[:3]) + (
        f" and {len(names) - 3} more" if len(names) > 3 else ""
    )


def check_tensors(ckpt: Checkpoint, model, expert_prefixes: tuple[str, ...]) -> None:
    """After sanitize, SRC holds exactly the model's parameters (as strict loading needs), so
    every source tensor is used or was dropped by mlx-lm's sanitize (vision, MTP)."""
    want = {name: value.shape for name, value in tree_flatten(model.parameters())}
    missing = [n for n in want if n not in ckpt]
    if missing:
        kind = (
            "expert" if all(n.startswith(expert_prefixes) for n in missing) else "model"
        )
        raise CheckpointError(
            f"{ckpt.path}: {len(missing)} {kind} tensor(s) the {ckpt.model_type} model needs are "
            f"missing after mlx-lm's sanitize, e.g. {_examples(missing)}; SRC does not match its "
            f"config.json (a shard missing, or weights saved by another tool: check that "
            f"mlx_lm.load loads SRC, or convert it with mlx_lm.convert first)"
        )
    for name, shape in want.items():
        if ckpt.shape(name) != list(shape):
            raise CheckpointError(
                f"{ckpt.path}: {name} has shape {ckpt.shape(name)}, "
                f"the config implies {list(shape)}"
            )
    extra = sorted(set(ckpt.names()) - set(want))
    if extra:
        raise CheckpointError(
            f"{ckpt.path}: {len(extra)} tensor(s) are neither used by the {ckpt.model_type} "
            f"model nor dropped by mlx-lm's sanitize, e.g. {_examples(extra)}; nothing was "
            f"written. mlx_lm.load refuses them too: check that config.json belongs to these "
            f"weights (a quantized checkpoint needs its 'quantization' entry), or re-save SRC "
            f"without them"
        )


def _describe_layers(by_layer: dict[int, tuple]) -> str:
    groups: dict[tuple, list[int]] = {}
    for layer, q in by_layer.items():
        groups.setdefault(q, []).append(layer)
    return "; ".join(
        f"layer(s) {', '.join(map(str, layers))}: {b}-bit group {g} {m}"
        for (b, g, m), layers in groups.items()
    )


def _plan_quantized(ckpt, model, bits, group_size, switches):
    """SRC already quantized: bits/group as mlx-lm's load inferred them; nothing is requantized."""
    modules = dict(model.named_modules())
    by_layer = {}
    for layer, sw in switches.items():
        found = set()
        for proj in sw.dims:
            m = modules[f"{sw.path}.{proj}"]
            if not hasattr(m, "bits"):
                raise CheckpointError(
                    f"{ckpt.path}: {sw.path}.{proj} is not quantized while "
                    f"config.json has a 'quantization' entry; every routed "
                    f"expert must be quantized (or the whole source float)"
                )
            found.add((m.bits, m.group_size, m.mode))
            if (
                m.mode == "affine"
                and ckpt.dtype(f"{sw.path}.{proj}.weight") != "uint32"
            ):
                raise CheckpointError(
                    f"{ckpt.path}: {sw.path}.{proj}.weight is "
                    f"{ckpt.dtype(f'{sw.path}.{proj}.weight')}, not the packed "
                    f"uint32 an affine quantized tensor is"
                )
        if len(found) != 1:
            raise CheckpointError(
                f"{ckpt.path}: layer {layer}'s experts mix quantizations "
                f"{sorted(found)}; one bits/group size per layer is needed"
            )
        by_layer[layer] = found.pop()
    if len(set(by_layer.values())) != 1:
        raise CheckpointError(
            f"{ckpt.path}: routed experts are quantized differently by layer "
            f"({_describe_layers(by_layer)}), as mixed recipes such as mixed_4_6 do; the "
            f"streaming layout serves one bits/group size for every expert: convert the bf16 "
            f"checkpoint (edge0-eval convert SRC OUT --bits 4) or one quantized uniformly"
        )
    qbits, qgroup, mode = next(iter(by_layer.values()))
    if mode != "affine":
        raise CheckpointError(
            f"{ckpt.path}: routed experts are quantized in mode {mode!r}; the streaming layout "
            f"serves 'affine' (scales + biases) experts only: convert the bf16 checkpoint "
            f"(edge0-eval convert SRC OUT) or an affine quantization of it"
        )
    for flag, given, have in (
        ("--bits", bits, qbits),
        ("--group-size", group_size, qgroup),
    ):
        if given is not None and given != have:
            raise ConfigError(
                f"{ckpt.path} is already quantized ({qbits} bits, group {qgroup}); "
                f"{flag} {given} would need requantization, which convert does not "
                f"do: drop {flag} or start from an fp16/bf16 checkpoint"
            )
    specs = {}
    for sw in switches.values():
        for proj in sw.dims:
            for part in PARTS:
                name = f"{sw.path}.{proj}.{part}"
                _same_spec(
                    ckpt,
                    specs,
                    f"{proj}.{part}",
                    name,
                    (ckpt.shape(name)[1:], ckpt.dtype(name)),
                )
    return qbits, qgroup, specs


def _same_spec(ckpt, specs: dict, part: str, source: str, spec: tuple) -> None:
    """One bundle layout serves every layer: a part's shape and dtype must not change."""
    if specs.setdefault(part, spec) != spec:
        raise CheckpointError(
            f"{ckpt.path}: {source} is {spec[1]} {spec[0]} per expert, earlier "
            f"layers' {part} {specs[part][1]} {specs[part][0]}; one bundle "
            f"layout is needed for all layers"
        )


def _plan_float(ckpt, model, bits, group_size, switches):
    """SRC in fp16/bf16/fp32: quantize the lazy model with mlx-lm to get config and plan."""
    bits = DEFAULT_BITS if bits is None else bits
    group_size = DEFAULT_GROUP_SIZE if group_size is None else group_size
    if bits not in SUPPORTED_BITS:
        raise ConfigError(
            f"--bits {bits} is not supported; choose one of {SUPPORTED_BITS}"
        )
    if group_size not in SUPPORTED_GROUP_SIZES:
        raise ConfigError(
            f"--group-size {group_size} is not supported; "
            f"choose one of {SUPPORTED_GROUP_SIZES}"
        )
    qmodel, qconfig = lazy_quantize(model, ckpt.config, group_size, bits)
    qmods = quantized_modules(qmodel)
    specs = {}
    for sw in switches.values():
        for proj, (out_dim, in_dim) in sw.dims.items():
            q = qmods.get(f"{sw.path}.{proj}")
            if q is None:
                raise ConfigError(
                    f"--group-size {group_size} does not divide the expert input "
                    f"dimension {in_dim} of {sw.path}.{proj}"
                )
            dtype = ckpt.dtype(f"{sw.path}.{proj}.weight")
            if dtype not in ("float16", "bfloat16", "float32"):
                raise CheckpointError(
                    f"{ckpt.path}: {sw.path}.{proj}.weight is {dtype}, expected "
                    f"a float tensor (or a 'quantization' entry in config.json)"
                )
            g, b, _ = q
            layer_specs = {
                f"{proj}.weight": ([out_dim, in_dim * b // 32], "uint32"),
                f"{proj}.scales": ([out_dim, in_dim // g], dtype),
                f"{proj}.biases": ([out_dim, in_dim // g], dtype),
            }
            for name, spec in layer_specs.items():
                _same_spec(ckpt, specs, name, f"{sw.path}.{proj}", spec)
    return qconfig, qmodel, specs


def new_index(plan: Plan, model_type: str) -> ExpertIndex:
    """An ExpertIndex for the plan's bundle geometry (crc32 and source filled in later)."""
    tensors, nbytes = make_tensor_specs(plan.specs)
    index = ExpertIndex(
        model_type=model_type,
        num_experts=plan.num_experts,
        moe_layers=plan.moe_layers,
        module_path=plan.module_path,
        bits=plan.bits,
        group_size=plan.group_size,
        mode=plan.mode,
        tensors=tensors,
        bundle_bytes=nbytes,
        bundle_stride=align(nbytes, ALIGNMENT),
    )
    index.file_size = index.expected_file_size()
    return index
