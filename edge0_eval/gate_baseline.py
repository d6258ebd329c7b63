"""`edge0-eval gate-baseline REPORT.json... --out BASELINE.json`: a gate baseline from several
runs of one gate config (evaluation/gate/baselines.py): per item the mean of the runs and each run's
score, and the baseline's own spread, printed and kept in the file.
"""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path

from edge0_eval.arguments import value_types as ct
from edge0_eval.evaluation.gate.baselines import combine, spread_lines
from edge0_eval.evaluation.gate.inputs import load_report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "reports",
        metavar="REPORT.json",
        nargs="+",
        help="the reports of two or more whole runs of one gate config (`gate-run "
        "CONFIG --baseline none`, each in its own work folder)",
    )
    parser.add_argument(
        "--out",
        required=True,
        type=ct.output_file,
        metavar="BASELINE.json",
        help="the baseline report to write (give it to `gate --baseline`)",
    )


def run(args: argparse.Namespace) -> int:
    reports = [load_report(path) for path in args.reports]
    command = shlex.join(
        ["edge0-eval", "gate-baseline", *args.reports, "--out", args.out]
    )
    baseline = combine(list(args.reports), reports, command)
    Path(args.out).write_text(json.dumps(baseline, indent=1), encoding="utf-8")
    print(f"gate-baseline: {len(reports)} runs -> {args.out}")
    for line in spread_lines(baseline):
        print(f"  {line}")
    return 0
