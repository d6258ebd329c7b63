"""config.json of a converted model, checked against mlx-lm's own ModelArgs for its model type
(required keys present, types right) and the keys the engine needs; generation_config.json's stop
ids. The model family (the registry's entry for `model_type`) is passed in: this layer knows the
files, the engine knows the families."""

from __future__ import annotations

import dataclasses
import importlib
import typing
from pathlib import Path
from typing import Callable, Protocol

from mlx_lm.utils import _get_classes

from edge0_eval.errors import CheckpointError
from edge0_eval.formats.json_files import read_json_file, type_ok
from edge0_eval.formats.layout import RECONVERT


class ModelFamily(Protocol):
    """What a model family (engine/families/) tells the file checks about its model type."""

    name: str
    module_path: str  # a layer's MoE block path, with {layer}

    def text_config(self, config: dict) -> dict: ...

    def num_experts(self, config: dict) -> int: ...


# (config, where) -> the family of config's model_type; raises CheckpointError when unsupported.
FamilyLookup = Callable[[dict, str], ModelFamily]


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
        required = (
            f.default is dataclasses.MISSING
            and f.default_factory is dataclasses.MISSING
        ) or (f.default is None and hint is not None and not type_ok(None, hint))
        if f.name not in params:
            if required:
                raise CheckpointError(
                    f"{path}: required key {key!r} is missing; restore config.json "
                    f"from the source checkpoint and {RECONVERT}"
                )
            continue
        value = params[f.name]
        if hint is not None and not type_ok(value, hint):
            raise CheckpointError(
                f"{path}: key {key!r} is {value!r}, which is not a valid "
                f"{getattr(hint, '__name__', hint)}; fix config.json or {RECONVERT}"
            )
        if hint is int and f.name not in ("bos_token_id", "pad_token_id") and value < 0:
            raise CheckpointError(
                f"{path}: key {key!r} is {value}; it must not be negative"
            )


REQUIRED_KEYS = (
    "hidden_size num_hidden_layers num_attention_heads vocab_size num_experts "
    "num_experts_per_tok moe_intermediate_size"
).split()


def read_config(path: str | Path, family_for: FamilyLookup) -> dict:
    """config.json of a converted model, checked against mlx-lm's ModelArgs for its family."""
    path = Path(path)
    fix = "is the directory a converted model? restore config.json or " + RECONVERT
    config = read_json_file(path, "config.json", fix)
    model_type = config.get("model_type")
    if not isinstance(model_type, str):
        raise CheckpointError(
            f"{path}: key 'model_type' is {model_type!r}; it must be a model "
            f"type string such as 'qwen3_5_moe'"
        )
    family = family_for(config, str(path))
    try:
        model_class, args_class = _get_classes(config)
    except Exception as exc:
        raise CheckpointError(
            f"{path}: model_type {model_type!r} is not supported by mlx-lm ({exc})"
        ) from None
    _check_args(args_class, config, path)
    text = config.get("text_config")
    if isinstance(text, dict):
        text_args = None  # in the model class's module, or a base class's
        for cls in model_class.__mro__:
            text_args = text_args or getattr(
                importlib.import_module(cls.__module__), "TextModelArgs", None
            )
        if text_args is not None:
            _check_args(text_args, text, path, "text_config.")
    # mlx-lm defaults these to some other model's sizes when absent; the engine needs them.
    text_config = family.text_config(config)
    where = "text_config." if text_config is not config else ""
    for key in REQUIRED_KEYS:
        if key not in text_config:
            raise CheckpointError(
                f"{path}: required key {where + key!r} is missing; restore "
                f"config.json from the source checkpoint and {RECONVERT}"
            )
    # mlx-lm accepts 0; routing cannot
    for key in ("num_experts", "num_experts_per_tok"):
        if not (type_ok(text_config[key], int) and text_config[key] >= 1):
            raise CheckpointError(
                f"{path}: key {where + key!r} is {text_config[key]!r}; it must "
                f"be at least 1; restore config.json from the source checkpoint"
            )
    if text_config["num_experts_per_tok"] > text_config["num_experts"]:
        raise CheckpointError(
            f"{path}: key {where + 'num_experts_per_tok'!r} is "
            f"{text_config['num_experts_per_tok']}, more than the "
            f"{text_config['num_experts']} experts; restore config.json from "
            f"the source checkpoint"
        )
    quant = config.get("quantization")
    if quant is not None:
        _check_quantization(quant, path)
    eos = config.get("eos_token_id")
    if eos is not None and not _is_eos(eos):
        raise CheckpointError(
            f"{path}: key 'eos_token_id' is {eos!r}; it must be a token id or a "
            f"list of token ids"
        )
    return config


def _check_quantization(quant, path: Path) -> None:
    if not isinstance(quant, dict):
        raise CheckpointError(f"{path}: key 'quantization' is {quant!r}, not an object")
    items = [("quantization", quant)] + [
        (f"quantization.{k}", v) for k, v in quant.items() if isinstance(v, dict)
    ]
    for where, q in items:
        for key in ("bits", "group_size"):
            # null in a module's entry: the mode's default (mlx-lm's mixed_* recipes write
            # it when no group size is given, and its loader takes it so)
            if key in q and not (
                (type_ok(q[key], int) and q[key] > 0)
                or (q[key] is None and q is not quant)
            ):
                raise CheckpointError(
                    f"{path}: key '{where}.{key}' is {q[key]!r}; it must be a "
                    f"positive integer"
                )
    for key in ("bits", "group_size"):
        if key not in quant:
            raise CheckpointError(
                f"{path}: key 'quantization.{key}' is missing; {RECONVERT}"
            )
    if not isinstance(quant.get("mode", "affine"), str):
        raise CheckpointError(
            f"{path}: key 'quantization.mode' is {quant['mode']!r}, not a string"
        )


def _is_eos(eos) -> bool:
    return type_ok(eos, int) or (
        isinstance(eos, list) and bool(eos) and all(type_ok(e, int) for e in eos)
    )


def eos_token_ids(directory: str | Path, config: dict) -> list[int] | None:
    """Stop ids as mlx-lm's `load_config` resolves them, so both arms stop alike: the
    `eos_token_id` of generation_config.json, when set, over config.json's (the tokenizer's own
    eos is added by mlx-lm's TokenizerWrapper in both)."""
    eos = config.get("eos_token_id")
    path = Path(directory) / "generation_config.json"
    if path.exists():
        generation = read_json_file(
            path, "generation_config.json", "copy it again from the source checkpoint"
        )
        if generation.get("eos_token_id"):
            eos = generation["eos_token_id"]
            if not _is_eos(eos):
                raise CheckpointError(
                    f"{path}: key 'eos_token_id' is {eos!r}; it must be a "
                    f"token id or a list of token ids"
                )
    return [eos] if isinstance(eos, int) else eos
