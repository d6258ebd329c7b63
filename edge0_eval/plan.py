"""`edge0-eval plan CONFIG`: what an OpenCompass run of CONFIG will cost, before it starts
(evaluation/plan/planner.py); with --size-gate, the sample that fits a gate config's budget.

    edge0-eval plan configs/edge0_35b.py --tok-s 20
    edge0-eval plan configs/edge0_tiny.py --from outputs/demo/opencompass/20261203_101500
    edge0-eval plan configs/edge0_tiny_gate.py --size-gate
    edge0-eval plan configs/edge0_35b_gate.py --tok-s 20 --fidelity-rate bench.json
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from edge0_eval.arguments import value_types as ct
from edge0_eval.arguments.fields import add_fields, from_args, option
from edge0_eval.evaluation.plan.planner import (
    PlanOptions,
    make_plan,
    read_fidelity_rate,
    render,
    render_gate_size,
    size_gate,
)


@dataclass
class PlanFlags:
    """plan's flags besides PlanOptions' (evaluation/plan/planner.py), each declared once."""

    arm_tok_s: list[tuple[str, float]] = option(
        help="one arm's rate (model abbr=tokens/s); repeatable",
        factory=list,
        type=ct.named(ct.positive_float, "ABBR"),
        metavar="ABBR=R",
        action="append",
    )
    fidelity_rate: Path | None = option(
        None,
        "price fidelity (and, with --size-gate, the gate's fidelity part) at "
        "the rates a `fidelity bench --json FILE` run measured, prompts and "
        "positions apart; without it the plan says which rate it assumed",
        type=Path,
        metavar="FILE",
    )
    json_path: str | None = option(
        None, "also write the plan as JSON here", flag="--json", type=ct.output_file
    )
    size_gate: bool = option(
        False,
        "a gate config: print the sample (`samples`, `drops`) that fits "
        "its edge0_gate budget, to paste into the config",
    )
    size_tok_s: float | None = option(
        None,
        "with --size-gate: the student's tokens/s (default: measured by "
        "--from, else the config's edge0_gate tok_s)",
        type=ct.positive_float,
    )
    churn_from: Path | None = option(
        None,
        "with --size-gate: each benchmark's churn as this baseline of several "
        "runs (`gate-baseline`) measured it, instead of the config's declared churn",
        type=Path,
        metavar="BASELINE.json",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_fields(parser, PlanOptions)
    add_fields(parser, PlanFlags)


def run(args: argparse.Namespace) -> int:
    rate = (
        None if args.fidelity_rate is None else read_fidelity_rate(args.fidelity_rate)
    )
    if args.size_gate:
        size = size_gate(
            args.config,
            tok_s=args.size_tok_s,
            previous=args.previous,
            churn_from=args.churn_from,
            fidelity_rate=rate,
        )
        print(render_gate_size(size, f"edge0-eval plan {args.config} --size-gate"))
        return 0
    opts = from_args(
        PlanOptions, args, arm_tok_s=dict(args.arm_tok_s), fidelity_rate=rate
    )
    plan = make_plan(opts)
    print(render(plan))
    if args.json_path:
        Path(args.json_path).write_text(
            json.dumps(asdict(plan), indent=1), encoding="utf-8"
        )
    return 0
