"""`edge0-eval train-prerouter MODEL --text ... --out heads.safetensors`: stage 1, distil
prerouter heads from the model's true routing (training/prerouter_fit.py)."""

from __future__ import annotations

import argparse

from edge0_eval.training.prerouter_fit import train_prerouter
from edge0_eval.training.stage_options import (
    add_prerouter_arguments,
    prerouter_options_from_args,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_prerouter_arguments(parser)


def run(args: argparse.Namespace) -> int:
    train_prerouter(prerouter_options_from_args(args), kill_after=args.kill_after_step)
    return 0
