"""`edge0-eval make-synthetic OUT --shape 35b|8b`: random weights at a real tier's shape, written
in the streaming layout, int4 or any quantization mlx_lm.convert makes (checkpoints/synthetic.py,
checkpoints/recipes.py)."""

from __future__ import annotations

import argparse

from edge0_eval.checkpoints.recipes import RECIPES
from edge0_eval.checkpoints.synthetic import (
    BITS,
    GROUP_SIZE,
    SHAPES,
    Quantization,
    write_synthetic,
)
from edge0_eval.formats.layout import QUANT_MODES, RESIDENT_NAME, ExpertIndex


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out", help="output directory (must not exist or be empty)")
    parser.add_argument(
        "--shape",
        required=True,
        choices=SHAPES,
        help="35b: Qwen3.5/3.6-35B-A3B (qwen3_5_moe); 8b: Ling (bailing_hybrid)",
    )
    parser.add_argument(
        "--layers",
        type=int,
        default=None,
        help="decoder layers (default: the tier's full depth); same per-layer "
        "shape, for quick runs",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--bits",
        type=int,
        default=None,
        help=f"bits of every quantized module (default {BITS}; the --mode's default "
        f"with another mode), as mlx_lm.convert --q-bits",
    )
    parser.add_argument(
        "--group-size",
        type=int,
        default=None,
        help=f"quantization group size (default {GROUP_SIZE}; the --mode's default "
        f"with another mode)",
    )
    parser.add_argument(
        "--mode",
        default="affine",
        choices=tuple(QUANT_MODES),
        help="quantization mode, as mlx_lm.convert --q-mode",
    )
    parser.add_argument(
        "--recipe",
        default=None,
        choices=RECIPES,
        help="mixed quantization recipe (mlx-lm's mixed_* as --quant-predicate; "
        "experts_2_3: routed experts gate/up 2-bit, down 3-bit; config_i: that in the "
        "middle layers, first and last layers 8-bit, float routers)",
    )
    # Test-only scale-downs; not part of the public interface.
    parser.add_argument("--experts", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--vocab", type=int, default=None, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    given = {"num_experts": args.experts, "vocab_size": args.vocab}
    overrides = {k: v for k, v in given.items() if v is not None}
    quantization = Quantization(args.bits, args.group_size, args.mode, args.recipe)
    out = write_synthetic(
        args.out,
        args.shape,
        layers=args.layers,
        seed=args.seed,
        overrides=overrides,
        quantization=quantization,
    )
    index = ExpertIndex.load(out)
    resident = (out / RESIDENT_NAME).stat().st_size
    print(
        f"wrote {args.shape} synthetic checkpoint to {out}: {len(index.moe_layers)} MoE layers "
        f"x {index.num_experts} experts ({index.describe_quant()}), experts "
        f"{index.file_size / 1e9:.2f} GB + resident {resident / 1e9:.2f} GB"
    )
    return 0
