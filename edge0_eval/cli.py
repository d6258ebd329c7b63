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

# verb -> one-line help; the verb's module is edge0_eval.<verb with "_" for "-">
_HELP = {
    "make-tiny": "write a tiny random-weight mlx-lm MoE checkpoint",
    "make-synthetic": "write a full-shape random checkpoint in streaming layout",
    "convert": "convert an mlx-lm checkpoint to the int4 streaming layout",
    "generate": "generate text with the streaming engine",
    "serve": "serve the engine over an OpenAI-compatible HTTP API",
    "bench": "benchmark the engine (arms interleaved in one process)",
    "init-prerouter": "write untrained prerouter heads (warm start)",
    "draft-vocab": "write a draft vocabulary (a draft-token hedge)",
    "train-prerouter": "stage 1: distil prerouter heads",
    "train-lora": "stage 2: student-path LoRA SFT",
    "distill": "stage 3: on-policy distillation",
    "data": "stage and verify OpenCompass benchmark data offline",
    "report": "teacher-vs-student gap report from OpenCompass outputs",
    "gate": "CI regression gate on a report",
    "gate-run": "run a gate config and gate it",
    "gate-baseline": "a gate baseline from several runs' reports",
    "fidelity": "make a teacher-forced fidelity set from a teacher",
    "plan": "what an OpenCompass run will cost: tokens, hours, power",
    "demo": "run the embedded default end to end",
    "testbed": "real-weight MoE testbed from SmolLM2",
}
# verb -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    verb: (f"edge0_eval.{verb.replace('-', '_')}", text) for verb, text in _HELP.items()
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
