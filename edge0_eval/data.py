"""`edge0-eval data stage|verify|fixtures --root ROOT`: lay out and verify OpenCompass's
benchmark data tree, offline (evaluation/data/: staging.py, checks.py)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from edge0_eval.arguments import value_types as ct
from edge0_eval.errors import ConfigError
from edge0_eval.evaluation.data.checks import Check, verify
from edge0_eval.evaluation.data.fixtures import write_fixtures
from edge0_eval.evaluation.data.staging import stage
from edge0_eval.evaluation.data_paths import BENCHMARKS, data_root


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    st = sub.add_parser(
        "stage", help="lay out the data tree under --root and verify it"
    )
    st.add_argument(
        "--root",
        required=True,
        type=ct.directory,
        help="data root (use it as COMPASS_DATA_CACHE)",
    )
    st.add_argument(
        "--aime2026", metavar="FILE", help="AIME 2026 jsonl to copy into place"
    )
    st.add_argument(
        "--gpqa", metavar="FILE", help="gpqa_diamond.csv to copy into place"
    )
    st.add_argument(
        "--mmlu-pro",
        metavar="PATH",
        nargs="+",
        help="MMLU-Pro parquet files, or a directory holding them",
    )
    st.add_argument(
        "--fidelity",
        metavar="FILE",
        help="a fidelity set from `edge0-eval "
        "fidelity make` to lay where configs/datasets/edge0_fidelity.py looks",
    )
    st.add_argument(
        "--nltk-data",
        metavar="DIR",
        help="an nltk_data directory holding averaged_perceptron_tagger_eng",
    )
    for p in (st, sub.add_parser("verify", help="check the data tree under --root")):
        if p is not st:
            p.add_argument(
                "--root",
                type=ct.directory,
                help="data root (default: $COMPASS_DATA_CACHE or CWD)",
            )
        p.add_argument(
            "--benchmarks",
            default=",".join(BENCHMARKS),
            type=ct.name_list,
            help=f"comma-separated subset of {','.join(BENCHMARKS)}",
        )
        p.add_argument(
            "--subset",
            action="store_true",
            help="accept fewer items than the full benchmarks (fixtures, smoke runs)",
        )
    fx = sub.add_parser(
        "fixtures", help="write the tiny fixture data tree for all benchmarks"
    )
    fx.add_argument("--root", required=True, type=ct.directory)


def _benchmarks(text: str) -> tuple[str, ...]:
    names = tuple(b.strip() for b in text.split(",") if b.strip())
    unknown = [b for b in names if b not in BENCHMARKS]
    if unknown:
        raise ConfigError(
            f"unknown benchmarks {unknown}; choose from {', '.join(BENCHMARKS)}"
        )
    return names


def _print_checks(checks: list[Check]) -> int:
    for c in checks:
        print(f"  [{'ok' if c.ok else 'MISSING'}] {c.benchmark}: {c.message}")
        for note in c.notes:
            print(f"      note: {note}")
    bad = [c.benchmark for c in checks if not c.ok]
    if bad:
        print(f"not ready: {', '.join(bad)}", file=sys.stderr)
        return 1
    print("ready")
    return 0


def run(args: argparse.Namespace) -> int:
    if args.action == "fixtures":
        for line in write_fixtures(args.root):
            print(line)
        return _print_checks(verify(args.root, BENCHMARKS, full=False))
    benchmarks = _benchmarks(args.benchmarks)
    if args.action == "verify":
        print(f"data root {data_root(args.root)}:")
        return _print_checks(verify(args.root, benchmarks, full=not args.subset))
    actions, checks = stage(
        args.root,
        benchmarks,
        aime2026=args.aime2026,
        gpqa=args.gpqa,
        mmlu_pro=args.mmlu_pro,
        nltk_data=args.nltk_data,
        full=not args.subset,
        fidelity=args.fidelity,
    )
    for line in actions:
        print(f"  {line}")
    print(
        f"data root {Path(args.root).resolve()} (export COMPASS_DATA_CACHE to use it):"
    )
    return _print_checks(checks)
