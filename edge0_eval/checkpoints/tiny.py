"""`edge0-eval make-tiny`: random-weight MoE checkpoints in mlx-lm's own format.

The model is built by mlx-lm's own class for the family, so whatever mlx-lm loads is exactly what
was written. Deterministic for a seed: the weights come from MLX's seeded generator and the
tokenizer from a fixed corpus.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.utils import _get_classes, quantize_model, save_config, save_model

from edge0_eval.checkpoints.tokenizer import build_tokenizer
from edge0_eval.checkpoints.writer import output_dir
from edge0_eval.engine.families import FAMILIES
from edge0_eval.errors import ConfigError



@dataclass
class TinyShape:
    family: str = "qwen3_5_moe"
    layers: int = 4
    experts: int = 16
    top_k: int = 4
    hidden: int = 64
    heads: int = 4
    moe_intermediate: int = 64
    seed: int = 0
    dtype: str = "float16"
    vocab_size: int = 512

    def validate(self) -> None:
        if self.family not in FAMILIES:
            raise ConfigError(f"unknown family {self.family!r}; choose one of {', '.join(FAMILIES)}")
        for name in ("layers", "experts", "top_k", "hidden", "heads", "moe_intermediate"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1")
        if self.top_k > self.experts:
            raise ConfigError(f"--top-k {self.top_k} is larger than --experts {self.experts}")
        if self.hidden % self.heads:
            raise ConfigError(f"--hidden {self.hidden} is not divisible by --heads {self.heads}")
        head_dim = self.hidden // self.heads
        if head_dim % 4:
            raise ConfigError(f"head dim {head_dim} (hidden/heads) must be a multiple of 4")
        if self.dtype not in ("float16", "bfloat16", "float32"):
            raise ConfigError(f"--dtype must be float16, bfloat16 or float32, not {self.dtype!r}")
        if self.family == "bailing_hybrid":
            groups = _bailing_groups(self.experts)
            per_group = self.experts // groups
            if self.top_k > (groups // 2 if groups > 1 else 1) * per_group:
                raise ConfigError(
                    f"--top-k {self.top_k} cannot be met by group-limited routing over "
                    f"{self.experts} experts in {groups} groups keeping {max(1, groups // 2)}"
                )
            if self.layers < 2:
                raise ConfigError("bailing_hybrid needs --layers >= 2 (layer 0 is dense)")


def _bailing_groups(experts: int) -> int:
    for groups in (8, 4, 2):
        if experts % groups == 0 and experts // groups >= 2:
            return groups
    return 1


def model_config(shape: TinyShape) -> dict:
    """The config.json mlx-lm reads for the family, at this shape."""
    head_dim = shape.hidden // shape.heads
    if shape.family == "qwen3_5_moe":
        text = {
            "model_type": "qwen3_5_moe_text",
            "hidden_size": shape.hidden,
            "intermediate_size": shape.moe_intermediate * 4,
            "num_hidden_layers": shape.layers,
            "num_attention_heads": shape.heads,
            "num_key_value_heads": max(1, shape.heads // 2),
            "head_dim": head_dim,
            "rms_norm_eps": 1e-6,
            "vocab_size": shape.vocab_size,
            "max_position_embeddings": 4096,
            "linear_num_value_heads": shape.heads,
            "linear_num_key_heads": max(1, shape.heads // 2),
            "linear_key_head_dim": head_dim,
            "linear_value_head_dim": head_dim,
            "linear_conv_kernel_dim": 4,
            "tie_word_embeddings": False,
            "attention_bias": False,
            "full_attention_interval": 4,
            "num_experts": shape.experts,
            "num_experts_per_tok": shape.top_k,
            "decoder_sparse_step": 1,
            "shared_expert_intermediate_size": shape.moe_intermediate,
            "moe_intermediate_size": shape.moe_intermediate,
            "norm_topk_prob": True,
            "rope_parameters": {
                "type": "default",
                "rope_theta": 10000000,
                "partial_rotary_factor": 0.25,
                "mrope_section": [11, 11, 10],
            },
        }
        return {"model_type": "qwen3_5_moe", "text_config": text, "tie_word_embeddings": False}
    if shape.family == "qwen2_moe":
        return {
            "model_type": "qwen2_moe",
            "hidden_size": shape.hidden,
            "intermediate_size": shape.moe_intermediate * 4,   # unused: every layer is MoE
            "num_hidden_layers": shape.layers,
            "num_attention_heads": shape.heads,
            "num_key_value_heads": shape.heads // 2 if shape.heads % 2 == 0 else shape.heads,
            "rms_norm_eps": 1e-6,
            "vocab_size": shape.vocab_size,
            "max_position_embeddings": 4096,
            "rope_theta": 1000000.0,
            "num_experts": shape.experts,
            "num_experts_per_tok": shape.top_k,
            "moe_intermediate_size": shape.moe_intermediate,
            "shared_expert_intermediate_size": shape.moe_intermediate,
            "tie_word_embeddings": False,
        }
    groups = _bailing_groups(shape.experts)
    return {
        "model_type": "bailing_hybrid",
        "hidden_size": shape.hidden,
        "intermediate_size": shape.moe_intermediate * 4,
        "moe_intermediate_size": shape.moe_intermediate,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.heads,
        "num_experts": shape.experts,
        "num_experts_per_tok": shape.top_k,
        "num_shared_experts": 1,
        "n_group": groups,
        "topk_group": max(1, groups // 2),
        "first_k_dense_replace": 1,
        "layer_group_size": 2,
        "group_norm_size": 2 if shape.heads % 2 == 0 else 1,
        "vocab_size": shape.vocab_size,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "routed_scaling_factor": 2.5,
        "head_dim": head_dim,
        "kv_lora_rank": max(16, head_dim * 2),
        "qk_rope_head_dim": max(4, head_dim // 2),
        "qk_nope_head_dim": max(4, head_dim // 2),
        "v_head_dim": head_dim,
        "q_lora_rank": None,
        "partial_rotary_factor": 0.5,
        "score_function": "sigmoid",
        "norm_topk_prob": True,
        "moe_router_enable_expert_bias": True,
        "tie_word_embeddings": False,
        "use_qk_norm": True,
    }


def build_model(config: dict, seed: int, dtype: str):
    """Instantiate mlx-lm's model for `config` with seeded random weights in `dtype`."""
    mx.random.seed(seed)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    target = getattr(mx, dtype)
    keep = getattr(model, "cast_predicate", lambda _: True)
    params = []
    for name, value in tree_flatten(model.parameters()):
        if name.endswith("expert_bias"):
            # Non-zero bias so tests see it steer selection (zeros would hide a bug).
            value = mx.random.normal(value.shape) * 0.05
        if mx.issubdtype(value.dtype, mx.floating) and keep(name):
            value = value.astype(target)
        params.append((name, value))
    model.update(tree_unflatten(params))
    mx.eval(model.parameters())
    return model


def write_tiny(out: str | Path, shape: TinyShape, quantize_bits: int | None = None) -> Path:
    """Write the checkpoint to `out` (which must not exist or be empty). Returns the path."""
    shape.validate()
    with output_dir(out) as tmp:
        shape.vocab_size = build_tokenizer(tmp, vocab_size=shape.vocab_size)
        config = model_config(shape)
        model = build_model(config, shape.seed, shape.dtype)
        if quantize_bits:
            model, config = quantize_model(model, config, group_size=64, bits=quantize_bits)
        eos, pad = _token_id(tmp, "<|im_end|>"), _token_id(tmp, "<|endoftext|>")
        # transformers reads these ids from config.json; without them it warns about defaults
        # that point outside the tiny vocabulary.
        for section in (config, config.get("text_config", {})):
            section["eos_token_id"], section["pad_token_id"], section["bos_token_id"] = eos, pad, None
        save_model(tmp, model)
        save_config(config, tmp / "config.json")
        (tmp / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}, indent=2))
    return Path(out)


def _token_id(path: Path, content: str) -> int:
    vocab = json.loads((path / "tokenizer.json").read_text())
    for tok in vocab["added_tokens"]:
        if tok["content"] == content:
            return tok["id"]
    raise RuntimeError(f"tokenizer lacks {content}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = TinyShape()
    parser.add_argument("out", help="output directory (must not exist or be empty)")
    parser.add_argument("--family", default=d.family, help=f"one of {', '.join(FAMILIES)}")
    parser.add_argument("--layers", type=int, default=d.layers)
    parser.add_argument("--experts", type=int, default=d.experts)
    parser.add_argument("--top-k", type=int, default=d.top_k)
    parser.add_argument("--hidden", type=int, default=d.hidden)
    parser.add_argument("--heads", type=int, default=d.heads)
    parser.add_argument("--moe-intermediate", type=int, default=d.moe_intermediate)
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--dtype", default=d.dtype, help="float16 | bfloat16 | float32")
    parser.add_argument("--quantize", type=int, choices=(4, 8), default=None,
                        help="also quantize (mlx-lm affine, group 64) to this many bits")


def run(args: argparse.Namespace) -> int:
    shape = TinyShape(
        family=args.family, layers=args.layers, experts=args.experts, top_k=args.top_k,
        hidden=args.hidden, heads=args.heads, moe_intermediate=args.moe_intermediate,
        seed=args.seed, dtype=args.dtype,
    )
    path = write_tiny(args.out, shape, quantize_bits=args.quantize)
    print(f"wrote {shape.family} checkpoint to {path}")
    return 0
