"""`edge0-eval make-tiny OUT`: a random-weight MoE checkpoint in mlx-lm's own format, at a tiny
shape of a supported family (checkpoints/tiny.py)."""

from __future__ import annotations

import argparse

from edge0_eval.arguments.engine_flags import refuse_top_k
from edge0_eval.arguments.fields import add_fields, from_args
from edge0_eval.checkpoints.tiny import TinyShape, write_tiny


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out", help="output directory (must not exist or be empty)")
    add_fields(parser, TinyShape)
    refuse_top_k(parser)
    parser.add_argument(
        "--quantize",
        type=int,
        choices=(4, 8),
        default=None,
        help="also quantize (mlx-lm affine, group 64) to this many bits",
    )


def run(args: argparse.Namespace) -> int:
    shape = from_args(TinyShape, args)
    path = write_tiny(args.out, shape, quantize_bits=args.quantize)
    print(f"wrote {shape.family} checkpoint to {path}")
    return 0
