"""Unmerged recovery LoRA on resident modules: `y = W(x) + (alpha/r) * B(A(x))`.

The low-rank path runs beside the (int4) base layer and is never merged into it, so the
quantized weights stay byte-identical and the adapter can be switched off (`remove_lora`).
LoRA goes only on resident linear layers (attention, linear attention, shared experts, the dense
layer-0 MLP); never on routed experts (`switch_mlp`, streamed from disk) and never on routers.

    from edge0_eval.engine.lora import load_adapter
    meta = load_adapter(model, "lora.safetensors")          # validates everything, then applies

File layout (ours and the published Edge0 one are the same; safetensors):
    <module path>.lora_A   [r, in]    float16 (bfloat16 / float32 are read too)
    <module path>.lora_B   [out, r]
    metadata (all strings): kind="lora", format_version="1", r, alpha, and optionally model, K,
    source, owners (JSON list; prerouter files), stage, step.
`<module path>` is the module's path in mlx-lm's model object, e.g.
`language_model.model.layers.3.self_attn.q_proj` (qwen3_5_moe) or
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

import json
import math
import os
import warnings
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from edge0_eval.engine.checks import read_safetensors_header
from edge0_eval.errors import CheckpointError, ConfigError

KIND = "lora"
FORMAT_VERSION = "1"
SUFFIX_A, SUFFIX_B = ".lora_A", ".lora_B"
# Above this the LoRA path dominates any base layer (published adapters: 32 at r=16).
MAX_ALPHA = 4096.0
_FILE_DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}
_FP16_MAX = 65504.0

# Suffix patterns of resident linear layers, per family (checked against mlx-lm 0.32 model code:
# qwen3_next.py / qwen3_5.py / bailing_hybrid.py / qwen2_moe.py). Patterns that a given config
# does not build (e.g. MLA's q_a_proj when q_lora_rank is None) simply match nothing.
_TARGETS = {
    "qwen3_5_moe": [
        # full attention (every 4th layer)
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        # GatedDeltaNet (linear attention)
        "linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.in_proj_b",
        "linear_attn.in_proj_a", "linear_attn.out_proj",
        # shared expert (resident); `mlp.shared_expert_gate` (out=1) is left out by default
        "mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj", "mlp.shared_expert.down_proj",
    ],
    "qwen3_next": [
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "linear_attn.in_proj_qkvz", "linear_attn.in_proj_ba", "linear_attn.out_proj",
        "mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj", "mlp.shared_expert.down_proj",
    ],
    "qwen2_moe": [
        # attention (every layer; q/k/v carry a bias, which LoRALinear's base keeps)
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        # shared expert (resident); `mlp.shared_expert_gate` (out=1) is left out by default
        "mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj", "mlp.shared_expert.down_proj",
    ],
    "bailing_hybrid": [
        # linear attention layers
        "attention.query_key_value", "attention.g_proj",
        # MLA (global) layers; q_a_proj/q_b_proj exist only when q_lora_rank is set.
        # embed_q/unembed_out are MultiLinear (absorbed kv_b), not Linear: not targets.
        "attention.q_proj", "attention.q_a_proj", "attention.q_b_proj",
        "attention.kv_a_proj_with_mqa",
        # output projection of both attention kinds
        "attention.dense",
        # shared experts of MoE layers
        "mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj",
        "mlp.shared_experts.down_proj",
        # dense layer-0 MLP (`mlp.gate.gate_proj`, the router, does not end with `.mlp.gate_proj`)
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
    ],
}
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

    def __init__(self, linear: nn.Module, r: int, alpha: float, lora_A: mx.array | None = None,
                 lora_B: mx.array | None = None, compute_dtype=mx.float32):
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
            raise ValueError(f"LoRA shapes {tuple(a.shape)}/{tuple(b.shape)} do not fit "
                             f"[{r}, {in_dims}]/[{out_dims}, {r}]")
        self.lora_A = a.astype(compute_dtype)
        self.lora_B = b.astype(compute_dtype)

    @property
    def input_dims(self) -> int:
        return self.lora_A.shape[1]

    @property
    def output_dims(self) -> int:
        return self.lora_B.shape[0]

    def __call__(self, x: mx.array) -> mx.array:
        y = self.linear(x)
        a = self.lora_A
        z = (x.astype(a.dtype) @ a.T) @ self.lora_B.T
        return y + (self.scale * z).astype(y.dtype)


# -- module paths ------------------------------------------------------------------------------

def _natural_key(path: str):
    return [int(p) if p.isdigit() else p for p in path.split(".")]


def _get_module(model: nn.Module, path: str):
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


def _set_module(model: nn.Module, path: str, module: nn.Module) -> None:
    parent_path, _, leaf = path.rpartition(".")
    parent = _get_module(model, parent_path)[0] if parent_path else model
    if isinstance(parent, list):
        parent[int(leaf)] = module
    else:
        setattr(parent, leaf, module)


def _refusal(path: str, module) -> str | None:
    """Why `module` at `path` may not carry a LoRA path, or None if it may."""
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

    if "switch_mlp" in path.split(".") or isinstance(module, (SwitchLinear, QuantizedSwitchLinear)):
        return "a routed expert (streamed from disk); LoRA goes on resident modules only"
    if ("." + path).endswith(_ROUTER_SUFFIXES):
        return "a router; LoRA is never applied to routers"
    if isinstance(module, LoRALinear):
        module = module.linear
    if not isinstance(module, (nn.Linear, nn.QuantizedLinear)):
        return f"a {type(module).__name__}, not a Linear or QuantizedLinear"
    return None


def default_targets(family_name: str) -> list[str]:
    """Suffix patterns of the resident linear layers that get LoRA in `family_name`."""
    if family_name not in _TARGETS:
        raise ConfigError(f"no default LoRA targets for model family {family_name!r}; "
                          f"known: {', '.join(_TARGETS)} (pass targets= explicitly)")
    return list(_TARGETS[family_name])


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
        if path.endswith(".linear") and isinstance(_get_module(model, path[:-7])[0], LoRALinear):
            continue
        why = _refusal(path, module)
        if why is not None:
            raise ConfigError(f"LoRA target {path} is {why}")
        found.append(path)
    return sorted(found, key=_natural_key)


def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    """Every LoRA layer of the model, by path, in layer order."""
    found = {p: m for p, m in model.named_modules() if isinstance(m, LoRALinear)}
    return {p: found[p] for p in sorted(found, key=_natural_key)}


def remove_lora(model: nn.Module) -> list[str]:
    """Put the original layers back; returns the paths that had LoRA."""
    paths = list(lora_modules(model))
    for path in paths:
        _set_module(model, path, _get_module(model, path)[0].linear)
    return paths


def mark_trainable(model: nn.Module) -> None:
    """Freeze the whole model except the LoRA matrices (for training)."""
    model.freeze()
    for module in lora_modules(model).values():
        module.unfreeze(keys=["lora_A", "lora_B"], recurse=False)


# -- apply (training init) ---------------------------------------------------------------------

def apply_lora(model: nn.Module, r: int = 16, alpha: float = 32.0,
               targets: list[str] | None = None, init: str = "zeros", seed: int = 0,
               family: str | None = None, compute_dtype=mx.float32) -> list[str]:
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
    already = [p for p in paths if isinstance(_get_module(model, p)[0], LoRALinear)]
    if already:
        raise ConfigError(f"{already[0]} already has LoRA ({len(already)} layers); "
                          f"call remove_lora(model) first")
    keys = mx.random.split(mx.random.key(seed), 2 * len(paths))
    wrapped = []
    for i, path in enumerate(paths):
        base = _get_module(model, path)[0]
        in_dims, out_dims = linear_dims(base)
        bound = 1 / math.sqrt(in_dims)
        a = mx.random.uniform(-bound, bound, (r, in_dims), key=keys[2 * i])
        b = (mx.random.normal((out_dims, r), key=keys[2 * i + 1]) / r if init == "random"
             else mx.zeros((out_dims, r)))
        wrapped.append((path, LoRALinear(base, r, alpha, a, b, compute_dtype)))
    for path, module in wrapped:
        _set_module(model, path, module)
    mx.eval([m.parameters() for _, m in wrapped])
    return paths


# -- files -------------------------------------------------------------------------------------

def _int(meta: dict, key: str, where: Path) -> int | None:
    if meta.get(key) in (None, ""):
        return None
    try:
        value = float(meta[key])
        if value != int(value):
            raise ValueError
        return int(value)
    except (TypeError, ValueError, OverflowError):
        raise CheckpointError(f"{where}: metadata key {key!r} is {meta[key]!r}, not an integer; "
                              f"the adapter file is malformed") from None


def _float(meta: dict, key: str, where: Path) -> float | None:
    if meta.get(key) in (None, ""):
        return None
    try:
        value = float(meta[key])
    except (TypeError, ValueError):
        value = float("nan")
    if not math.isfinite(value):
        raise CheckpointError(f"{where}: metadata key {key!r} is {meta[key]!r}, not a number; "
                              f"the adapter file is malformed")
    return value


def read_adapter_file(path: str | Path, what: str = "LoRA adapter",
                      disable: str = "--no-lora") -> tuple[dict[str, mx.array], dict[str, str]]:
    """(arrays, metadata) of a safetensors adapter; one CheckpointError if missing/unreadable.

    `what`/`disable` word the not-found message (e.g. "prerouter", "--no-prerouter").
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: {what} file not found; give an existing .safetensors "
                              f"file, or run without it ({disable})")
    # The header is checked by the format's rules first: MLX is never handed a malformed one.
    read_safetensors_header(path, what,
                            f"download or save it again, or run without it ({disable})")
    try:
        arrays, meta = mx.load(str(path), format="safetensors", return_metadata=True)
        mx.eval(list(arrays.values()))
    except Exception as exc:  # MLX raises RuntimeError/ValueError for bad headers and offsets
        raise CheckpointError(f"{path}: not a readable safetensors file ({exc}); the file is "
                              f"truncated or corrupt, download or save it again") from None
    return arrays, dict(meta or {})


def load_adapter(model: nn.Module, path: str | Path, expect_kind: str = KIND, *,
                 alpha: float | None = None, top_k: int | None = None,
                 compute_dtype=mx.float32) -> dict:
    """Validate the LoRA file at `path` against `model`, then apply it (replacing any LoRA).

    Reads our files and the published Edge0 ones (same layout). Checks: the file exists and is a
    complete safetensors file; metadata `kind` == expect_kind (absent: inferred from the keys) and
    `format_version` major 1 (if given); every key is `<module>.lora_A` / `.lora_B`, in pairs,
    floating point and finite; every module exists, is a resident Linear/QuantizedLinear (not a
    router or routed expert) and A is [r, in], B is [out, r] for its dims; r is the metadata's
    (or, absent, the shapes', which must agree); alpha comes from the `alpha` argument, else the
    metadata (required: the scale alpha/r cannot be inferred). Any failure raises one
    CheckpointError naming the file and the key, and leaves the model untouched.

    top_k: the engine's routing width; a different metadata `K` (the width the adapter was
    trained at) only warns. Returns the parsed metadata: kind, format_version, r, alpha, scale,
    K, model, source, owners, stage, step, targets (paths), file_dtype, path, metadata (raw).
    """
    path = Path(path)
    arrays, meta = read_adapter_file(path)

    kind = meta.get("kind")
    all_lora = bool(arrays) and all(k.endswith((SUFFIX_A, SUFFIX_B)) for k in arrays)
    if kind is None and all_lora:
        kind = KIND
    if kind != expect_kind:
        hint = ("; it is a prerouter file: pass it as the prerouter path"
                if kind == "prerouter" else "")
        raise CheckpointError(f"{path}: metadata key 'kind' is {kind!r}, expected "
                              f"{expect_kind!r}{hint}")
    version = meta.get("format_version")
    if version not in (None, "") and str(version).split(".")[0] != FORMAT_VERSION:
        raise CheckpointError(f"{path}: metadata key 'format_version' is {version!r}; this build "
                              f"reads format version {FORMAT_VERSION}")
    if not arrays:
        raise CheckpointError(f"{path}: holds no tensors; expected <module>.lora_A/.lora_B pairs")

    pairs: dict[str, dict[str, str]] = {}
    for key in sorted(arrays, key=_natural_key):
        if key.endswith(SUFFIX_A):
            pairs.setdefault(key[: -len(SUFFIX_A)], {})["A"] = key
        elif key.endswith(SUFFIX_B):
            pairs.setdefault(key[: -len(SUFFIX_B)], {})["B"] = key
        else:
            raise CheckpointError(f"{path}: key {key!r} is not <module>{SUFFIX_A} or "
                                  f"<module>{SUFFIX_B}; not a LoRA adapter")
    for module_path, keys in pairs.items():
        for part, suffix in (("A", SUFFIX_A), ("B", SUFFIX_B)):
            if part not in keys:
                have = keys["B" if part == "A" else "A"]
                raise CheckpointError(f"{path}: key {module_path + suffix!r} is missing "
                                      f"(the file has {have!r}); the adapter is incomplete")

    r_meta = _int(meta, "r", path)
    alpha_value = float(alpha) if alpha is not None else _float(meta, "alpha", path)
    if alpha_value is None:
        raise CheckpointError(f"{path}: metadata key 'alpha' is missing and no alpha was given; "
                              f"the LoRA scale alpha/r is unknown (Edge0 adapters use "
                              f"r=16, alpha=32)")
    if r_meta is not None and r_meta < 1:
        raise CheckpointError(f"{path}: metadata key 'r' is {r_meta}; must be at least 1")
    if not 0 < alpha_value <= MAX_ALPHA:
        raise CheckpointError(f"{path}: alpha {alpha_value:g} is outside (0, {MAX_ALPHA:g}]; the "
                              f"LoRA scale alpha/r would swamp the base model (Edge0 adapters "
                              f"use r=16, alpha=32)")

    planned, ranks, file_dtypes = [], {}, set()
    for module_path, keys in pairs.items():
        key_a, key_b = keys["A"], keys["B"]
        a, b = arrays[key_a], arrays[key_b]
        for key, arr in ((key_a, a), (key_b, b)):
            if arr.dtype not in _FILE_DTYPES.values():
                raise CheckpointError(f"{path}: key {key!r} has dtype "
                                      f"{str(arr.dtype).split('.')[-1]}; expected "
                                      f"float16, bfloat16 or float32")
            if arr.ndim != 2:
                raise CheckpointError(f"{path}: key {key!r} has shape {tuple(arr.shape)}; "
                                      f"expected a matrix ({'[r, in]' if key == key_a else '[out, r]'})")
            file_dtypes.add(str(arr.dtype).split(".")[-1])
        module, existing = _get_module(model, module_path)
        if module is None:
            raise CheckpointError(
                f"{path}: key {key_a!r}: module {module_path!r} does not exist in this model "
                f"(deepest existing path: {existing or '<root>'!r}); the adapter is for another "
                f"model or layout")
        why = _refusal(module_path, module)
        if why is not None:
            raise CheckpointError(f"{path}: key {key_a!r}: module {module_path!r} is {why}")
        base = module.linear if isinstance(module, LoRALinear) else module
        in_dims, out_dims = linear_dims(base)
        r = a.shape[0]
        if r < 1:
            raise CheckpointError(f"{path}: key {key_a!r} has shape {tuple(a.shape)}: rank 0")
        if r_meta is not None and r != r_meta:
            raise CheckpointError(f"{path}: key {key_a!r} has rank {r} (shape {tuple(a.shape)}) "
                                  f"but metadata 'r' is {r_meta}")
        if tuple(a.shape) != (r, in_dims):
            raise CheckpointError(f"{path}: key {key_a!r} has shape {tuple(a.shape)}; module "
                                  f"{module_path!r} needs [r, {in_dims}]")
        if tuple(b.shape) != (out_dims, r):
            raise CheckpointError(f"{path}: key {key_b!r} has shape {tuple(b.shape)}; module "
                                  f"{module_path!r} needs [{out_dims}, {r}] (r from {key_a!r})")
        ranks.setdefault(r, key_a)
        planned.append((module_path, base, a, b))
    if len(file_dtypes) > 1:
        raise CheckpointError(f"{path}: tensors mix dtypes {sorted(file_dtypes)}; an adapter is "
                              f"saved in one dtype, so the header is corrupt")
    if len(ranks) > 1 and r_meta is None:
        (r1, k1), (r2, k2) = list(ranks.items())[:2]
        raise CheckpointError(f"{path}: metadata key 'r' is missing and ranks differ "
                              f"({k1!r}: {r1}, {k2!r}: {r2})")
    r_value = r_meta if r_meta is not None else next(iter(ranks))
    checked = [k for _, keys in pairs.items() for k in (keys["A"], keys["B"])]
    finite = mx.stack([mx.all(mx.isfinite(arrays[k])) for k in checked])  # one sync, not 2/module
    for key, ok in zip(checked, finite.tolist()):
        if not ok:
            raise CheckpointError(f"{path}: key {key!r} holds NaN or infinite values; the "
                                  f"adapter is corrupt")

    k_meta = _int(meta, "K", path)
    if top_k is not None and k_meta is not None and k_meta != top_k:
        warnings.warn(f"{path}: the adapter was trained at K={k_meta}, the engine routes "
                      f"top-{top_k}", stacklevel=2)
    owners = meta.get("owners")
    if owners:
        try:
            owners = json.loads(owners)
            if not isinstance(owners, list) or not all(
                    isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in owners):
                raise ValueError
        except ValueError:
            raise CheckpointError(f"{path}: metadata key 'owners' is {owners!r}, not a JSON "
                                  f"list") from None

    # Everything validated: now (and only now) change the model.
    new = [(p, LoRALinear(base, a.shape[0], alpha_value, a, b, compute_dtype))
           for p, base, a, b in planned]
    remove_lora(model)
    for module_path, module in new:
        _set_module(model, module_path, module)
    mx.eval([m.parameters() for _, m in new])
    return {
        "path": str(path), "kind": kind, "format_version": version, "r": r_value,
        "alpha": alpha_value, "scale": alpha_value / r_value, "K": k_meta,
        "model": meta.get("model"), "source": meta.get("source"), "owners": owners or None,
        "stage": meta.get("stage"), "step": _int(meta, "step", path),
        "targets": [p for p, _ in new], "file_dtype": ",".join(sorted(file_dtypes)),
        "metadata": meta,
    }


def _meta_str(value) -> str:
    if isinstance(value, (list, tuple, dict)):
        return json.dumps(list(value) if isinstance(value, tuple) else value)
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def save_adapter(model: nn.Module, path: str | Path, metadata: dict | None = None,
                 dtype: str = "float16") -> Path:
    """Write the model's LoRA matrices as `<path>.lora_A/.lora_B` safetensors (atomically).

    dtype: "float16" (the published layout), "bfloat16" or "float32". Metadata is written as
    strings: kind, format_version, r, alpha (from the layers) plus `metadata` (e.g. source,
    model, K, stage, step; lists/dicts as JSON). Returns the path.
    """
    if dtype not in _FILE_DTYPES:
        raise ConfigError(f"dtype must be one of {', '.join(_FILE_DTYPES)}, not {dtype!r}")
    modules = lora_modules(model)
    if not modules:
        raise ConfigError("the model has no LoRA layers; call apply_lora or load_adapter first")
    settings = {(m.r, m.alpha) for m in modules.values()}
    if len(settings) > 1:
        raise ConfigError(f"LoRA layers differ in (r, alpha): {sorted(settings)}; one file holds "
                          f"one r and alpha")
    r, alpha = settings.pop()
    out = {"kind": KIND, "format_version": FORMAT_VERSION, "r": str(r), "alpha": _meta_str(alpha)}
    given = {k: v for k, v in (metadata or {}).items() if v is not None}
    for key, value in given.items():
        if key in ("r", "alpha") and float(value) != float(out[key]):
            raise ConfigError(f"metadata {key}={value!r} contradicts the layers' {key}={out[key]}")
        if key in ("kind", "format_version") and str(value) != out[key]:
            raise ConfigError(f"metadata {key}={value!r}: save_adapter writes {key}={out[key]!r}")
        if key not in out:
            out[key] = _meta_str(value)
    if "model" not in out and getattr(model, "model_type", None):
        out["model"] = model.model_type

    target = _FILE_DTYPES[dtype]
    arrays = {}
    for module_path, module in modules.items():
        for suffix, value in ((SUFFIX_A, module.lora_A), (SUFFIX_B, module.lora_B)):
            key = module_path + suffix
            if not mx.all(mx.isfinite(value)).item():
                raise ConfigError(f"{key} holds NaN or infinite values; not saving")
            if dtype == "float16" and mx.abs(value).max().item() > _FP16_MAX:
                raise ConfigError(f"{key} exceeds the float16 range; save with dtype='float32'")
            arrays[key] = value.astype(target)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp.safetensors")
    try:
        mx.save_safetensors(str(tmp), arrays, metadata=out)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path
