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

from mlx.utils import tree_flatten
from mlx_lm.models.switch_layers import SwitchGLU
from mlx_lm.utils import _get_classes, quantize_model

from edge0_eval.checkpoints.source import Checkpoint
from edge0_eval.engine.families import FAMILIES
from edge0_eval.engine.mlx_compat import quantize_like_mlx_lm
from edge0_eval.errors import CheckpointError, ConfigError
from edge0_eval.formats.layout import (
    PROJECTIONS,
    BundleLayout,
    ExpertIndex,
    Quant,
    describe_layers,
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
    layouts: dict[int, BundleLayout]  # decoder layer -> its experts' bundle layout
    resident_names: list[str]  # source tensors that are not routed experts
    # module path -> (group, bits, mode)
    quantize_resident: dict[str, tuple[int, int, str]]

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
        path: (module_group_size(m), m.bits, m.mode)
        for path, m in model.named_modules()
        if hasattr(m, "bits") and hasattr(m, "group_size") and "scales" in m
    }


def module_group_size(module) -> int:
    """A quantized module's group size. mlx-lm keeps a config entry's null (its mixed_*
    recipes without --q-group-size) and MLX then takes the mode's default: the scales' shape
    tells which."""
    if module.group_size:
        return module.group_size
    in_dim = module.weight.shape[-1] * 32 // module.bits
    return in_dim // module.scales.shape[-1]


def lazy_quantize(
    model,
    config: dict,
    group_size: int | None,
    bits: int | None,
    mode: str = "affine",
    quant_predicate=None,
):
    """`mlx_lm.utils.quantize_model` on a lazy model: the exact config and per-module plan."""
    # quantize_model prints a bits-per-weight line; for a lazy model it means nothing.
    with contextlib.redirect_stdout(io.StringIO()):
        return quantize_model(
            model, config, group_size, bits, mode=mode, quant_predicate=quant_predicate
        )


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
        layouts = _plan_quantized(ckpt, model, bits, group_size, switches)
        return Plan(ckpt.config, True, switches, layouts, resident, {})
    config, qmodel, layouts = _plan_float(ckpt, model, bits, group_size, switches)
    qmods = {
        p: q
        for p, q in quantized_modules(qmodel).items()
        if not p.startswith(expert_prefixes)
    }
    return Plan(config, False, switches, layouts, resident, qmods)


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
    """Quantize the lazy model module by module as `mlx_lm.load` does for a quantized source
    (mlx_compat.quantize_like_mlx_lm); a tensor packed in no way MLX defines is one error."""
    try:
        quantize_like_mlx_lm(model, ckpt.config, ckpt.weights)
    except (ValueError, KeyError) as exc:
        raise CheckpointError(f"{ckpt.path}: {exc}") from None


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


def _plan_quantized(ckpt, model, bits, group_size, switches):
    """SRC already quantized: each expert projection keeps the bits, group size and mode
    mlx-lm's load gives it (mixed recipes differ by layer and by projection); nothing is
    requantized. Returns decoder layer -> bundle layout."""
    modules = dict(model.named_modules())
    layouts = {}
    for layer, sw in switches.items():
        quant, shapes = {}, {}
        for proj in sw.dims:
            path = f"{sw.path}.{proj}"
            m = modules[path]
            if not hasattr(m, "bits"):
                raise CheckpointError(
                    f"{ckpt.path}: {path} is not quantized while "
                    f"config.json has a 'quantization' entry; every routed "
                    f"expert must be quantized (or the whole source float)"
                )
            if ckpt.dtype(f"{path}.weight") != "uint32":
                raise CheckpointError(
                    f"{ckpt.path}: {path}.weight is {ckpt.dtype(f'{path}.weight')}, "
                    "not the packed uint32 a quantized tensor is"
                )
            q = Quant(
                m.bits, module_group_size(m), m.mode, m.get("global_scale") is not None
            )
            problem = q.problem()
            if problem is not None:
                raise CheckpointError(
                    f"{ckpt.path}: {path} is quantized {q.describe()}, which MLX does "
                    f"not define ({problem})"
                )
            quant[proj] = q
            for part in q.parts:
                name = f"{path}.{part}"
                shapes[f"{proj}.{part}"] = (ckpt.shape(name)[1:], ckpt.dtype(name))
        layouts[layer] = BundleLayout.of(quant, shapes)
    _one_scale_dtype(ckpt, switches, layouts)
    kinds = {q for layout in layouts.values() for q in layout.quant.values()}
    for flag, given, have in (
        ("--bits", bits, {q.bits for q in kinds}),
        ("--group-size", group_size, {q.group_size for q in kinds}),
    ):
        if given is not None and have != {given}:
            raise ConfigError(
                f"{ckpt.path} is already quantized "
                f"({describe_layers(layouts.items())}); {flag} {given} would need "
                f"requantization, which convert does not do: drop {flag} or start "
                f"from an fp16/bf16 checkpoint"
            )
    return layouts


def _one_scale_dtype(ckpt, switches, layouts) -> None:
    """Affine expert scales and biases keep one float dtype (mlx-lm writes one; the resident
    weights' scales are checked against it when the model loads)."""
    first = None
    for layer, layout in layouts.items():
        for spec in layout.tensors:
            if spec.name.endswith((".scales", ".biases")) and spec.dtype != "uint8":
                if first is None:
                    first = (spec.dtype, f"{switches[layer].path}.{spec.name}")
                elif spec.dtype != first[0]:
                    raise CheckpointError(
                        f"{ckpt.path}: {switches[layer].path}.{spec.name} is "
                        f"{spec.dtype} but {first[1]} is {first[0]}; expert scales and "
                        f"biases must share one float dtype: re-save SRC with one"
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
    layouts = {}
    for layer, sw in switches.items():
        quant, shapes = {}, {}
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
            g, b, mode = q
            quant[proj] = Quant(b, g, mode)
            for part, spec in quant[proj].part_specs(out_dim, in_dim, dtype).items():
                shapes[f"{proj}.{part}"] = spec
        layouts[layer] = BundleLayout.of(quant, shapes)
    _one_scale_dtype(ckpt, switches, layouts)
    return qconfig, qmodel, layouts


def new_index(plan: Plan, model_type: str) -> ExpertIndex:
    """An ExpertIndex for the plan's bundle layouts (crc32 and source filled in later),
    checked before anything is written."""
    index = ExpertIndex.for_layers(
        model_type, plan.num_experts, plan.module_path, plan.layouts
    )
    index.validate()
    return index
