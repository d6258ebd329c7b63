"""`edge0-eval report OUTPUTS... --out DIR`: teacher-vs-student gap report from OpenCompass
output folders (evaluation/report/gap.py); exit 1 when a part is missing or failed."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from edge0_eval.arguments import value_types as ct
from edge0_eval.errors import ConfigError
from edge0_eval.evaluation.outputs.runs import expand_outputs, load_run
from edge0_eval.evaluation.report.arms import model_index, parse_arms
from edge0_eval.evaluation.report.definitions import load_reference
from edge0_eval.evaluation.report.gap import build_report
from edge0_eval.evaluation.report.writers import write_report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "outputs",
        nargs="+",
        metavar="OUTPUTS",
        help="OpenCompass output folders: a run (<work_dir>/<timestamp>) or a "
        "work_dir (its latest run); teacher and student may be in "
        "different ones",
    )
    parser.add_argument(
        "--out",
        required=True,
        metavar="DIR",
        type=ct.directory,
        help="folder for report.md, report.csv, report.json, report.png and the "
        "page report.html",
    )
    parser.add_argument(
        "--arms",
        metavar="NAME=ABBR,...",
        help="model abbr per arm: teacher, student (prerouted + LoRA), and "
        "optionally int4_exact, prerouted_nolora. Default: the two models "
        "found, the one whose abbr contains 'teacher' as teacher",
    )
    parser.add_argument(
        "--reference",
        metavar="FILE",
        help="published numbers to show as extra columns "
        "(e.g. reports/reference/edge0_35b.json)",
    )


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ConfigError(
            f"--out {out} is a file; --out names a folder for report.md, "
            f"report.csv, report.json and report.png"
        )
    runs = [load_run(p) for p in expand_outputs(args.outputs)]
    reference = load_reference(args.reference) if args.reference else None
    command = command_line(args)
    report = build_report(
        runs, parse_arms(args.arms, model_index(runs)), reference, command
    )
    write_report(report, out)
    bad = [
        f"{b['benchmark']}: {b['status']}"
        for b in report["benchmarks"]
        if b["status"] != "ok"
    ]
    fidelity = report.get("fidelity")
    if fidelity is not None and fidelity.get("status") != "ok":
        bad.append(f"fidelity: {fidelity.get('status')}")
    if not report["benchmarks"] and fidelity is None:
        bad = ["no benchmark or fidelity results found"]
    print(
        f"wrote {out}/report.{{md,csv,json,png}}"
        + (f"; not ok: {', '.join(bad)}" if bad else "")
    )
    print(f"page: {out / 'report.html'} (one file, opens offline in a browser)")
    if bad:
        # Missing or failed results must not look like a finished report to a script.
        print("edge0-eval report: incomplete (see the notes in report.md); exit 1")
        return 1
    return 0


def command_line(args: argparse.Namespace) -> str:
    parts = ["edge0-eval", "report", *args.outputs, "--out", args.out]
    if args.arms:
        parts += ["--arms", args.arms]
    if args.reference:
        parts += ["--reference", args.reference]
    return shlex.join(parts)
