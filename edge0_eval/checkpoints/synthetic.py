"""Random weights at a real tier's shape (`edge0-eval make-synthetic OUT --shape 35b|8b`).

The checkpoint is written directly in the converted streaming layout (resident.safetensors,
experts.bin + experts.index.json, config.json, tokenizer), by default int4 group 64 with the
8-bit router overrides that mlx-lm's `quant_predicate` produces, so engine speed and memory can
be measured at full size without the real weights. `--bits/--group-size/--mode` quantize it
otherwise (any mode mlx-lm has: affine, mxfp4, mxfp8, nvfp4) and `--recipe` by a mixed recipe
(recipes.py: mlx-lm's mixed_* and the 2/3-bit expert recipes), as `mlx_lm.convert` would.

Weights are generated already quantized. Affine ones with numpy (random packed codes, fp16
scales around 1/(2**(bits-1)*sqrt(in)), biases = -(2**bits-1)/2 * scales so dequantized weights
are centred with a std of about 0.58/sqrt(in), which keeps activations O(1)). The float modes'
codes cannot be drawn uniformly (random fp8 codes span 2**16 in magnitude and include NaN), so
their rows are drawn from a quantized random normal matrix of the same std. Names, shapes and
the quantization config come from mlx-lm's own model class, built lazily and quantized with
`quantize_model`, so mlx-lm loads the result strictly. Experts are generated and written one layer at a time; every tensor has its
own seeded generator, so a seed always gives the same bytes and `--layers N` gives the same first
N layers as the full model.
"""

from __future__ import annotations

import copy
import json
import zlib
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.utils import save_config
from tokenizers import Tokenizer
from tqdm import tqdm

from edge0_eval.checkpoints.conversion_plan import (
    Plan,
    build_lazy_model,
    lazy_quantize,
    new_index,
    quantized_modules,
    switch_layers,
)
from edge0_eval.checkpoints.recipes import RECIPES, recipe_predicate
from edge0_eval.checkpoints.tokenizer import build_tokenizer
from edge0_eval.checkpoints.writer import (
    BundleWriter,
    check_free_space,
    check_out_empty,
    output_dir,
)
from edge0_eval.errors import ConfigError
from edge0_eval.formats.layout import (
    EXPERTS_NAME,
    QUANT_MODES,
    RESIDENT_NAME,
    BundleLayout,
    Quant,
)

BITS = 4
GROUP_SIZE = 64
# the tokenizer is small; the model's embedding has the real vocab
TOKENIZER_VOCAB = 512

# Qwen3.5/3.6-35B-A3B text tower (mlx-lm `qwen3_5_moe`, parameters under text_config).
QWEN35_35B_TEXT = {
    "model_type": "qwen3_5_moe_text",
    "hidden_size": 2048,
    "num_hidden_layers": 40,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "rms_norm_eps": 1e-6,
    "vocab_size": 248320,
    "max_position_embeddings": 262144,
    "linear_num_value_heads": 32,
    "linear_num_key_heads": 16,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "full_attention_interval": 4,
    "num_experts": 256,
    "num_experts_per_tok": 8,
    "decoder_sparse_step": 1,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "norm_topk_prob": True,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000000,
        "partial_rotary_factor": 0.25,
        "mrope_section": [11, 11, 10],
        "mrope_interleaved": True,
    },
}

# Ling 3.0 tiny (mlx-lm `bailing_hybrid`). Tier facts: hidden 1536, 24 layers, 128 experts, top-8,
# sigmoid routing with expert bias, 8 groups keep 4, scaling 2.5, one shared expert, layer 0
# dense. The rest is assumed (Ling 2.x conventions): 12 heads of 128, MLA every 8th layer with
# kv_lora_rank 512 / rope 64 / nope 128 / v 128 and no q LoRA, expert width 512 (gives ~8B),
# dense width 3840 (2.5 x hidden, as Ling-mini-2.0), vocab 157184.
LING_8B = {
    "model_type": "bailing_hybrid",
    "hidden_size": 1536,
    "intermediate_size": 3840,
    "moe_intermediate_size": 512,
    "num_hidden_layers": 24,
    "num_attention_heads": 12,
    "num_key_value_heads": 12,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_shared_experts": 1,
    "n_group": 8,
    "topk_group": 4,
    "first_k_dense_replace": 1,
    "layer_group_size": 8,
    "group_norm_size": 4,
    "vocab_size": 157184,
    "rms_norm_eps": 1e-6,
    "rope_theta": 600000.0,
    "max_position_embeddings": 32768,
    "routed_scaling_factor": 2.5,
    "head_dim": 128,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "q_lora_rank": None,
    "partial_rotary_factor": 0.5,
    "rope_interleave": True,
    "score_function": "sigmoid",
    "norm_topk_prob": True,
    "moe_router_enable_expert_bias": True,
    "use_qk_norm": True,
    "use_bias": False,
    "use_qkv_bias": False,
    "tie_word_embeddings": False,
}

SHAPES = ("35b", "8b")


def shape_config(
    shape: str, layers: int | None = None, overrides: dict | None = None
) -> dict:
    """The (unquantized) mlx-lm config.json for a tier; `overrides` patch the text parameters."""
    if shape not in SHAPES:
        raise ConfigError(
            f"unknown --shape {shape!r}; choose one of {', '.join(SHAPES)}"
        )
    text = copy.deepcopy(QWEN35_35B_TEXT if shape == "35b" else LING_8B)
    text.update(overrides or {})
    if layers is not None:
        text["num_hidden_layers"] = layers
    _validate(shape, text)
    if shape == "35b":
        return {
            "model_type": "qwen3_5_moe",
            "text_config": text,
            "tie_word_embeddings": False,
        }
    return text


def _validate(shape: str, text: dict) -> None:
    layers, experts, experts_per_token = (
        text["num_hidden_layers"],
        text["num_experts"],
        text["num_experts_per_tok"],
    )
    min_layers = 2 if shape == "8b" else 1  # Ling's layer 0 is dense
    if layers < min_layers:
        raise ConfigError(f"--layers must be at least {min_layers} for --shape {shape}")
    if not 1 <= experts_per_token <= experts:
        raise ConfigError(
            f"--experts {experts} must be at least top-k {experts_per_token}"
        )
    if shape == "8b":
        groups, keep = text["n_group"], text["topk_group"]
        if (
            experts % groups
            or experts // groups < 2
            or experts_per_token > keep * experts // groups
        ):
            raise ConfigError(
                f"--experts {experts} does not fit {groups}-group routing keeping "
                f"{keep} groups with top-{experts_per_token} (needs a multiple of {groups}, "
                f"at least {2 * groups})"
            )


# -- random quantized tensors ------------------------------------------------------------------


def _rng(seed: int, name: str) -> np.random.Generator:
    """One generator per tensor: the bytes do not depend on generation order or layer count."""
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def random_quantized(
    rng,
    rows: tuple[int, ...],
    in_dim: int,
    bits: int = BITS,
    group_size: int = GROUP_SIZE,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Packed affine codes + fp16 scales/biases of a `rows x in_dim` weight (mx.quantize layout)."""
    weight = rng.integers(0, 2**32, size=(*rows, in_dim * bits // 32), dtype=np.uint32)
    base = 2.0 / (2**bits * np.sqrt(in_dim))  # 4 bits: 1 / (8 sqrt(in))
    scales = (base * rng.uniform(0.8, 1.2, size=(*rows, in_dim // group_size))).astype(
        np.float16
    )
    # Codes are uniform on 0..2^bits-1 (mean 7.5 at 4 bits): centring on that mean, not on 8,
    # keeps every row zero-mean. An offset here adds one common direction to every layer's
    # output and collapses routing onto the same experts for every token (measured: 97% hits).
    biases = (scales * -((2**bits - 1) / 2)).astype(np.float16)
    return weight, scales, biases


# Rows of the quantized random matrix a float-mode weight's rows are drawn from.
_TEMPLATE_ROWS = 256


def random_quantized_parts(
    rng, rows: tuple[int, ...], in_dim: int, quant: Quant
) -> dict[str, np.ndarray]:
    """part -> array of a random `rows x in_dim` weight quantized as `quant`."""
    if quant.mode == "affine":
        parts = random_quantized(rng, rows, in_dim, quant.bits, quant.group_size)
        return dict(zip(("weight", "scales", "biases"), parts))
    if quant.global_scale:
        raise ConfigError("synthetic weights have no nvfp4 global scales")
    n = int(np.prod(rows))
    template = rng.standard_normal((min(n, _TEMPLATE_ROWS), in_dim)).astype(np.float32)
    template *= 0.58 / np.sqrt(in_dim)  # the std the affine weights have
    weight, scales = mx.quantize(
        mx.array(template), quant.group_size, quant.bits, mode=quant.mode
    )
    pick = rng.integers(0, template.shape[0], size=n)
    return {
        "weight": np.array(weight)[pick].reshape(*rows, -1),
        "scales": np.array(scales)[pick].reshape(*rows, -1),
    }


# Parameters the families' cast_predicate keeps in float32; everything else is float16.
_FLOAT32_PARAMS = ("A_log", "expert_bias")


def _random_dense(rng, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """An unquantized parameter, initialised the way a trained model roughly looks."""
    if name.endswith("A_log"):  # GatedDeltaNet decay, as mlx-lm initialises it
        return np.log(rng.uniform(1, 16, size=shape)).astype(np.float32)
    if name.endswith("expert_bias"):
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)
    if len(shape) == 1:  # norms and dt_bias
        return np.ones(shape, dtype=np.float16)
    fan_in = int(np.prod(shape[1:])) if name.endswith("conv1d.weight") else shape[-1]
    return (rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float16)


# -- writing -----------------------------------------------------------------------------------


def _resident_nbytes(qmodel, expert_prefixes: tuple[str, ...]) -> int:
    """Size of resident.safetensors' data, by the same dtype rules as `_resident`."""
    qmods, total = quantized_modules(qmodel), 0
    for name, value in tree_flatten(qmodel.parameters()):
        if name.startswith(expert_prefixes):
            continue
        module, _, leaf = name.rpartition(".")
        if module in qmods:
            # packed uint32 codes; fp16 affine scales/biases; uint8 scales otherwise
            size = 4 if leaf == "weight" else 2 if qmods[module][2] == "affine" else 1
        else:
            size = 4 if name.endswith(_FLOAT32_PARAMS) else 2
        total += value.size * size
    return total


def _resident(qmodel, expert_prefixes: tuple[str, ...], seed: int) -> dict:
    """Every non-expert parameter of the quantized model, as MLX arrays."""
    qmods = quantized_modules(qmodel)
    out = {}
    for name, value in tree_flatten(qmodel.parameters()):
        if name.startswith(expert_prefixes):
            continue
        module, _, leaf = name.rpartition(".")
        if module in qmods:
            if leaf == "weight":
                group, bits, mode = qmods[module]
                in_dim = value.shape[-1] * 32 // bits
                parts = random_quantized_parts(
                    _rng(seed, name),
                    tuple(value.shape[:-1]),
                    in_dim,
                    Quant(bits, group, mode),
                )
                for part, arr in parts.items():
                    out[f"{module}.{part}"] = mx.array(arr)
            continue
        out[name] = mx.array(_random_dense(_rng(seed, name), name, tuple(value.shape)))
    return out


def _expert_layouts(qmodel, switches) -> dict[int, BundleLayout]:
    """decoder layer -> the bundle layout of its experts as mlx-lm quantized them."""
    qmods, layouts = quantized_modules(qmodel), {}
    for layer, switch in switches.items():
        quant, shapes = {}, {}
        for proj, (out_dim, in_dim) in switch.dims.items():
            group, bits, mode = qmods[f"{switch.path}.{proj}"]
            quant[proj] = Quant(bits, group, mode)
            for part, spec in (
                quant[proj].part_specs(out_dim, in_dim, "float16").items()
            ):
                shapes[f"{proj}.{part}"] = spec
        layouts[layer] = BundleLayout.of(quant, shapes)
    return layouts


def _layer_experts(switch, layout: BundleLayout, seed: int):
    """expert e -> its random bundle tensors; generated on demand, nothing kept."""

    def arrays(e: int) -> dict[str, np.ndarray]:
        rng = _rng(seed, f"{switch.path}.expert{e}")
        out = {}
        for proj, (out_dim, in_dim) in switch.dims.items():
            parts = random_quantized_parts(rng, (out_dim,), in_dim, layout.quant[proj])
            out.update({f"{proj}.{p}": a for p, a in parts.items()})
        return out

    return arrays


def _write_tokenizer(directory: Path, config: dict) -> None:
    build_tokenizer(directory, vocab_size=TOKENIZER_VOCAB)
    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    eos, pad = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    # transformers reads these from config.json; without them it falls back to defaults.
    for section in (config, config.get("text_config", {})):
        section["eos_token_id"], section["pad_token_id"], section["bos_token_id"] = (
            eos,
            pad,
            None,
        )
    (directory / "generation_config.json").write_text(
        json.dumps({"eos_token_id": eos}, indent=2)
    )


@dataclass(frozen=True)
class Quantization:
    """How make-synthetic quantizes, as mlx_lm.convert's -q options do: bits, group size and
    mode for every quantized module (None: the mode's default), or a named recipe."""

    bits: int | None = None  # None: the mode's default (affine: BITS, GROUP_SIZE)
    group_size: int | None = None
    mode: str = "affine"
    recipe: str | None = None

    def validate(self) -> None:
        if self.mode not in QUANT_MODES:
            raise ConfigError(
                f"--mode {self.mode!r} is not one of {', '.join(QUANT_MODES)}"
            )
        rule = QUANT_MODES[self.mode]
        if self.bits is not None and self.bits not in rule.bits:
            raise ConfigError(
                f"--bits {self.bits} is not supported by --mode {self.mode}; choose "
                f"one of {rule.bits}"
            )
        if self.group_size is not None and self.group_size not in rule.group_sizes:
            raise ConfigError(
                f"--group-size {self.group_size} is not supported by --mode "
                f"{self.mode}; choose one of {rule.group_sizes}"
            )
        if self.recipe is not None and self.recipe not in RECIPES:
            raise ConfigError(
                f"--recipe {self.recipe!r} is not one of {', '.join(RECIPES)}"
            )
        if self.recipe is not None and self.mode != "affine":
            # as mlx_lm.convert: its recipes are affine
            raise ConfigError(
                f"--recipe {self.recipe} is affine; drop --mode {self.mode} or the recipe"
            )


def _prepare(
    shape: str,
    layers: int | None,
    overrides: dict | None,
    quantization: Quantization | None = None,
):
    """Config, quantized lazy model and expert plan for a tier (nothing evaluated)."""
    q = quantization or Quantization()
    q.validate()
    config = shape_config(shape, layers, overrides)
    switches = switch_layers(model := build_lazy_model(config))
    predicate = None if q.recipe is None else recipe_predicate(q.recipe, model)
    qmodel, qconfig = lazy_quantize(
        model, config, q.group_size, q.bits, mode=q.mode, quant_predicate=predicate
    )
    plan = Plan(
        config=qconfig,
        copy_config=False,
        switches=switches,
        layouts=_expert_layouts(qmodel, switches),
        resident_names=[],
        quantize_resident={},
    )
    return qmodel, plan


def estimate_bytes(
    shape: str,
    layers: int | None = None,
    overrides: dict | None = None,
    quantization: Quantization | None = None,
) -> dict[str, int]:
    """{"experts": experts.bin size, "resident": resident tensor bytes} for a tier."""
    qmodel, plan = _prepare(shape, layers, overrides, quantization)
    prefixes = tuple(s.path + "." for s in plan.switches.values())
    return {
        "experts": new_index(plan, "").file_size,
        "resident": _resident_nbytes(qmodel, prefixes),
    }


def write_synthetic(
    out: str | Path,
    shape: str = "35b",
    layers: int | None = None,
    seed: int = 0,
    overrides: dict | None = None,
    progress: bool = True,
    quantization: Quantization | None = None,
) -> Path:
    """Write a random-weight checkpoint of tier `shape` in the streaming layout. Returns `out`.

    `overrides` patch the text config (tests use e.g. {"num_experts": 8, "vocab_size": 1024});
    `quantization` replaces the default int4 group 64.
    """
    check_out_empty(out)  # the cheapest check first
    qmodel, plan = _prepare(shape, layers, overrides, quantization)
    qconfig = plan.config
    index = new_index(plan, qconfig["model_type"])
    prefixes = tuple(s.path + "." for s in plan.switches.values())
    with output_dir(out) as tmp:
        check_free_space(tmp, index.file_size + _resident_nbytes(qmodel, prefixes))
        # Resident weights are ~7% of the model (1.4 GB at 35B): built in memory, saved once.
        mx.save_safetensors(
            str(tmp / RESIDENT_NAME),
            _resident(qmodel, prefixes, seed),
            metadata={"format": "mlx"},
        )
        writer = BundleWriter(tmp / EXPERTS_NAME, index)
        try:
            for layer in tqdm(
                plan.moe_layers,
                desc=f"synthetic {shape} experts",
                unit="layer",
                disable=not progress,
            ):
                writer.write_layer(
                    layer,
                    _layer_experts(plan.switches[layer], plan.layouts[layer], seed),
                )
        finally:
            writer.close()
        index.validate(tmp)
        index.save(tmp)
        _write_tokenizer(tmp, qconfig)
        save_config(qconfig, tmp / "config.json")
    return Path(out)
