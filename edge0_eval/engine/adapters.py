"""LoRA adapter files: read, validate and apply (`load_adapter`), write (`save_adapter`).

The file layout and the numerics are described in engine/lora.py, which owns the layer; this
module owns the file format: keys `<module path>.lora_A` / `.lora_B`, metadata strings
kind="lora", format_version="1", r, alpha and the optional model, K, source, owners, stage, step.

The formats people publish are read too: PEFT files (`base_model.model.<module>.lora_A.weight`,
scale lora_alpha/r from adapter_config.json) and mlx-lm tuner adapters (`<module>.lora_a` [in, r],
`lora_b` [r, out], scale from adapter_config.json); module paths under Hugging Face names are
mapped to the model's by its own mlx-lm `sanitize`.
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from edge0_eval.formats.safetensors import read_safetensors_header, write_safetensors
from edge0_eval.formats.json_files import read_json_file
from edge0_eval.engine.lora import (LoRALinear, get_module, linear_dims, lora_modules,
                                    natural_key, refusal, remove_lora, set_module)
from edge0_eval.errors import CheckpointError, ConfigError

KIND = "lora"
FORMAT_VERSION = "1"
SUFFIX_A, SUFFIX_B = ".lora_A", ".lora_B"
# Above this the LoRA path dominates any base layer (published adapters: 32 at r=16).
MAX_ALPHA = 4096.0
_FILE_DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}
_FP16_MAX = 65504.0


def _meta_number(meta: dict, key: str, where: Path, integer: bool = False) -> float | int | None:
    """Metadata `key` as a finite number (`integer`: a whole one); None when absent."""
    if meta.get(key) in (None, ""):
        return None
    try:
        value = float(meta[key])
    except (TypeError, ValueError):
        value = math.nan
    if not math.isfinite(value) or (integer and value != int(value)):
        raise CheckpointError(f"{where}: metadata key {key!r} is {meta[key]!r}, not "
                              f"{'an integer' if integer else 'a number'}; the adapter file "
                              f"is malformed")
    return int(value) if integer else value


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


ADAPTER_CONFIG = "adapter_config.json"


PEFT_PREFIX = "base_model.model."
_PEFT_A, _PEFT_B = ".lora_A.weight", ".lora_B.weight"
_MLX_A, _MLX_B = ".lora_a", ".lora_b"


def _refuse_unsupported_config(config: dict, config_path: Path) -> None:
    """Adapter kinds whose numerics are not LoRA's (DoRA, full fine-tunes, per-module ranks)."""
    kind = config.get("fine_tune_type", "lora")
    peft = config.get("peft_type", "LORA")
    if kind != "lora" or peft != "LORA" or config.get("use_dora"):
        what = kind if kind != "lora" else ("DoRA" if config.get("use_dora") else peft)
        raise CheckpointError(f"{config_path}: a {what!r} adapter; only plain LoRA adapters "
                              f"are served (merge it into the checkpoint with its trainer, "
                              f"then convert that)")
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise CheckpointError(f"{config_path}: PEFT {key} gives modules their own rank or "
                                  f"alpha; one adapter file is served at one r and alpha")


def alpha_from_adapter_config(path: Path) -> float | None:
    """alpha from the adapter_config.json beside an adapter file, as the trainers write it:
    PEFT's `lora_alpha` (scale alpha/r, or alpha/sqrt(r) with use_rslora), or mlx-lm's
    `lora_parameters` {rank, scale} (scale applied as is, so alpha = scale x rank). None when
    there is no such file. Adapter kinds that are not plain LoRA are refused here."""
    config_path = path.parent / ADAPTER_CONFIG
    if not config_path.exists():
        return None
    config = read_json_file(config_path, ADAPTER_CONFIG, "copy it again beside the adapter "
                            "(or give the adapter an 'alpha' metadata key)")
    _refuse_unsupported_config(config, config_path)
    lora = config.get("lora_parameters")
    if "lora_alpha" in config:
        value = config["lora_alpha"]
        if config.get("use_rslora") and _number(value):
            if not _number(config.get("r")) or config["r"] < 1:
                raise CheckpointError(f"{config_path}: use_rslora needs the rank 'r'")
            value = value * math.sqrt(config["r"])      # rsLoRA's scale alpha/sqrt(r)
    elif isinstance(lora, dict) and "scale" in lora and "rank" in lora:
        value = (lora["scale"] * lora["rank"]
                 if all(_number(v) for v in (lora["scale"], lora["rank"])) else None)
    else:
        return None
    if not _number(value):
        raise CheckpointError(f"{config_path}: the LoRA alpha it gives is {value!r}; it must be "
                              f"a positive number")
    return float(value)


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


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
    arrays = _model_names(model, _edge0_layout(arrays, path))

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
    for key in sorted(arrays, key=natural_key):
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

    r_meta = _meta_number(meta, "r", path, integer=True)
    alpha_value = float(alpha) if alpha is not None else _meta_number(meta, "alpha", path)
    if alpha_value is None:
        alpha_value = alpha_from_adapter_config(path)
    if alpha_value is None:
        raise CheckpointError(f"{path}: metadata key 'alpha' is missing, no alpha was given "
                              f"(--lora-alpha / lora_alpha) and no {ADAPTER_CONFIG} beside it "
                              f"gives one (PEFT 'lora_alpha', or mlx-lm 'lora_parameters' rank "
                              f"and scale); the LoRA scale alpha/r is unknown (Edge0 adapters "
                              f"use r=16, alpha=32)")
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
                want = "[r, in]" if key == key_a else "[out, r]"
                raise CheckpointError(f"{path}: key {key!r} has shape {tuple(arr.shape)}; "
                                      f"expected a matrix ({want})")
            file_dtypes.add(str(arr.dtype).split(".")[-1])
        module, existing = get_module(model, module_path)
        if module is None:
            raise CheckpointError(
                f"{path}: key {key_a!r}: module {module_path!r} does not exist in this model "
                f"(deepest existing path: {existing or '<root>'!r}); the adapter is for another "
                f"model or layout")
        why = refusal(module_path, module)
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

    k_meta = _meta_number(meta, "K", path, integer=True)
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
        set_module(model, module_path, module)
    mx.eval([m.parameters() for _, m in new])
    return {
        "path": str(path), "kind": kind, "format_version": version, "r": r_value,
        "alpha": alpha_value, "scale": alpha_value / r_value, "K": k_meta,
        "model": meta.get("model"), "source": meta.get("source"), "owners": owners or None,
        "stage": meta.get("stage"), "step": _meta_number(meta, "step", path, integer=True),
        "targets": [p for p, _ in new], "file_dtype": ",".join(sorted(file_dtypes)),
        "metadata": meta,
    }


def _edge0_layout(arrays: dict[str, mx.array], path: Path) -> dict[str, mx.array]:
    """PEFT and mlx-lm tuner keys rewritten as `<module>.lora_A` [r, in] / `.lora_B` [out, r];
    files already in that layout (or in none) pass unchanged for load_adapter's checks."""
    keys = list(arrays)
    if any(k.endswith((_PEFT_A, _PEFT_B)) for k in keys):
        other = [k for k in keys if not k.endswith((_PEFT_A, _PEFT_B))]
        if other:
            raise CheckpointError(f"{path}: a PEFT adapter holding {other[0]!r} (DoRA "
                                  f"magnitudes, embedding LoRA or saved modules); only plain "
                                  f"LoRA on linear layers is served")
        out = {}
        for k, v in arrays.items():
            k = k[len(PEFT_PREFIX):] if k.startswith(PEFT_PREFIX) else k
            out[k[: -len(".weight")]] = v
        return out
    if any(k.endswith((_MLX_A, _MLX_B)) for k in keys):
        out = {}
        for k, v in arrays.items():
            if not k.endswith((_MLX_A, _MLX_B)):
                raise CheckpointError(f"{path}: an mlx-lm adapter holding {k!r} (a DoRA "
                                      f"magnitude or a full fine-tune); only plain LoRA "
                                      f"adapters are served")
            if v.ndim != 2:
                raise CheckpointError(f"{path}: key {k!r} has shape {tuple(v.shape)}: LoRA on "
                                      f"routed experts (mlx-lm's LoRASwitchLinear) is not "
                                      f"served; the streamed experts stay as converted")
            # mlx-lm computes (x @ lora_a) @ lora_b: ours are the transposes, copied once so
            # every decode step's matmul reads a contiguous matrix, not a strided view.
            suffix = SUFFIX_A if k.endswith(_MLX_A) else SUFFIX_B
            out[k[: -len(_MLX_A)] + suffix] = mx.contiguous(v.T)
        return out
    return arrays


def _model_names(model: nn.Module, arrays: dict[str, mx.array]) -> dict[str, mx.array]:
    """Keys whose module is not in the model but whose Hugging Face name mlx-lm's `sanitize`
    maps to one of its modules (`model.language_model.*` -> `language_model.model.*`)."""
    sanitize = getattr(model, "sanitize", None)
    out = {}
    for key, value in arrays.items():
        module_path, dot, suffix = key.rpartition(".")
        if sanitize is not None and dot and get_module(model, module_path)[0] is None:
            try:
                mapped = list(sanitize({f"{module_path}.weight": mx.zeros((1, 1))}))
            except Exception:  # noqa: BLE001 - a family's sanitize on a placeholder; no mapping
                mapped = []
            if len(mapped) == 1 and mapped[0].endswith(".weight") and \
                    get_module(model, mapped[0][: -len(".weight")])[0] is not None:
                key = f"{mapped[0][: -len('.weight')]}.{suffix}"
        out[key] = value
    return out


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
    return write_safetensors(path, arrays, out)
