"""LoRA adapter files: read and check (`read_adapter`), write (`write_adapter`).

This project's layout (safetensors): `<module path>.lora_A` [r, in] and `.lora_B` [out, r],
float16 (bfloat16 / float32 are read too), metadata strings kind="lora", format_version="1", r,
alpha and the optional model, K, source, owners (JSON list), stage, step. The engine applies the
pairs to its model's modules (engine/lora.py).

The formats people publish are read into the same layout: PEFT files
(`base_model.model.<module>.lora_A.weight`, scale lora_alpha/r from adapter_config.json) and
mlx-lm tuner adapters (`<module>.lora_a` [in, r], `lora_b` [r, out], scale from
adapter_config.json). Module paths stay as the file spells them (Hugging Face names are mapped to
the model's by the engine, with the model's own mlx-lm `sanitize`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from edge0_eval.errors import CheckpointError, ConfigError
from edge0_eval.formats.json_files import read_json_file, type_ok
from edge0_eval.formats.safetensors import read_safetensors_header, write_safetensors

KIND = "lora"
FORMAT_VERSION = "1"
SUFFIX_A, SUFFIX_B = ".lora_A", ".lora_B"
# Above this the LoRA path dominates any base layer (published adapters: 32 at r=16).
MAX_ALPHA = 4096.0
_FILE_DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}
_FP16_MAX = 65504.0

ADAPTER_CONFIG = "adapter_config.json"
PEFT_PREFIX = "base_model.model."
_PEFT_A, _PEFT_B = ".lora_A.weight", ".lora_B.weight"
_MLX_A, _MLX_B = ".lora_a", ".lora_b"


@dataclass(frozen=True)
class AdapterFile:
    """An adapter file, read and checked: (lora_A [r, in], lora_B [out, r]) per module path (as
    the file names it, in layer order), one r and alpha, and the metadata."""

    path: Path
    pairs: dict[str, tuple[mx.array, mx.array]]
    kind: str
    format_version: str | None
    r: int
    alpha: float
    K: int | None  # the routing width it was trained at
    owners: list[int] | None
    step: int | None
    file_dtype: str
    metadata: dict[str, str]

    def summary(self) -> dict:
        """path, kind, format_version, r, alpha, scale, K, model, source, owners, stage, step,
        file_dtype and the raw metadata."""
        meta = self.metadata
        return {
            "path": str(self.path),
            "kind": self.kind,
            "format_version": self.format_version,
            "r": self.r,
            "alpha": self.alpha,
            "scale": self.alpha / self.r,
            "K": self.K,
            "model": meta.get("model"),
            "source": meta.get("source"),
            "owners": self.owners,
            "stage": meta.get("stage"),
            "step": self.step,
            "file_dtype": self.file_dtype,
            "metadata": meta,
        }


def natural_key(path: str):
    """Module paths in layer order (`layers.2` before `layers.10`)."""
    return [int(p) if p.isdigit() else p for p in path.split(".")]


# -- reading -------------------------------------------------------------------------------------


def read_adapter_file(path: str | Path) -> tuple[dict[str, mx.array], dict[str, str]]:
    """(arrays, metadata) of a safetensors adapter; one CheckpointError if missing/unreadable."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(
            f"{path}: LoRA adapter file not found; give an existing "
            f".safetensors file, or run without it (--no-lora)"
        )
    # The header is checked by the format's rules first: MLX is never handed a malformed one.
    read_safetensors_header(
        path, "LoRA adapter", "download or save it again, or run without it (--no-lora)"
    )
    try:
        arrays, meta = mx.load(str(path), format="safetensors", return_metadata=True)
        mx.eval(list(arrays.values()))
    except Exception as exc:
        # MLX raises RuntimeError/ValueError for bad headers and offsets
        raise CheckpointError(
            f"{path}: not a readable safetensors file ({exc}); the file is "
            f"truncated or corrupt, download or save it again"
        ) from None
    return arrays, dict(meta or {})


def read_adapter(
    path: str | Path, *, expect_kind: str = KIND, alpha: float | None = None
) -> AdapterFile:
    """The adapter at `path` in any of the three layouts, checked as far as the file goes.

    Checks: the file exists and is a complete safetensors file; metadata `kind` == expect_kind
    (absent: inferred from the keys) and `format_version` major 1 (if given); every key is
    `<module>.lora_A` / `.lora_B`, in pairs, 2-D, floating point of one dtype and finite; r is
    the metadata's (or, absent, the shapes', which must agree); alpha comes from the `alpha`
    argument, else the metadata, else adapter_config.json beside the file (required: the scale
    alpha/r cannot be inferred). Any failure raises one CheckpointError naming the file and key.
    """
    path = Path(path)
    arrays, meta = read_adapter_file(path)
    arrays = _edge0_layout(arrays, path)
    kind = _check_kind(arrays, meta, expect_kind, path)
    pairs = _pairs(arrays, path)
    r_meta = _meta_number(meta, "r", path, integer=True)
    alpha_value = _alpha(meta, alpha, r_meta, path)
    r, file_dtype = _check_pairs(arrays, pairs, r_meta, path)
    return AdapterFile(
        path=path,
        pairs={m: (arrays[k["A"]], arrays[k["B"]]) for m, k in pairs.items()},
        kind=kind,
        format_version=meta.get("format_version"),
        r=r,
        alpha=alpha_value,
        K=_meta_number(meta, "K", path, integer=True),
        owners=_owners(meta, path),
        step=_meta_number(meta, "step", path, integer=True),
        file_dtype=file_dtype,
        metadata=meta,
    )


def _check_kind(arrays: dict, meta: dict, expect_kind: str, path: Path) -> str:
    """The file's kind (inferred from LoRA keys when absent), refused unless expected."""
    kind = meta.get("kind")
    all_lora = bool(arrays) and all(k.endswith((SUFFIX_A, SUFFIX_B)) for k in arrays)
    if kind is None and all_lora:
        kind = KIND
    if kind != expect_kind:
        hint = (
            "; it is a prerouter file: pass it as the prerouter path"
            if kind == "prerouter"
            else ""
        )
        raise CheckpointError(
            f"{path}: metadata key 'kind' is {kind!r}, expected {expect_kind!r}{hint}"
        )
    version = meta.get("format_version")
    if version not in (None, "") and str(version).split(".")[0] != FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: metadata key 'format_version' is {version!r}; this build "
            f"reads format version {FORMAT_VERSION}"
        )
    if not arrays:
        raise CheckpointError(
            f"{path}: holds no tensors; expected <module>.lora_A/.lora_B pairs"
        )
    return kind


def _pairs(arrays: dict, path: Path) -> dict[str, dict[str, str]]:
    """{module path: {"A": key, "B": key}}, every key in a complete pair."""
    pairs: dict[str, dict[str, str]] = {}
    for key in sorted(arrays, key=natural_key):
        if key.endswith(SUFFIX_A):
            pairs.setdefault(key[: -len(SUFFIX_A)], {})["A"] = key
        elif key.endswith(SUFFIX_B):
            pairs.setdefault(key[: -len(SUFFIX_B)], {})["B"] = key
        else:
            raise CheckpointError(
                f"{path}: key {key!r} is not <module>{SUFFIX_A} or "
                f"<module>{SUFFIX_B}; not a LoRA adapter"
            )
    for module_path, keys in pairs.items():
        for part, suffix in (("A", SUFFIX_A), ("B", SUFFIX_B)):
            if part not in keys:
                have = keys["B" if part == "A" else "A"]
                raise CheckpointError(
                    f"{path}: key {module_path + suffix!r} is missing "
                    f"(the file has {have!r}); the adapter is incomplete"
                )
    return pairs


def _alpha(meta: dict, alpha: float | None, r_meta: int | None, path: Path) -> float:
    """alpha from the argument, else the metadata, else adapter_config.json; checked."""
    alpha_value = (
        float(alpha) if alpha is not None else _meta_number(meta, "alpha", path)
    )
    if alpha_value is None:
        alpha_value = _alpha_from_adapter_config(path)
    if alpha_value is None:
        raise CheckpointError(
            f"{path}: metadata key 'alpha' is missing, no alpha was given "
            f"(--lora-alpha / lora_alpha) and no {ADAPTER_CONFIG} beside it gives one "
            "(PEFT 'lora_alpha', or mlx-lm 'lora_parameters' rank and scale); the LoRA "
            "scale alpha/r is unknown (Edge0 adapters use r=16, alpha=32)"
        )
    if r_meta is not None and r_meta < 1:
        raise CheckpointError(
            f"{path}: metadata key 'r' is {r_meta}; must be at least 1"
        )
    if not 0 < alpha_value <= MAX_ALPHA:
        raise CheckpointError(
            f"{path}: alpha {alpha_value:g} is outside (0, {MAX_ALPHA:g}]; the "
            f"LoRA scale alpha/r would swamp the base model (Edge0 adapters "
            f"use r=16, alpha=32)"
        )
    return alpha_value


def _check_pairs(
    arrays: dict, pairs: dict, r_meta: int | None, path: Path
) -> tuple[int, str]:
    """(rank, file dtype) after checking every pair's dtype, shape, rank and values."""
    ranks, file_dtypes = {}, set()
    for keys in pairs.values():
        key_a, key_b = keys["A"], keys["B"]
        for key in (key_a, key_b):
            _check_matrix(
                arrays[key], key, "[r, in]" if key == key_a else "[out, r]", path
            )
            file_dtypes.add(str(arrays[key].dtype).split(".")[-1])
        a = arrays[key_a]
        r = a.shape[0]
        if r < 1:
            raise CheckpointError(
                f"{path}: key {key_a!r} has shape {tuple(a.shape)}: rank 0"
            )
        if r_meta is not None and r != r_meta:
            raise CheckpointError(
                f"{path}: key {key_a!r} has rank {r} (shape {tuple(a.shape)}) "
                f"but metadata 'r' is {r_meta}"
            )
        ranks.setdefault(r, key_a)
    if len(file_dtypes) > 1:
        raise CheckpointError(
            f"{path}: tensors mix dtypes {sorted(file_dtypes)}; an adapter is "
            f"saved in one dtype, so the header is corrupt"
        )
    if len(ranks) > 1 and r_meta is None:
        (r1, k1), (r2, k2) = list(ranks.items())[:2]
        raise CheckpointError(
            f"{path}: metadata key 'r' is missing and ranks differ "
            f"({k1!r}: {r1}, {k2!r}: {r2})"
        )
    checked = [k for keys in pairs.values() for k in (keys["A"], keys["B"])]
    # one sync, not 2/module
    finite = mx.stack([mx.all(mx.isfinite(arrays[k])) for k in checked])
    for key, ok in zip(checked, finite.tolist()):
        if not ok:
            raise CheckpointError(
                f"{path}: key {key!r} holds NaN or infinite values; the "
                f"adapter is corrupt"
            )
    r = r_meta if r_meta is not None else next(iter(ranks))
    return r, ",".join(sorted(file_dtypes))


def _check_matrix(arr: mx.array, key: str, want: str, path: Path) -> None:
    if arr.dtype not in _FILE_DTYPES.values():
        raise CheckpointError(
            f"{path}: key {key!r} has dtype {str(arr.dtype).split('.')[-1]}; expected "
            "float16, bfloat16 or float32"
        )
    if arr.ndim != 2:
        raise CheckpointError(
            f"{path}: key {key!r} has shape {tuple(arr.shape)}; "
            f"expected a matrix ({want})"
        )


def _meta_number(
    meta: dict, key: str, where: Path, integer: bool = False
) -> float | int | None:
    """Metadata `key` as a finite number (`integer`: a whole one); None when absent."""
    if meta.get(key) in (None, ""):
        return None
    try:
        value = float(meta[key])
    except (TypeError, ValueError):
        value = math.nan
    if not math.isfinite(value) or (integer and value != int(value)):
        raise CheckpointError(
            f"{where}: metadata key {key!r} is {meta[key]!r}, not "
            f"{'an integer' if integer else 'a number'}; the adapter file is malformed"
        )
    return int(value) if integer else value


def _owners(meta: dict, path: Path) -> list[int] | None:
    owners = meta.get("owners")
    if not owners:
        return None
    try:
        owners = json.loads(owners)
        if not isinstance(owners, list) or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in owners
        ):
            raise ValueError
    except ValueError:
        raise CheckpointError(
            f"{path}: metadata key 'owners' is {owners!r}, not a JSON list"
        ) from None
    return owners or None


# -- published formats: PEFT, mlx-lm tuner -----------------------------------------------------


def _edge0_layout(arrays: dict[str, mx.array], path: Path) -> dict[str, mx.array]:
    """PEFT and mlx-lm tuner keys rewritten as `<module>.lora_A` [r, in] / `.lora_B` [out, r];
    files already in that layout (or in none) pass unchanged for read_adapter's checks."""
    keys = list(arrays)
    if any(k.endswith((_PEFT_A, _PEFT_B)) for k in keys):
        other = [k for k in keys if not k.endswith((_PEFT_A, _PEFT_B))]
        if other:
            raise CheckpointError(
                f"{path}: a PEFT adapter holding {other[0]!r} (DoRA "
                f"magnitudes, embedding LoRA or saved modules); only plain "
                f"LoRA on linear layers is served"
            )
        out = {}
        for k, v in arrays.items():
            k = k[len(PEFT_PREFIX) :] if k.startswith(PEFT_PREFIX) else k
            out[k[: -len(".weight")]] = v
        return out
    if any(k.endswith((_MLX_A, _MLX_B)) for k in keys):
        out = {}
        for k, v in arrays.items():
            if not k.endswith((_MLX_A, _MLX_B)):
                raise CheckpointError(
                    f"{path}: an mlx-lm adapter holding {k!r} (a DoRA magnitude or a "
                    "full fine-tune); only plain LoRA adapters are served"
                )
            if v.ndim != 2:
                raise CheckpointError(
                    f"{path}: key {k!r} has shape {tuple(v.shape)}: LoRA on "
                    f"routed experts (mlx-lm's LoRASwitchLinear) is not "
                    f"served; the streamed experts stay as converted"
                )
            # mlx-lm computes (x @ lora_a) @ lora_b: ours are the transposes, copied once so
            # every decode step's matmul reads a contiguous matrix, not a strided view.
            suffix = SUFFIX_A if k.endswith(_MLX_A) else SUFFIX_B
            out[k[: -len(_MLX_A)] + suffix] = mx.contiguous(v.T)
        return out
    return arrays


def _alpha_from_adapter_config(path: Path) -> float | None:
    """alpha from the adapter_config.json beside an adapter file, as the trainers write it:
    PEFT's `lora_alpha` (scale alpha/r, or alpha/sqrt(r) with use_rslora), or mlx-lm's
    `lora_parameters` {rank, scale} (scale applied as is, so alpha = scale x rank). None when
    there is no such file. Adapter kinds that are not plain LoRA are refused here."""
    config_path = path.parent / ADAPTER_CONFIG
    if not config_path.exists():
        return None
    config = read_json_file(
        config_path,
        ADAPTER_CONFIG,
        "copy it again beside the adapter "
        "(or give the adapter an 'alpha' metadata key)",
    )
    _refuse_unsupported_config(config, config_path)
    lora = config.get("lora_parameters")
    if "lora_alpha" in config:
        value = config["lora_alpha"]
        if config.get("use_rslora") and type_ok(value, float):
            if not type_ok(config.get("r"), float) or config["r"] < 1:
                raise CheckpointError(f"{config_path}: use_rslora needs the rank 'r'")
            value = value * math.sqrt(config["r"])  # rsLoRA's scale alpha/sqrt(r)
    elif isinstance(lora, dict) and "scale" in lora and "rank" in lora:
        value = (
            lora["scale"] * lora["rank"]
            if all(type_ok(v, float) for v in (lora["scale"], lora["rank"]))
            else None
        )
    else:
        return None
    if not type_ok(value, float):
        raise CheckpointError(
            f"{config_path}: the LoRA alpha it gives is {value!r}; it must be "
            f"a positive number"
        )
    return float(value)


def _refuse_unsupported_config(config: dict, config_path: Path) -> None:
    """Adapter kinds whose numerics are not LoRA's (DoRA, full fine-tunes, per-module ranks)."""
    kind = config.get("fine_tune_type", "lora")
    peft = config.get("peft_type", "LORA")
    if kind != "lora" or peft != "LORA" or config.get("use_dora"):
        what = kind if kind != "lora" else ("DoRA" if config.get("use_dora") else peft)
        raise CheckpointError(
            f"{config_path}: a {what!r} adapter; only plain LoRA adapters are served "
            "(merge it into the checkpoint with its trainer, then convert that)"
        )
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise CheckpointError(
                f"{config_path}: PEFT {key} gives modules their own rank or "
                f"alpha; one adapter file is served at one r and alpha"
            )


# -- writing -------------------------------------------------------------------------------------


def write_adapter(
    path: str | Path,
    pairs: dict[str, tuple[mx.array, mx.array]],
    *,
    r: int,
    alpha: float,
    metadata: dict | None = None,
    dtype: str = "float16",
    model_type: str | None = None,
) -> Path:
    """Write (lora_A, lora_B) per module path as `<path>.lora_A/.lora_B` safetensors, atomically.

    dtype: "float16" (the published layout), "bfloat16" or "float32". Metadata is written as
    strings: kind, format_version, r, alpha plus `metadata` (e.g. source, model, K, stage, step;
    lists/dicts as JSON); `model` defaults to `model_type`. Returns the path.
    """
    if dtype not in _FILE_DTYPES:
        raise ConfigError(
            f"dtype must be one of {', '.join(_FILE_DTYPES)}, not {dtype!r}"
        )
    out = {
        "kind": KIND,
        "format_version": FORMAT_VERSION,
        "r": str(r),
        "alpha": _meta_str(alpha),
    }
    given = {k: v for k, v in (metadata or {}).items() if v is not None}
    for key, value in given.items():
        if key in ("r", "alpha") and float(value) != float(out[key]):
            raise ConfigError(
                f"metadata {key}={value!r} contradicts the layers' {key}={out[key]}"
            )
        if key in ("kind", "format_version") and str(value) != out[key]:
            raise ConfigError(
                f"metadata {key}={value!r}: save_adapter writes {key}={out[key]!r}"
            )
        if key not in out:
            out[key] = _meta_str(value)
    if "model" not in out and model_type:
        out["model"] = model_type

    target = _FILE_DTYPES[dtype]
    arrays = {}
    for module_path, (lora_a, lora_b) in pairs.items():
        for suffix, value in ((SUFFIX_A, lora_a), (SUFFIX_B, lora_b)):
            key = module_path + suffix
            if not mx.all(mx.isfinite(value)).item():
                raise ConfigError(f"{key} holds NaN or infinite values; not saving")
            if dtype == "float16" and mx.abs(value).max().item() > _FP16_MAX:
                raise ConfigError(
                    f"{key} exceeds the float16 range; save with dtype='float32'"
                )
            arrays[key] = value.astype(target)
    return write_safetensors(path, arrays, out)


def _meta_str(value) -> str:
    if isinstance(value, (list, tuple, dict)):
        return json.dumps(list(value) if isinstance(value, tuple) else value)
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)
