"""`edge0-eval distill TEACHER STUDENT --prompts prompts.jsonl --init-adapter A --out B`:
stage 3, on-policy distillation of the student towards the teacher (training/on_policy.py)."""

from __future__ import annotations

import argparse

from edge0_eval.training.on_policy import Distill, distill
from edge0_eval.training.stage_options import add_stage_arguments, options_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_stage_arguments(parser, Distill.name)


def run(args: argparse.Namespace) -> int:
    distill(options_from_args(args, Distill.name), kill_after=args.kill_after_step)
    return 0
