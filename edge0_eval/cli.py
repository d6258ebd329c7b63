"""`edge0-eval` command line: one verb per module, imported only when used.

Each command module exposes `add_arguments(parser)` and `run(args) -> int`.
Keeping imports lazy keeps `edge0-eval --help` fast and lets a verb whose
optional dependency is missing fail alone, with its own message.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from edge0_eval.errors import Edge0Error

# verb -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "make-tiny": (
        "edge0_eval.make_tiny",
        "write a tiny random-weight mlx-lm MoE checkpoint",
    ),
    "make-synthetic": (
        "edge0_eval.make_synthetic",
        "write a full-shape random checkpoint in streaming layout",
    ),
    "convert": (
        "edge0_eval.convert",
        "convert an mlx-lm checkpoint to the int4 streaming layout",
    ),
    "generate": ("edge0_eval.generate", "generate text with the streaming engine"),
    "serve": (
        "edge0_eval.serve",
        "serve the engine over an OpenAI-compatible HTTP API",
    ),
    "bench": (
        "edge0_eval.bench",
        "benchmark the engine (arms interleaved in one process)",
    ),
    "init-prerouter": (
        "edge0_eval.init_prerouter",
        "write untrained prerouter heads (warm start)",
    ),
    "draft-vocab": (
        "edge0_eval.draft_vocab",
        "write a draft vocabulary (a draft-token hedge)",
    ),
    "train-prerouter": (
        "edge0_eval.train_prerouter",
        "stage 1: distil prerouter heads",
    ),
    "train-lora": ("edge0_eval.train_lora", "stage 2: student-path LoRA SFT"),
    "distill": ("edge0_eval.distill", "stage 3: on-policy distillation"),
    "data": (
        "edge0_eval.data",
        "stage and verify OpenCompass benchmark data offline",
    ),
    "report": (
        "edge0_eval.report",
        "teacher-vs-student gap report from OpenCompass outputs",
    ),
    "gate": ("edge0_eval.gate", "CI regression gate on a report"),
    "gate-run": ("edge0_eval.gate_run", "run a gate config and gate it"),
    "gate-baseline": (
        "edge0_eval.gate_baseline",
        "a gate baseline from several runs' reports",
    ),
    "fidelity": (
        "edge0_eval.fidelity",
        "make a teacher-forced fidelity set from a teacher",
    ),
    "plan": (
        "edge0_eval.plan",
        "what an OpenCompass run will cost: tokens, hours, power",
    ),
    "demo": ("edge0_eval.demo", "run the embedded default end to end"),
    "testbed": (
        "edge0_eval.testbed",
        "real-weight MoE testbed from SmolLM2",
    ),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="edge0-eval",
        description="Edge0 SSD-streaming MoE engine and OpenCompass evaluation plugin.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def _available(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        parser = build_parser()
        if argv and argv[0] not in ("-h", "--help"):
            parser.print_usage(sys.stderr)
            print(
                f"edge0-eval: unknown command {argv[0]!r}; choose from {', '.join(COMMANDS)}",
                file=sys.stderr,
            )
            return 2
        parser.print_help()
        return 0
    name, rest = argv[0], argv[1:]
    module_name, help_text = COMMANDS[name]
    if not _available(module_name):
        print(
            f"edge0-eval {name}: not implemented in this build ({module_name} is missing)",
            file=sys.stderr,
        )
        return 2
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(prog=f"edge0-eval {name}", description=help_text)
    module.add_arguments(parser)
    args = parser.parse_args(rest)
    try:
        return int(module.run(args) or 0)
    except Edge0Error as exc:
        print(f"edge0-eval {name}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        # Results are written whole at the end (atomic renames), so an interrupted verb leaves
        # no partial file to mistake for a result; a traceback would only hide that.
        print(
            f"edge0-eval {name}: interrupted; nothing partial was written (outputs are "
            f"renamed into place only when complete)",
            file=sys.stderr,
        )
        return 130


if __name__ == "__main__":
    sys.exit(main())
