"""Unmerged recovery LoRA on resident modules: `y = W(x) + (alpha/r) * B(A(x))`.

The low-rank path runs beside the (int4) base layer and is never merged into it, so the
quantized weights stay byte-identical and the adapter can be switched off (`remove_lora`).
LoRA goes only on resident linear layers (attention, linear attention, shared experts, the dense
layer-0 MLP); never on routed experts (`switch_mlp`, streamed from disk) and never on routers.

    from edge0_eval.engine.lora import load_adapter
    meta = load_adapter(model, "lora.safetensors")          # validates everything, then applies

The file (`<module path>.lora_A` [r, in], `.lora_B` [out, r], alpha metadata; PEFT and mlx-lm
tuner files are read too) is formats/adapters.py's. `<module path>` is the module's path in
mlx-lm's model object, e.g. `language_model.model.layers.3.self_attn.q_proj` (qwen3_5_moe) or
`model.layers.0.attention.query_key_value` (bailing_hybrid). The engine's model is mlx-lm's class
with only the MoE blocks' instances swapped, keeping every resident path, so one file serves both.

Module paths. `apply_lora`/`load_adapter` replace the layer at `<path>` by a `LoRALinear` whose
child `linear` is the original layer, so the adapter parameters sit at exactly
`<path>.lora_A` / `<path>.lora_B` (the file keys) while the base weights move to
`<path>.linear.*` (the name mlx-lm's own tuner uses). Resident weights are loaded before any LoRA
is applied, so nothing needs the old base names afterwards; call `remove_lora` to restore them.

Numerics. A and B are held in float32 (whatever the file's dtype: fp16/bf16 -> fp32 is exact),
the input is cast to float32 for the low-rank path and the scaled delta is cast to the base
output's dtype just before the add: `y = base(x) + (scale * ((x @ A.T) @ B.T)).astype(y.dtype)`.
Float32 costs ~nothing (r=16: 16*(in+out) MACs per token against in*out for the base) and keeps
the rank-r intermediate and the alpha/r scaling from being rounded to fp16 twice; it is also
the dtype training needs. With B == 0 the delta is exactly zero and the output is the base's,
bit for bit. (The reference deployment computes the delta in fp16; `compute_dtype=mx.float16`
reproduces that.)
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

from edge0_eval.engine.families import FAMILIES
from edge0_eval.errors import CheckpointError, ConfigError
from edge0_eval.formats.adapters import (
    KIND,
    SUFFIX_A,
    SUFFIX_B,
    natural_key,
    read_adapter,
    write_adapter,
)

_ROUTER_SUFFIXES = (".mlp.gate", ".mlp.gate.gate_proj")


# -- the layer ---------------------------------------------------------------------------------


def linear_dims(module: nn.Module) -> tuple[int, int]:
    """(input_dims, output_dims) of a Linear or QuantizedLinear (or of a LoRALinear's base)."""
    if isinstance(module, LoRALinear):
        module = module.linear
    if isinstance(module, nn.QuantizedLinear):
        out_dims, packed = module.weight.shape
        return packed * 32 // module.bits, out_dims
    if isinstance(module, nn.Linear):
        out_dims, in_dims = module.weight.shape
        return in_dims, out_dims
    raise TypeError(f"{type(module).__name__} is not a Linear or QuantizedLinear")


class LoRALinear(nn.Module):
    """`linear(x) + (alpha/r) * ((x @ lora_A.T) @ lora_B.T)`, never merged into `linear`.

    `lora_A` is [r, in] and `lora_B` is [out, r] (the file layout). The wrapped layer is frozen,
    so `trainable_parameters()` of the wrapper holds only the two LoRA matrices.
    """

    def __init__(
        self,
        linear: nn.Module,
        r: int,
        alpha: float,
        lora_A: mx.array | None = None,
        lora_B: mx.array | None = None,
        compute_dtype=mx.float32,
    ):
        super().__init__()
        if isinstance(linear, LoRALinear):
            raise TypeError("the layer already has a LoRA path")
        in_dims, out_dims = linear_dims(linear)
        if r < 1:
            raise ConfigError(f"LoRA rank r must be at least 1, not {r}")
        self.linear = linear
        self.linear.freeze()
        self.r, self.alpha = int(r), float(alpha)
        self.scale = self.alpha / self.r
        a = mx.zeros((r, in_dims)) if lora_A is None else lora_A
        b = mx.zeros((out_dims, r)) if lora_B is None else lora_B
        if tuple(a.shape) != (r, in_dims) or tuple(b.shape) != (out_dims, r):
            raise ValueError(
                f"LoRA shapes {tuple(a.shape)}/{tuple(b.shape)} do not fit "
                f"[{r}, {in_dims}]/[{out_dims}, {r}]"
            )
        self.lora_A = a.astype(compute_dtype)
        self.lora_B = b.astype(compute_dtype)

    def __call__(self, x: mx.array) -> mx.array:
        y = self.linear(x)
        a = self.lora_A
        z = (x.astype(a.dtype) @ a.T) @ self.lora_B.T
        return y + (self.scale * z).astype(y.dtype)


# -- module paths ------------------------------------------------------------------------------


def get_module(model: nn.Module, path: str):
    """(module or None, deepest existing prefix)."""
    node, walked = model, []
    for part in path.split("."):
        if isinstance(node, (list, tuple)):
            if not (part.isdigit() and int(part) < len(node)):
                return None, ".".join(walked)
            node = node[int(part)]
        elif isinstance(node, dict) and part in node:
            node = node[part]
        else:
            return None, ".".join(walked)
        walked.append(part)
    return node, path


def set_module(model: nn.Module, path: str, module: nn.Module) -> None:
    parent_path, _, leaf = path.rpartition(".")
    parent = get_module(model, parent_path)[0] if parent_path else model
    if isinstance(parent, list):
        parent[int(leaf)] = module
    else:
        setattr(parent, leaf, module)


def refusal(path: str, module) -> str | None:
    """Why `module` at `path` may not carry a LoRA path, or None if it may."""
    if "switch_mlp" in path.split(".") or isinstance(
        module, (SwitchLinear, QuantizedSwitchLinear)
    ):
        return (
            "a routed expert (streamed from disk); LoRA goes on resident modules only"
        )
    if ("." + path).endswith(_ROUTER_SUFFIXES):
        return "a router; LoRA is never applied to routers"
    if isinstance(module, LoRALinear):
        module = module.linear
    if not isinstance(module, (nn.Linear, nn.QuantizedLinear)):
        return f"a {type(module).__name__}, not a Linear or QuantizedLinear"
    return None


def default_targets(family_name: str) -> list[str]:
    """Suffix patterns of the resident linear layers that get LoRA in `family_name` (the
    family registry's `lora_targets`)."""
    if family_name not in FAMILIES:
        raise ConfigError(
            f"no default LoRA targets for model family {family_name!r}; "
            f"known: {', '.join(FAMILIES)} (pass targets= explicitly)"
        )
    return list(FAMILIES[family_name].lora_targets)


def _matches(path: str, pattern: str) -> bool:
    return path == pattern or path.endswith("." + pattern)


def find_targets(model: nn.Module, patterns: list[str]) -> list[str]:
    """Paths of the linear layers whose path is, or ends with `.` + , one of `patterns`.

    Layers that already carry LoRA are included (as their `LoRALinear` path). A pattern that
    selects a router, a routed expert or a non-linear module raises ConfigError.
    """
    found = []
    for path, module in model.named_modules():
        if not path or not any(_matches(path, p) for p in patterns):
            continue
        if path.endswith(".linear") and isinstance(
            get_module(model, path[:-7])[0], LoRALinear
        ):
            continue
        why = refusal(path, module)
        if why is not None:
            raise ConfigError(f"LoRA target {path} is {why}")
        found.append(path)
    return sorted(found, key=natural_key)


def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    """Every LoRA layer of the model, by path, in layer order."""
    found = {p: m for p, m in model.named_modules() if isinstance(m, LoRALinear)}
    return {p: found[p] for p in sorted(found, key=natural_key)}


def remove_lora(model: nn.Module) -> list[str]:
    """Put the original layers back; returns the paths that had LoRA."""
    paths = list(lora_modules(model))
    for path in paths:
        set_module(model, path, get_module(model, path)[0].linear)
    return paths


def mark_trainable(model: nn.Module) -> None:
    """Freeze the whole model except the LoRA matrices (for training)."""
    model.freeze()
    for module in lora_modules(model).values():
        module.unfreeze(keys=["lora_A", "lora_B"], recurse=False)


# -- apply (training init) ---------------------------------------------------------------------


def apply_lora(
    model: nn.Module,
    r: int = 16,
    alpha: float = 32.0,
    targets: list[str] | None = None,
    init: str = "zeros",
    seed: int = 0,
    family: str | None = None,
    compute_dtype=mx.float32,
) -> list[str]:
    """Wrap the target layers in `LoRALinear`; returns their paths.

    targets: suffix patterns (default `default_targets(family or model.model_type)`).
    init="zeros": A ~ U(-1/sqrt(in), 1/sqrt(in)), B = 0 (mlx-lm's LoRA init: the output is
    unchanged, training starts from the base model). init="random": B normal with std 1/r, so the
    adapter changes outputs (tests, debugging). Deterministic for `seed`; the global RNG is not
    touched.
    """
    if init not in ("zeros", "random"):
        raise ConfigError(f"init must be 'zeros' or 'random', not {init!r}")
    if r < 1:
        raise ConfigError(f"LoRA rank r must be at least 1, not {r}")
    if targets is None:
        targets = default_targets(family or getattr(model, "model_type", None))
    paths = find_targets(model, list(targets))
    if not paths:
        raise ConfigError(f"no LoRA targets match {list(targets)}")
    already = [p for p in paths if isinstance(get_module(model, p)[0], LoRALinear)]
    if already:
        raise ConfigError(
            f"{already[0]} already has LoRA ({len(already)} layers); "
            f"call remove_lora(model) first"
        )
    keys = mx.random.split(mx.random.key(seed), 2 * len(paths))
    wrapped = []
    for i, path in enumerate(paths):
        base = get_module(model, path)[0]
        in_dims, out_dims = linear_dims(base)
        bound = 1 / math.sqrt(in_dims)
        a = mx.random.uniform(-bound, bound, (r, in_dims), key=keys[2 * i])
        b = (
            mx.random.normal((out_dims, r), key=keys[2 * i + 1]) / r
            if init == "random"
            else mx.zeros((out_dims, r))
        )
        wrapped.append((path, LoRALinear(base, r, alpha, a, b, compute_dtype)))
    for path, module in wrapped:
        set_module(model, path, module)
    mx.eval([m.parameters() for _, m in wrapped])
    return paths


# -- adapter files (formats/adapters.py) -------------------------------------------------------


def load_adapter(
    model: nn.Module,
    path: str | Path,
    expect_kind: str = KIND,
    *,
    alpha: float | None = None,
    experts_per_token: int | None = None,
    compute_dtype=mx.float32,
) -> dict:
    """Read the adapter at `path` (formats/adapters.py: ours, PEFT, mlx-lm tuner), check it
    against `model`, then apply it (replacing any LoRA).

    Beyond the file's own checks: every module exists (Hugging Face names mapped by the model's
    `sanitize`), is a resident Linear/QuantizedLinear (not a router or routed expert) and A is
    [r, in], B is [out, r] for its dims. Any failure raises one CheckpointError naming the file
    and the key, and leaves the model untouched. experts_per_token: the engine's routing width; a different
    metadata `K` (the width the adapter was trained at) only warns. Returns the file's summary
    (`AdapterFile.summary`) with `targets`, the module paths.
    """
    adapter = read_adapter(path, expect_kind=expect_kind, alpha=alpha)
    path = adapter.path
    planned = []
    for module_path, (a, b) in _model_names(model, adapter.pairs).items():
        key_a, key_b = module_path + SUFFIX_A, module_path + SUFFIX_B
        module, existing = get_module(model, module_path)
        if module is None:
            raise CheckpointError(
                f"{path}: key {key_a!r}: module {module_path!r} does not exist in this model "
                f"(deepest existing path: {existing or '<root>'!r}); the adapter is for another "
                f"model or layout"
            )
        why = refusal(module_path, module)
        if why is not None:
            raise CheckpointError(
                f"{path}: key {key_a!r}: module {module_path!r} is {why}"
            )
        base = module.linear if isinstance(module, LoRALinear) else module
        in_dims, out_dims = linear_dims(base)
        r = a.shape[0]
        if tuple(a.shape) != (r, in_dims):
            raise CheckpointError(
                f"{path}: key {key_a!r} has shape {tuple(a.shape)}; module "
                f"{module_path!r} needs [r, {in_dims}]"
            )
        if tuple(b.shape) != (out_dims, r):
            raise CheckpointError(
                f"{path}: key {key_b!r} has shape {tuple(b.shape)}; module "
                f"{module_path!r} needs [{out_dims}, {r}] (r from {key_a!r})"
            )
        planned.append((module_path, base, a, b))
    if experts_per_token is not None and adapter.K not in (None, experts_per_token):
        warnings.warn(
            f"{path}: the adapter was trained at K={adapter.K}, the engine routes "
            f"top-{experts_per_token}",
            stacklevel=2,
        )

    # Everything validated: now (and only now) change the model.
    new = [
        (p, LoRALinear(base, a.shape[0], adapter.alpha, a, b, compute_dtype))
        for p, base, a, b in planned
    ]
    remove_lora(model)
    for module_path, module in new:
        set_module(model, module_path, module)
    mx.eval([m.parameters() for _, m in new])
    return {**adapter.summary(), "targets": [p for p, _ in new]}


def _model_names(model: nn.Module, pairs: dict) -> dict:
    """Module paths not in the model but whose Hugging Face name mlx-lm's `sanitize` maps to one
    of its modules (`model.language_model.*` -> `language_model.model.*`), in layer order."""
    sanitize = getattr(model, "sanitize", None)
    out = {}
    for module_path, pair in pairs.items():
        if sanitize is not None and get_module(model, module_path)[0] is None:
            try:
                mapped = list(sanitize({f"{module_path}.weight": mx.zeros((1, 1))}))
            except Exception:  # noqa: BLE001 - a family's sanitize on a placeholder; no mapping
                mapped = []
            if (
                len(mapped) == 1
                and mapped[0].endswith(".weight")
                and get_module(model, mapped[0][: -len(".weight")])[0] is not None
            ):
                module_path = mapped[0][: -len(".weight")]
        out[module_path] = pair
    return {p: out[p] for p in sorted(out, key=natural_key)}


def save_adapter(
    model: nn.Module,
    path: str | Path,
    metadata: dict | None = None,
    dtype: str = "float16",
) -> Path:
    """Write the model's LoRA matrices (formats/adapters.py's `write_adapter`: dtype, metadata);
    all layers must share one r and alpha. Returns the path."""
    modules = lora_modules(model)
    if not modules:
        raise ConfigError(
            "the model has no LoRA layers; call apply_lora or load_adapter first"
        )
    settings = {(m.r, m.alpha) for m in modules.values()}
    if len(settings) > 1:
        raise ConfigError(
            f"LoRA layers differ in (r, alpha): {sorted(settings)}; one file holds "
            f"one r and alpha"
        )
    r, alpha = settings.pop()
    return write_adapter(
        path,
        {p: (m.lora_A, m.lora_B) for p, m in modules.items()},
        r=r,
        alpha=alpha,
        metadata=metadata,
        dtype=dtype,
        model_type=getattr(model, "model_type", None),
    )
