"""`edge0-eval train-lora TEACHER STUDENT --prompts prompts.jsonl --out lora.safetensors`:
stage 2, LoRA SFT of the student on the teacher's completions (training/sft.py)."""

from __future__ import annotations

import argparse

from edge0_eval.training.sft import SFT, train_lora
from edge0_eval.training.stage_options import add_stage_arguments, options_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_stage_arguments(parser, SFT.name)


def run(args: argparse.Namespace) -> int:
    train_lora(options_from_args(args, SFT.name), kill_after=args.kill_after_step)
    return 0
