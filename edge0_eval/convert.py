"""`edge0-eval convert SRC OUT`: a MoE checkpoint mlx-lm loads -> the streaming layout
(checkpoints/conversion.py): a quantized SRC repacked as it is, a float one quantized as mlx-lm
does."""

from __future__ import annotations

import argparse

from edge0_eval.checkpoints.conversion import convert
from edge0_eval.checkpoints.conversion_plan import (
    DEFAULT_BITS,
    DEFAULT_GROUP_SIZE,
    SUPPORTED_MODEL_TYPES,
)
from edge0_eval.formats.layout import ExpertIndex


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "src",
        help="checkpoint directory mlx-lm loads: an mlx-community conversion or a "
        f"Hugging Face original ({', '.join(SUPPORTED_MODEL_TYPES)})",
    )
    parser.add_argument("out", help="output directory (must not exist or be empty)")
    parser.add_argument(
        "--bits",
        type=int,
        default=None,
        help=f"bits for a float SRC (default {DEFAULT_BITS}); a quantized SRC "
        f"is repacked as it is (any bits per layer and projection, any mode)",
    )
    parser.add_argument(
        "--group-size",
        type=int,
        default=None,
        help=f"quantization group size for a float SRC (default {DEFAULT_GROUP_SIZE})",
    )


def run(args: argparse.Namespace) -> int:
    out = convert(args.src, args.out, bits=args.bits, group_size=args.group_size)
    index = ExpertIndex.load(out)
    print(
        f"wrote {out}: {len(index.moe_layers)} MoE layers x {index.num_experts} experts "
        f"({index.describe_quant()}), {index.file_size / 1e9:.2f} GB of experts"
    )
    return 0
