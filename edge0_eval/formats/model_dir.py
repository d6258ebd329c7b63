"""A converted model directory as a whole: resident.safetensors (its header against the expert
index, its names against the model), the tokenizer files, and the files checked against each
other before a weight is read (`open_model_dir`; `check_model_dir` is the same as a preflight).
The family registry's lookup is passed in (config.py)."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.utils import load_tokenizer

from edge0_eval.errors import CheckpointError
from edge0_eval.formats.config import FamilyLookup, ModelFamily, read_config
from edge0_eval.formats.json_files import read_json_file
from edge0_eval.formats.layout import INDEX_NAME, RECONVERT, RESIDENT_NAME, ExpertIndex
from edge0_eval.formats.safetensors import ST_FLOAT, read_safetensors_header

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


# -- the directory -----------------------------------------------------------------------------


def open_model_dir(
    directory: str | Path, family_for: FamilyLookup
) -> tuple[dict, ModelFamily, ExpertIndex]:
    """config.json, its family and the expert index of a converted model, checked against each
    other (model type, expert count, bundle shapes, MoE block path): (config, family, index)."""
    directory = Path(directory)
    config = read_config(directory / "config.json", family_for)
    family = family_for(config, str(directory / "config.json"))
    index = ExpertIndex.load(directory)
    if index.model_type != config["model_type"]:
        raise CheckpointError(
            f"{directory / INDEX_NAME}: index is for {index.model_type!r} but "
            f"config.json says {config['model_type']!r}; {RECONVERT}"
        )
    num_experts = family.num_experts(config)
    if index.num_experts != num_experts:
        raise CheckpointError(
            f"{directory / INDEX_NAME}: index has {index.num_experts} experts, "
            f"config.json {num_experts}; {RECONVERT}"
        )
    check_index_model(index, config, family, directory)
    return config, family, index


def check_model_dir(
    directory: str | Path, family_for: FamilyLookup, verify_crc: bool = True
) -> None:
    """What Engine.load checks before reading weights, without loading any (a preflight).

    config.json, the expert index against the expert file's size and the config, CRCs present
    (unless opted out), the resident header against the index, and a tokenizer file.
    """
    directory = Path(directory)
    config, family, index = open_model_dir(directory, family_for)
    if verify_crc and not index.crc32:
        raise CheckpointError(
            f"{directory / INDEX_NAME} records no crc32 checksums; "
            f"{RECONVERT}, or opt out with verify_crc=False"
        )
    check_resident(directory / RESIDENT_NAME, index)
    _check_tokenizer_files(directory)


def check_index_model(
    index: ExpertIndex, config: dict, family: ModelFamily, directory: str | Path
) -> None:
    """The expert index's bundle shapes against the model config.json describes."""
    text = family.text_config(config)
    where = Path(directory) / INDEX_NAME
    inter, hidden = index.layouts[0].dims("gate_proj")  # validate: one shape for all
    want = {"hidden_size": hidden, "moe_intermediate_size": inter}
    for key, got in want.items():
        value = text.get(key)
        if isinstance(value, int) and value != got:
            raise CheckpointError(
                f"{where}: expert bundles imply {key}={got} but config.json says "
                f"{value}; the index belongs to another model, {RECONVERT}"
            )
    n_layers = text.get("num_hidden_layers")
    if isinstance(n_layers, int) and max(index.moe_layers) >= n_layers:
        raise CheckpointError(
            f"{where}: moe_layers {index.moe_layers} go past the model's "
            f"{n_layers} layers; {RECONVERT}"
        )
    if index.module_path != f"{family.module_path}.switch_mlp":
        raise CheckpointError(
            f"{where}: module_path {index.module_path!r} is not "
            f"{family.module_path + '.switch_mlp'!r} of a {family.name} model; "
            f"{RECONVERT}"
        )


# -- resident weights --------------------------------------------------------------------------


def check_resident(path: str | Path, index=None) -> dict:
    """The resident safetensors header, checked before MLX reads any of it.

    Quantized modules are complete (weight U32 + scales, and biases beside float scales: an
    affine module; U8 scales have none: mxfp4, mxfp8, nvfp4), every floating tensor is float32
    or the one half dtype the quantized scales use, and that dtype is the one the expert index
    records for its affine scales (a lie in either file shows as a disagreement).
    Returns the parsed tensors.
    """
    path = Path(path)
    tensors, _ = read_safetensors_header(path, "resident weights", RECONVERT)
    if not tensors:
        raise CheckpointError(f"{path}: holds no tensors; {RECONVERT}")
    scale_codes, halves = {}, {}
    for name, (code, _, _, _) in tensors.items():
        scales = name.endswith(".scales")
        if code not in ST_FLOAT and code != "U32" and not (scales and code == "U8"):
            raise CheckpointError(
                f"{path}: tensor {name!r} has dtype {code}; resident weights "
                f"are F16/BF16/F32, packed U32 or U8 quantization scales; {RECONVERT}"
            )
        if code in ("F16", "BF16"):
            halves.setdefault(code, name)
        if scales:
            base = name[: -len(".scales")]
            # Float scales are affine's and come with biases; U8 ones have none.
            for part in ("weight", "biases") if code != "U8" else ("weight",):
                if f"{base}.{part}" not in tensors:
                    raise CheckpointError(
                        f"{path}: quantized module {base!r} has scales but no "
                        f"{part!r}; the file is incomplete, {RECONVERT}"
                    )
            if tensors[f"{base}.weight"][0] != "U32":
                raise CheckpointError(
                    f"{path}: {base}.weight is {tensors[f'{base}.weight'][0]}"
                    f", but a quantized weight is packed U32; {RECONVERT}"
                )
            if code != "U8":
                scale_codes.setdefault(code, name)
        elif code == "U32":
            base = name.removesuffix(".weight")
            if base == name or f"{base}.scales" not in tensors:
                raise CheckpointError(
                    f"{path}: {name} is packed U32 but has no "
                    f"quantization scales beside it; {RECONVERT}"
                )
    if len(halves) > 1:
        raise CheckpointError(
            f"{path}: mixes half dtypes ({halves.get('F16')!r} is F16, "
            f"{halves.get('BF16')!r} is BF16); a converted model uses one, so "
            f"the header is corrupt; {RECONVERT}"
        )
    if index is not None and scale_codes:
        half = ST_FLOAT[next(iter(scale_codes))]
        for layout in index.layouts:
            if layout.scale_dtype not in (None, half):
                raise CheckpointError(
                    f"{path}: resident scales are {half} but experts.index.json says "
                    f"the experts' scales are {layout.scale_dtype}; one of the two files "
                    f"is wrong, {RECONVERT}"
                )
    return tensors


def load_resident(path: Path) -> dict:
    """resident.safetensors, lazily; one CheckpointError when it is missing or unreadable."""
    if not path.is_file():
        raise CheckpointError(f"{path} not found; re-run `edge0-eval convert`")
    try:
        return mx.load(str(path))
    except Exception as exc:
        # MLX raises RuntimeError/ValueError for truncated headers or data
        raise CheckpointError(
            f"{path} is unreadable ({exc}); the file is truncated or corrupt, "
            f"re-run `edge0-eval convert`"
        ) from None


def check_resident_names(model, weights: dict, path: Path) -> None:
    """The resident weights are exactly the model's non-expert parameters, with their shapes."""
    expected = {
        k for k, _ in tree_flatten(model.parameters()) if ".switch_mlp.glu." not in k
    }
    missing, unexpected = (
        sorted(expected - set(weights)),
        sorted(set(weights) - expected),
    )
    if missing or unexpected:
        raise CheckpointError(
            f"{path} does not match the model built from config.json: "
            f"{len(missing)} missing (e.g. {missing[:3]}), {len(unexpected)} unexpected "
            f"(e.g. {unexpected[:3]}); re-run convert"
        )
    params = dict(tree_flatten(model.parameters()))
    for name, value in weights.items():
        if params[name].shape != value.shape:
            raise CheckpointError(
                f"{path}: {name} has shape {value.shape}, the model expects "
                f"{params[name].shape}; re-run convert"
            )


# -- tokenizer ---------------------------------------------------------------------------------


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
            read_json_file(
                directory / name, name, "copy it again from the source checkpoint"
            )
    try:
        tokenizer = load_tokenizer(directory, eos_token_ids=eos_token_ids)
    except Exception as exc:
        # transformers/tokenizers raise many types for corrupt files
        raise CheckpointError(
            f"{directory}: the tokenizer files do not load ({type(exc).__name__}: "
            f"{str(exc)[:200]}); copy them again from the source checkpoint"
        ) from None
    n = len(tokenizer._tokenizer) if hasattr(tokenizer, "_tokenizer") else None
    if n is not None and n < 8:
        raise CheckpointError(
            f"{directory}: the tokenizer has only {n} tokens; its files are "
            f"incomplete, copy them again from the source checkpoint"
        )
    if n is not None and vocab_size is not None and n > vocab_size + 1024:
        raise CheckpointError(
            f"{directory}: the tokenizer has {n} tokens but the model's "
            f"vocab_size is {vocab_size}; the tokenizer belongs to another model"
        )
    if getattr(tokenizer, "chat_template", None):
        try:
            tokenizer.apply_chat_template(
                [{"role": "user", "content": "hi"}],
                add_generation_prompt=True,
                tokenize=False,
            )
        except Exception as exc:
            raise CheckpointError(
                f"{directory}: the chat template does not render "
                f"({type(exc).__name__}: {str(exc)[:200]}); fix tokenizer_config.json "
                "/ chat_template.jinja or copy them again from the source checkpoint"
            ) from None
    return tokenizer


def _check_tokenizer_files(directory: Path) -> None:
    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        raise CheckpointError(
            f"{directory}: no tokenizer ({' / '.join(TOKENIZER_FILES)}); copy the "
            f"source checkpoint's tokenizer files into it or {RECONVERT}"
        )
