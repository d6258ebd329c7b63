"""`edge0-eval make-synthetic OUT --shape 35b|8b`: random weights at a real tier's shape, written
in the streaming layout (checkpoints/synthetic.py)."""

from __future__ import annotations

import argparse

from edge0_eval.checkpoints.synthetic import SHAPES, write_synthetic
from edge0_eval.formats.layout import RESIDENT_NAME, ExpertIndex


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
    # Test-only scale-downs; not part of the public interface.
    parser.add_argument("--experts", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--vocab", type=int, default=None, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    overrides = {}
    if args.experts is not None:
        overrides["num_experts"] = args.experts
    if args.vocab is not None:
        overrides["vocab_size"] = args.vocab
    out = write_synthetic(
        args.out, args.shape, layers=args.layers, seed=args.seed, overrides=overrides
    )
    index = ExpertIndex.load(out)
    resident = (out / RESIDENT_NAME).stat().st_size
    print(
        f"wrote {args.shape} synthetic checkpoint to {out}: {len(index.moe_layers)} MoE layers "
        f"x {index.num_experts} experts, experts {index.file_size / 1e9:.2f} GB + resident "
        f"{resident / 1e9:.2f} GB"
    )
    return 0
