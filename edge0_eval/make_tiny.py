"""`edge0-eval make-tiny OUT`: a random-weight MoE checkpoint in mlx-lm's own format, at a tiny
shape of a supported family (checkpoints/tiny.py)."""

from __future__ import annotations

import argparse

from edge0_eval.arguments.engine_flags import add_experts_per_token
from edge0_eval.checkpoints.tiny import TinyShape, write_tiny
from edge0_eval.checkpoints.tiny_configs import TINY_CONFIGS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = TinyShape()
    parser.add_argument("out", help="output directory (must not exist or be empty)")
    parser.add_argument(
        "--family", default=d.family, help=f"one of {', '.join(TINY_CONFIGS)}"
    )
    parser.add_argument("--layers", type=int, default=d.layers)
    parser.add_argument("--experts", type=int, default=d.experts)
    add_experts_per_token(
        parser, "routing width written to the config", d.experts_per_token, int
    )
    parser.add_argument("--hidden", type=int, default=d.hidden)
    parser.add_argument("--heads", type=int, default=d.heads)
    parser.add_argument("--moe-intermediate", type=int, default=d.moe_intermediate)
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--dtype", default=d.dtype, help="float16 | bfloat16 | float32")
    parser.add_argument(
        "--quantize",
        type=int,
        choices=(4, 8),
        default=None,
        help="also quantize (mlx-lm affine, group 64) to this many bits",
    )


def run(args: argparse.Namespace) -> int:
    shape = TinyShape(
        family=args.family,
        layers=args.layers,
        experts=args.experts,
        experts_per_token=args.experts_per_token,
        hidden=args.hidden,
        heads=args.heads,
        moe_intermediate=args.moe_intermediate,
        seed=args.seed,
        dtype=args.dtype,
    )
    path = write_tiny(args.out, shape, quantize_bits=args.quantize)
    print(f"wrote {shape.family} checkpoint to {path}")
    return 0
