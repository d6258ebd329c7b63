"""Validation at the boundary where each model file is read, before any of it is used.

One function per input format: `read_json_file`, `read_config` (config.json against mlx-lm's own
ModelArgs), `read_safetensors_header` (8-byte length + JSON, checked the way the format defines
it), `check_resident` (resident weights against the model and the expert index) and
`load_tokenizer_checked`. Each failure is one CheckpointError/ConfigError naming the file, the
field and the fix; nothing half-read reaches MLX.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import os
import typing
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.utils import _get_classes, load_tokenizer

from edge0_eval.engine.families import family_for
from edge0_eval.engine.json_files import json_name, no_constant, read_json_file
from edge0_eval.engine.layout import INDEX_NAME, RESIDENT_NAME, ExpertIndex
from edge0_eval.errors import CheckpointError

# safetensors dtype codes -> bytes per element (the format's full list).
ST_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2,
               "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "F64": 8, "I64": 8, "U64": 8}
ST_FLOAT = {"F16": "float16", "BF16": "bfloat16", "F32": "float32"}
# A header larger than this is not a weights header (safetensors itself caps it at 100 MB).
_MAX_HEADER = 100 * 2**20
_RECONVERT = "re-run `edge0-eval convert`"


# -- config.json ------------------------------------------------------------------------------

def _type_ok(value, hint) -> bool:
    origin = typing.get_origin(hint)
    if hint is typing.Any:
        return True
    if origin is typing.Union:
        return any(_type_ok(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) \
            and math.isfinite(value)
    if hint is str:
        return isinstance(value, str)
    if hint is dict or origin is dict:
        return isinstance(value, dict)
    if hint is list or origin is list:
        return isinstance(value, list)
    return True  # types we cannot judge are left to mlx-lm


def _check_args(args_class, params: dict, path: Path, prefix: str = "") -> None:
    """`params` against an mlx-lm ModelArgs dataclass: required fields present, types right."""
    try:
        hints = typing.get_type_hints(args_class)
    except Exception:  # unresolvable annotations: only presence can be checked
        hints = {}
    for f in dataclasses.fields(args_class):
        key = prefix + f.name
        # mlx-lm gives some fields a None default without Optional: they must be in the file.
        hint = hints.get(f.name)
        required = (f.default is dataclasses.MISSING and
                    f.default_factory is dataclasses.MISSING) or \
            (f.default is None and hint is not None and not _type_ok(None, hint))
        if f.name not in params:
            if required:
                raise CheckpointError(f"{path}: required key {key!r} is missing; restore "
                                      f"config.json from the source checkpoint and "
                                      f"{_RECONVERT}")
            continue
        value = params[f.name]
        if hint is not None and not _type_ok(value, hint):
            raise CheckpointError(f"{path}: key {key!r} is {value!r}, which is not a valid "
                                  f"{getattr(hint, '__name__', hint)}; fix config.json or "
                                  f"{_RECONVERT}")
        if hint is int and f.name not in ("bos_token_id", "pad_token_id") and value < 0:
            raise CheckpointError(f"{path}: key {key!r} is {value}; it must not be negative")


REQUIRED_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
                 "num_experts", "num_experts_per_tok", "moe_intermediate_size")


def read_config(path: str | Path) -> dict:
    """config.json of a converted model, checked against mlx-lm's ModelArgs for its family."""
    path = Path(path)
    fix = "is the directory a converted model? restore config.json or " + _RECONVERT
    config = read_json_file(path, "config.json", fix)
    model_type = config.get("model_type")
    if not isinstance(model_type, str):
        raise CheckpointError(f"{path}: key 'model_type' is {model_type!r}; it must be a model "
                              f"type string such as 'qwen3_5_moe'")
    family = family_for(config, str(path))
    try:
        model_class, args_class = _get_classes(config)
    except Exception as exc:
        raise CheckpointError(f"{path}: model_type {model_type!r} is not supported by mlx-lm "
                              f"({exc})") from None
    _check_args(args_class, config, path)
    text = config.get("text_config")
    if isinstance(text, dict):
        text_args = None     # in the model class's module, or a base class's
        for cls in model_class.__mro__:
            text_args = text_args or getattr(importlib.import_module(cls.__module__),
                                             "TextModelArgs", None)
        if text_args is not None:
            _check_args(text_args, text, path, "text_config.")
    # mlx-lm defaults these to some other model's sizes when absent; the engine needs them.
    text_config = family.text_config(config)
    where = "text_config." if text_config is not config else ""
    for key in REQUIRED_KEYS:
        if key not in text_config:
            raise CheckpointError(f"{path}: required key {where + key!r} is missing; restore "
                                  f"config.json from the source checkpoint and {_RECONVERT}")
    for key in ("num_experts", "num_experts_per_tok"):    # mlx-lm accepts 0; routing cannot
        if not (_type_ok(text_config[key], int) and text_config[key] >= 1):
            raise CheckpointError(f"{path}: key {where + key!r} is {text_config[key]!r}; it must "
                                  f"be at least 1; restore config.json from the source checkpoint")
    if text_config["num_experts_per_tok"] > text_config["num_experts"]:
        raise CheckpointError(f"{path}: key {where + 'num_experts_per_tok'!r} is "
                              f"{text_config['num_experts_per_tok']}, more than the "
                              f"{text_config['num_experts']} experts; restore config.json from "
                              f"the source checkpoint")
    quant = config.get("quantization")
    if quant is not None:
        _check_quantization(quant, path)
    eos = config.get("eos_token_id")
    if eos is not None and not _is_eos(eos):
        raise CheckpointError(f"{path}: key 'eos_token_id' is {eos!r}; it must be a token id or a "
                              f"list of token ids")
    return config


def _check_quantization(quant, path: Path) -> None:
    if not isinstance(quant, dict):
        raise CheckpointError(f"{path}: key 'quantization' is {quant!r}, not an object")
    items = [("quantization", quant)] + [(f"quantization.{k}", v) for k, v in quant.items()
                                         if isinstance(v, dict)]
    for where, q in items:
        for key in ("bits", "group_size"):
            if key in q and not (_type_ok(q[key], int) and q[key] > 0):
                raise CheckpointError(f"{path}: key '{where}.{key}' is {q[key]!r}; it must be a "
                                      f"positive integer")
    for key in ("bits", "group_size"):
        if key not in quant:
            raise CheckpointError(f"{path}: key 'quantization.{key}' is missing; {_RECONVERT}")
    if not isinstance(quant.get("mode", "affine"), str):
        raise CheckpointError(f"{path}: key 'quantization.mode' is {quant['mode']!r}, not a string")


# -- safetensors files -------------------------------------------------------------------------

def write_safetensors(path: str | Path, arrays: dict, metadata: dict) -> Path:
    """Write a safetensors file atomically (a reader never sees half of one); the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp.safetensors")
    try:
        mx.save_safetensors(str(tmp), arrays, metadata=metadata)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def read_safetensors_header(path: str | Path, what: str, fix: str
                            ) -> tuple[dict[str, tuple[str, list[int], int, int]], dict[str, str]]:
    """({name: (dtype code, shape, begin, end)}, metadata) of a safetensors file.

    Checks what the format defines: the 8-byte little-endian header length within the file, a
    UTF-8 JSON object, `__metadata__` a string->string object, each tensor's dtype a format code,
    shape a list of non-negative integers, data_offsets consistent with dtype x shape, tensors
    contiguous without overlap and ending exactly at the file's end.
    """
    path = Path(path)
    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"{path}: {what} is truncated or corrupt, not a valid "
                               f"safetensors file ({why}); {fix}")
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise bad("shorter than the 8-byte header length")
            n = int.from_bytes(head, "little")
            if n < 2 or n > size - 8 or n > _MAX_HEADER:
                raise bad(f"header length {n} does not fit the file's {size} bytes (truncated?)")
            raw = f.read(n)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: {what} not found; {fix}") from None
    except IsADirectoryError:
        raise CheckpointError(f"{path}: {what} is a directory, not a file; {fix}") from None
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read {what} ({exc.strerror}); {fix}") from None
    try:
        header = json.loads(raw.decode("utf-8").rstrip(" "), parse_constant=no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise bad(f"header is not UTF-8 JSON: {exc}") from None
    if not isinstance(header, dict):
        raise bad(f"header is a JSON {json_name(type(header))}, not an object")
    meta = header.pop("__metadata__", None)
    if meta is None:
        meta = {}
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                             for k, v in meta.items()):
        raise bad("__metadata__ must be an object of string values")
    tensors, spans = {}, []
    for name, info in header.items():
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise bad(f"tensor {name!r} entry must hold exactly dtype, shape, data_offsets")
        code, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if code not in ST_ITEMSIZE:
            raise bad(f"tensor {name!r} has dtype {code!r}, not a safetensors dtype")
        if not isinstance(shape, list) or not all(_type_ok(d, int) and d >= 0 for d in shape):
            raise bad(f"tensor {name!r} has shape {shape!r}, not a list of sizes")
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(_type_ok(o, int) and o >= 0 for o in offsets)):
            raise bad(f"tensor {name!r} has data_offsets {offsets!r}, not [begin, end]")
        begin, end = offsets
        numel = math.prod(shape)
        if end - begin != numel * ST_ITEMSIZE[code]:
            raise bad(f"tensor {name!r}: data_offsets {begin}..{end} do not hold {code} {shape}")
        tensors[name] = (code, list(shape), begin, end)
        spans.append((begin, end, name))
    pos = 0
    for begin, end, name in sorted(spans):
        if begin != pos:
            raise bad(f"tensor {name!r} starts at {begin}, expected {pos} "
                      f"({'overlap' if begin < pos else 'gap'})")
        pos = end
    if 8 + n + pos != size:
        raise bad(f"tensors end at byte {8 + n + pos} but the file has {size} bytes")
    return tensors, dict(meta)


# -- resident weights --------------------------------------------------------------------------

def check_resident(path: str | Path, index=None) -> dict:
    """The resident safetensors header, checked before MLX reads any of it.

    Quantized modules are complete (weight U32 + scales + biases), every floating tensor is
    float32 or the one half dtype the quantized scales use, and that dtype is the one the expert
    index records for its scales (a lie in either file shows as a disagreement).
    Returns the parsed tensors.
    """
    path = Path(path)
    tensors, _ = read_safetensors_header(path, "resident weights", _RECONVERT)
    if not tensors:
        raise CheckpointError(f"{path}: holds no tensors; {_RECONVERT}")
    scale_codes, halves = {}, {}
    for name, (code, _, _, _) in tensors.items():
        if code not in ST_FLOAT and code != "U32":
            raise CheckpointError(f"{path}: tensor {name!r} has dtype {code}; resident weights "
                                  f"are F16/BF16/F32 or packed U32; {_RECONVERT}")
        if code in ("F16", "BF16"):
            halves.setdefault(code, name)
        if name.endswith(".scales"):
            base = name[: -len(".scales")]
            for part in ("weight", "biases"):
                if f"{base}.{part}" not in tensors:
                    raise CheckpointError(f"{path}: quantized module {base!r} has scales but no "
                                          f"{part!r}; the file is incomplete, {_RECONVERT}")
            if tensors[f"{base}.weight"][0] != "U32":
                raise CheckpointError(f"{path}: {base}.weight is {tensors[f'{base}.weight'][0]}"
                                      f", but a quantized weight is packed U32; {_RECONVERT}")
            scale_codes.setdefault(code, name)
        elif code == "U32":
            if not name.endswith(".weight") or \
                    f"{name[:-len('.weight')]}.scales" not in tensors:
                raise CheckpointError(f"{path}: {name} is packed U32 but has no "
                                      f"quantization scales beside it; {_RECONVERT}")
    if len(halves) > 1:
        raise CheckpointError(f"{path}: mixes half dtypes ({halves.get('F16')!r} is F16, "
                              f"{halves.get('BF16')!r} is BF16); a converted model uses one, so "
                              f"the header is corrupt; {_RECONVERT}")
    if index is not None and scale_codes:
        half = ST_FLOAT[next(iter(scale_codes))]
        for spec in index.tensors:
            if spec.name.endswith((".scales", ".biases")) and spec.dtype != half:
                raise CheckpointError(
                    f"{path}: resident scales are {half} but experts.index.json says "
                    f"{spec.name} is {spec.dtype}; one of the two files is wrong, {_RECONVERT}")
    return tensors


# -- tokenizer ---------------------------------------------------------------------------------

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def _is_eos(eos) -> bool:
    return _type_ok(eos, int) or (isinstance(eos, list) and bool(eos)
                                  and all(_type_ok(e, int) for e in eos))


def eos_token_ids(directory: str | Path, config: dict) -> list[int] | None:
    """Stop ids as mlx-lm's `load_config` resolves them, so both arms stop alike: the
    `eos_token_id` of generation_config.json, when set, over config.json's (the tokenizer's own
    eos is added by mlx-lm's TokenizerWrapper in both)."""
    eos = config.get("eos_token_id")
    path = Path(directory) / "generation_config.json"
    if path.exists():
        generation = read_json_file(path, "generation_config.json",
                                    "copy it again from the source checkpoint")
        if generation.get("eos_token_id"):
            eos = generation["eos_token_id"]
            if not _is_eos(eos):
                raise CheckpointError(f"{path}: key 'eos_token_id' is {eos!r}; it must be a "
                                      f"token id or a list of token ids")
    return [eos] if isinstance(eos, int) else eos


def load_tokenizer_checked(directory: str | Path, eos_token_ids=None, vocab_size=None):
    """mlx-lm's tokenizer for `directory`, refusing the silent fallbacks.

    Without a tokenizer file transformers builds an almost empty tokenizer (2 tokens) and the
    model then writes empty text; corrupt files or a chat template that does not compile surface
    later as tracebacks. Both are one error here.
    """
    directory = Path(directory)
    _check_tokenizer_files(directory)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (directory / name).is_file():
            read_json_file(directory / name, name, "copy it again from the source checkpoint")
    try:
        tokenizer = load_tokenizer(directory, eos_token_ids=eos_token_ids)
    except Exception as exc:  # transformers/tokenizers raise many types for corrupt files
        raise CheckpointError(f"{directory}: the tokenizer files do not load ({type(exc).__name__}"
                              f": {str(exc)[:200]}); copy them again from the source "
                              f"checkpoint") from None
    n = len(tokenizer._tokenizer) if hasattr(tokenizer, "_tokenizer") else None
    if n is not None and n < 8:
        raise CheckpointError(f"{directory}: the tokenizer has only {n} tokens; its files are "
                              f"incomplete, copy them again from the source checkpoint")
    if n is not None and vocab_size is not None and n > vocab_size + 1024:
        raise CheckpointError(f"{directory}: the tokenizer has {n} tokens but the model's "
                              f"vocab_size is {vocab_size}; the tokenizer belongs to another model")
    if getattr(tokenizer, "chat_template", None):
        try:
            tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                          add_generation_prompt=True, tokenize=False)
        except Exception as exc:
            raise CheckpointError(f"{directory}: the chat template does not render "
                                  f"({type(exc).__name__}: {str(exc)[:200]}); fix "
                                  f"tokenizer_config.json / chat_template.jinja or copy them "
                                  f"again from the source checkpoint") from None
    return tokenizer


def check_index_model(index, config: dict, family, directory: str | Path) -> None:
    """The expert index's bundle shapes against the model config.json describes."""
    text = family.text_config(config)
    where = Path(directory) / "experts.index.json"
    gate = index.tensor("gate_proj.weight")
    hidden = gate.shape[1] * 32 // index.bits
    want = {"hidden_size": hidden, "moe_intermediate_size": gate.shape[0]}
    for key, got in want.items():
        value = text.get(key)
        if isinstance(value, int) and value != got:
            raise CheckpointError(f"{where}: expert bundles imply {key}={got} but config.json says "
                                  f"{value}; the index belongs to another model, {_RECONVERT}")
    n_layers = text.get("num_hidden_layers")
    if isinstance(n_layers, int) and max(index.moe_layers) >= n_layers:
        raise CheckpointError(f"{where}: moe_layers {index.moe_layers} go past the model's "
                              f"{n_layers} layers; {_RECONVERT}")
    if index.module_path != f"{family.module_path}.switch_mlp":
        raise CheckpointError(f"{where}: module_path {index.module_path!r} is not "
                              f"{family.module_path + '.switch_mlp'!r} of a {family.name} model; "
                              f"{_RECONVERT}")


def open_model_dir(directory: str | Path) -> tuple[dict, object, ExpertIndex]:
    """config.json, its family and the expert index of a converted model, checked against each
    other (model type, expert count, bundle shapes, MoE block path): (config, family, index)."""
    directory = Path(directory)
    config = read_config(directory / "config.json")
    family = family_for(config, str(directory / "config.json"))
    index = ExpertIndex.load(directory)
    if index.model_type != config["model_type"]:
        raise CheckpointError(f"{directory / INDEX_NAME}: index is for {index.model_type!r} but "
                              f"config.json says {config['model_type']!r}; {_RECONVERT}")
    num_experts = family.num_experts(config)
    if index.num_experts != num_experts:
        raise CheckpointError(f"{directory / INDEX_NAME}: index has {index.num_experts} experts, "
                              f"config.json {num_experts}; {_RECONVERT}")
    check_index_model(index, config, family, directory)
    return config, family, index


def check_model_dir(directory: str | Path, verify_crc: bool = True) -> None:
    """What Engine.load checks before reading weights, without loading any (a preflight).

    config.json, the expert index against the expert file's size and the config, CRCs present
    (unless opted out), the resident header against the index, and a tokenizer file.
    """
    directory = Path(directory)
    config, family, index = open_model_dir(directory)
    if verify_crc and not index.crc32:
        raise CheckpointError(f"{directory / INDEX_NAME} records no crc32 checksums; "
                              f"{_RECONVERT}, or opt out with verify_crc=False")
    check_resident(directory / RESIDENT_NAME, index)
    _check_tokenizer_files(directory)


def _check_tokenizer_files(directory: Path) -> None:
    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        raise CheckpointError(f"{directory}: no tokenizer ({' / '.join(TOKENIZER_FILES)}); copy "
                              f"the source checkpoint's tokenizer files into it or "
                              f"{_RECONVERT}")


def load_resident(path: Path) -> dict:
    """resident.safetensors, lazily; one CheckpointError when it is missing or unreadable."""
    if not path.is_file():
        raise CheckpointError(f"{path} not found; re-run `edge0-eval convert`")
    try:
        return mx.load(str(path))
    except Exception as exc:  # MLX raises RuntimeError/ValueError for truncated headers or data
        raise CheckpointError(f"{path} is unreadable ({exc}); the file is truncated or corrupt, "
                              f"re-run `edge0-eval convert`") from None


def check_resident_names(model, weights: dict, path: Path) -> None:
    """The resident weights are exactly the model's non-expert parameters, with their shapes."""
    expected = {k for k, _ in tree_flatten(model.parameters()) if ".switch_mlp.glu." not in k}
    missing, unexpected = sorted(expected - set(weights)), sorted(set(weights) - expected)
    if missing or unexpected:
        raise CheckpointError(
            f"{path} does not match the model built from config.json: "
            f"{len(missing)} missing (e.g. {missing[:3]}), {len(unexpected)} unexpected "
            f"(e.g. {unexpected[:3]}); re-run convert"
        )
    params = dict(tree_flatten(model.parameters()))
    for name, value in weights.items():
        if params[name].shape != value.shape:
            raise CheckpointError(f"{path}: {name} has shape {value.shape}, the model expects "
                                  f"{params[name].shape}; re-run convert")
