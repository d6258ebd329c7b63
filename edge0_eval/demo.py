"""`edge0-eval demo`: the embedded default, end to end, offline.

Builds a tiny teacher checkpoint and generates from it. This grows with the project: the
streaming engine, then the full teacher-vs-student OpenCompass run on fixture data.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--work-dir", default="outputs/demo",
                        help="where checkpoints and results go (default: outputs/demo)")


def run(args: argparse.Namespace) -> int:
    from mlx_lm import generate, load

    from edge0_eval.mlx_compat import upcast_unquantized_experts_for_cpu
    from edge0_eval.tiny import TinyShape, write_tiny

    work = Path(args.work_dir)
    teacher = work / "tiny-teacher"
    if not (teacher / "config.json").exists():
        write_tiny(teacher, TinyShape(family="qwen3_5_moe"))
    model, tokenizer = load(str(teacher))
    upcast_unquantized_experts_for_cpu(model)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 2?"}],
                                           add_generation_prompt=True)
    text = generate(model, tokenizer, prompt, max_tokens=16)
    print(f"teacher ({teacher}): {text!r}")
    return 0
