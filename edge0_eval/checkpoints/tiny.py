"""Random-weight MoE checkpoints in mlx-lm's own format (`edge0-eval make-tiny`: make_tiny.py).

The model is built by mlx-lm's own class for the family, so whatever mlx-lm loads is exactly what
was written. Deterministic for a seed: the weights come from MLX's seeded generator and the
tokenizer from a fixed corpus.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.utils import _get_classes, quantize_model, save_config, save_model

from edge0_eval.checkpoints.tiny_configs import TINY_CONFIGS
from edge0_eval.checkpoints.tokenizer import build_tokenizer
from edge0_eval.checkpoints.writer import output_dir
from edge0_eval.engine.options import option
from edge0_eval.errors import ConfigError


@dataclass
class TinyShape:
    """The checkpoint's shape; each field's metadata is its make-tiny flag."""

    family: str = option("qwen3_5_moe", f"one of {', '.join(TINY_CONFIGS)}")
    layers: int = option(4, "decoder layers")
    experts: int = option(16, "experts per MoE layer")
    experts_per_token: int = option(
        4, "routing width written to the config", metavar="K"
    )
    hidden: int = option(64, "hidden size")
    heads: int = option(4, "attention heads")
    moe_intermediate: int = option(64, "an expert's intermediate size")
    seed: int = option(0, "seed of the random weights")
    dtype: str = option("float16", "float16 | bfloat16 | float32")
    vocab_size: int = option(512, flag=False)  # the fixed tokenizer's

    def validate(self) -> None:
        if self.family not in TINY_CONFIGS:
            raise ConfigError(
                f"unknown family {self.family!r}; choose one of {', '.join(TINY_CONFIGS)}"
            )
        sizes = "layers experts experts_per_token hidden heads moe_intermediate"
        for name in sizes.split():
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1")
        if self.experts_per_token > self.experts:
            raise ConfigError(
                f"--experts-per-token {self.experts_per_token} is larger than --experts {self.experts}"
            )
        if self.hidden % self.heads:
            raise ConfigError(
                f"--hidden {self.hidden} is not divisible by --heads {self.heads}"
            )
        head_dim = self.hidden // self.heads
        if head_dim % 4:
            raise ConfigError(
                f"head dim {head_dim} (hidden/heads) must be a multiple of 4"
            )
        if self.dtype not in ("float16", "bfloat16", "float32"):
            raise ConfigError(
                f"--dtype must be float16, bfloat16 or float32, not {self.dtype!r}"
            )
        TINY_CONFIGS[self.family](self)  # the family's own refusals


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


def write_tiny(
    out: str | Path, shape: TinyShape, quantize_bits: int | None = None
) -> Path:
    """Write the checkpoint to `out` (which must not exist or be empty). Returns the path."""
    shape.validate()
    with output_dir(out) as tmp:
        shape.vocab_size = build_tokenizer(tmp, vocab_size=shape.vocab_size)
        config = TINY_CONFIGS[shape.family](shape)
        model = build_model(config, shape.seed, shape.dtype)
        if quantize_bits:
            model, config = quantize_model(
                model, config, group_size=64, bits=quantize_bits
            )
        eos, pad = _token_id(tmp, "<|im_end|>"), _token_id(tmp, "<|endoftext|>")
        # transformers reads these ids from config.json; without them it warns about defaults
        # that point outside the tiny vocabulary.
        for section in (config, config.get("text_config", {})):
            section.update(eos_token_id=eos, pad_token_id=pad, bos_token_id=None)
        save_model(tmp, model)
        save_config(config, tmp / "config.json")
        (tmp / "generation_config.json").write_text(
            json.dumps({"eos_token_id": eos}, indent=2)
        )
    return Path(out)


def _token_id(path: Path, content: str) -> int:
    vocab = json.loads((path / "tokenizer.json").read_text())
    for tok in vocab["added_tokens"]:
        if tok["content"] == content:
            return tok["id"]
    raise RuntimeError(f"tokenizer lacks {content}")
