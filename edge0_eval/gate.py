"""`edge0-eval gate REPORT.json --baseline BASELINE.json`: CI regression gate, comparing a
report.json with a baseline report.json (the checks: evaluation/gate/checks.py).

Exit status: 0 all pass, 1 regression or failure, 2 bad input, 3 sequential and undecided with
items left (run the next round), 4 nothing failed but a check cannot see the drop it was asked
about (gate.checks.BLIND_EXIT; --accept-blind turns it into a pass that says so).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from edge0_eval.arguments import value_types as ct
from edge0_eval.arguments.fields import add_fields, option
from edge0_eval.errors import Edge0Error
from edge0_eval.evaluation.gate import fidelity_checks
from edge0_eval.evaluation.gate import sequential_checks as gate_sequential
from edge0_eval.evaluation.gate.baselines import spread_lines
from edge0_eval.evaluation.gate.checks import (
    BLIND_EXIT,
    DEFAULT_MAX_DROP,
    DEFAULT_MAX_GAP_INCREASE,
    Rounds,
    evaluate,
    format_table,
)
from edge0_eval.evaluation.gate.inputs import load_report
from edge0_eval.evaluation.gate.rounds import check_rounds
from edge0_eval.evaluation.outputs.settings import baseline_differences, model_changes
from edge0_eval.evaluation.report.gap import SCHEMA
from edge0_eval.evaluation.significance import paired


def _share_list(text: str) -> list[float]:
    return [ct.positive_float(f) for f in text.split(",")]


@dataclass
class GateOptions:
    """The gate's flags, each declared once."""

    report: list[str] = option(
        help="report.json from edge0-eval report; with --sequential, the reports of the "
        "rounds so far in round order (the last is judged)",
        flag="report",
        metavar="REPORT.json",
        nargs="+",
    )
    baseline: str = option(
        help="the report.json to compare against",
        required=True,
        metavar="BASELINE.json",
    )
    max_gap_increase: float = option(
        DEFAULT_MAX_GAP_INCREASE,
        "the widening of teacher - student, in points, the gate must be able to detect "
        "(paired: a power statement; unpaired baseline: allowed beyond the half-width) "
        f"(default {DEFAULT_MAX_GAP_INCREASE})",
        type=ct.nonneg_float,
        metavar="P",
    )
    max_drop: float = option(
        DEFAULT_MAX_DROP,
        "the drop of the student's score, in points, the gate must be able to detect "
        "(paired: a power statement; unpaired baseline: allowed beyond the half-width) "
        f"(default {DEFAULT_MAX_DROP})",
        type=ct.nonneg_float,
        metavar="P",
    )
    alpha: float = option(
        paired.DEFAULT_ALPHA,
        "false-fail rate of the benchmark checks together on a run of unchanged "
        "quality; each of the 2 tests per benchmark runs at A / (2 x benchmarks) "
        f"(default {paired.DEFAULT_ALPHA})",
        type=ct.float_range(0.0, 0.5, low_open=True),
        metavar="A",
    )
    sequential: bool = option(
        False,
        "sequential tests that may stop after any round: each benchmark regressed, "
        "within its max drop, or undecided (exit 3: run the next round)",
    )
    benchmark_drop: list = option(
        help="the max drop and max gap increase of one benchmark, in points (e.g. "
        "'MMLU-Pro=8'); repeatable; others take --max-drop and --max-gap-increase",
        factory=list,
        action="append",
        metavar="NAME=P",
        type=ct.named(ct.float_range(0.0, 100.0, low_open=True)),
    )
    max_kl_rise: float = option(
        fidelity_checks.DEFAULT_MAX_KL_RISE,
        "fidelity: allowed move of an arm's mean KL, either way, as a share of the "
        "baseline's, or the noise of the mean a baseline of several runs measured if "
        f"larger (default {fidelity_checks.DEFAULT_MAX_KL_RISE})",
        type=ct.nonneg_float,
        metavar="R",
    )
    max_agreement_drop: float = option(
        fidelity_checks.DEFAULT_MAX_AGREEMENT_DROP,
        "fidelity: allowed drop of an arm's mean top-1 agreement, in points "
        f"(default {fidelity_checks.DEFAULT_MAX_AGREEMENT_DROP})",
        type=ct.nonneg_float,
        metavar="P",
    )
    prompt_kl_rise: float = option(
        fidelity_checks.DEFAULT_PROMPT_KL_RISE,
        "fidelity: a prompt is past its tolerance when its KL rises by more than R x "
        "its baseline KL (at least the arm's mean allowance) "
        f"(default {fidelity_checks.DEFAULT_PROMPT_KL_RISE})",
        type=ct.nonneg_float,
        metavar="R",
    )
    prompt_agreement_drop: float = option(
        fidelity_checks.DEFAULT_PROMPT_AGREEMENT_DROP,
        "fidelity: ... or its agreement drops by more than P points "
        f"(default {fidelity_checks.DEFAULT_PROMPT_AGREEMENT_DROP})",
        type=ct.nonneg_float,
        metavar="P",
    )
    max_prompts_past: float = option(
        fidelity_checks.DEFAULT_MAX_PROMPTS_PAST,
        "fidelity: an arm fails when more than floor(Q x prompts) prompts are past "
        f"their tolerance (default {fidelity_checks.DEFAULT_MAX_PROMPTS_PAST})",
        type=ct.float_range(0.0, 1.0),
        metavar="Q",
    )
    accept_blind: bool = option(
        False,
        "pass (exit 0) when nothing failed but a check cannot see the drop it was asked "
        f"about; without it that exits {BLIND_EXIT}",
    )
    rounds: list[float] | None = option(
        None,
        "--sequential: the config's cumulative round shares (gate-run passes them), so "
        "each round is checked to hold exactly the items its share gives; without it, a "
        "prefix of the run's order",
        type=_share_list,
        metavar="F,...",
    )
    order_seed: str | None = option(
        None,
        "--sequential: the gate run's order seed (gate-run draws it before round 1 and "
        "passes it; it is in WORK/order_seed.txt)",
        metavar="SEED",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_fields(parser, GateOptions)


def _check_args(args: argparse.Namespace) -> None:
    for flag, value in (
        ("--max-gap-increase", args.max_gap_increase),
        ("--max-drop", args.max_drop),
        ("--max-kl-rise", args.max_kl_rise),
        ("--max-agreement-drop", args.max_agreement_drop),
        ("--prompt-kl-rise", args.prompt_kl_rise),
        ("--prompt-agreement-drop", args.prompt_agreement_drop),
    ):
        if not (math.isfinite(value) and value >= 0):
            raise Edge0Error(f"{flag} {value}: must be a finite number >= 0")
    if args.sequential and not (
        0 < args.max_drop <= 100 and 0 < args.max_gap_increase <= 100
    ):
        raise Edge0Error(
            "--sequential decides 'within' a max drop: --max-drop and "
            "--max-gap-increase must be in (0, 100] points"
        )
    if len(args.report) > 1 and not args.sequential:
        raise Edge0Error(
            "several reports are the rounds of a sequential gate run: pass "
            "--sequential (or one report)"
        )
    if args.sequential and not (args.order_seed and args.order_seed.isalnum()):
        raise Edge0Error(
            "--sequential needs --order-seed SEED (letters and digits): the order the "
            "gate run took its sample in, which `gate-run --sequential` drew and wrote to "
            "WORK/order_seed.txt"
        )
    if not args.sequential and (args.order_seed is not None or args.rounds):
        raise Edge0Error(
            "--order-seed and --rounds describe a sequential run: pass --sequential"
        )


def _check_arms(args: argparse.Namespace, baseline: dict, current: dict) -> None:
    """Fail closed at the arm level: every arm the gate judges (teacher and student for the
    benchmarks, each fidelity arm of the baseline) has settings in both reports' `arms`."""
    judged = {"teacher", "student"} if baseline["benchmarks"] else set()
    judged |= set((baseline.get("fidelity") or {}).get("arms") or {})
    for path, report in ((args.baseline, baseline), (args.report, current)):
        missing = sorted(a for a in judged if _settings(report).get(a) is None)
        if missing:
            raise Edge0Error(
                f"{path}: arm(s) {missing} have no settings in its 'arms', so the gate "
                f"cannot verify they were run like the other report's; make it again with "
                f"`edge0-eval report` (several runs: then `edge0-eval gate-baseline`)"
            )


def _check_settings(args: argparse.Namespace, baseline: dict, current: dict) -> None:
    if current["benchmarks"] and not baseline["benchmarks"]:
        # Every benchmark would show as "new" and pass ungated.
        raise Edge0Error(
            f"{args.baseline}: no benchmarks, but {args.report} has "
            f"{len(current['benchmarks'])}; regenerate the baseline with "
            f"`edge0-eval report` on runs that include them"
        )
    _check_arms(args, baseline, current)
    problems = baseline_differences(
        _settings(current), _settings(baseline), part=args.sequential
    )
    if problems:
        raise Edge0Error(
            f"{args.baseline}: cannot be verified as made with the settings of "
            f"{args.report}: "
            + "; ".join(problems)
            + "; gate against a baseline run with the same settings, both reports made "
            "by this `edge0-eval report` from runs with their config dumps"
        )


def _notes(args: argparse.Namespace, baseline: dict, current: dict) -> None:
    for path, report in ((args.baseline, baseline), (args.report, current)):
        if report["schema"] != SCHEMA:
            print(
                f"gate: note: {path} is a {report['schema']} report: it has no per-sample "
                f"records, open-thinking rule or model identity, so those are not "
                f"compared; regenerate it with `edge0-eval report` ({SCHEMA})"
            )
    for change in model_changes(_settings(current), _settings(baseline)):
        print(
            f"gate: note: model changed since the baseline (the change being judged): {change}"
        )
    if args.sequential:
        print(f"gate: order seed {args.order_seed} (the run's order of its sample)")
    spread = spread_lines(baseline)
    if spread:
        print(
            f"gate: baseline of {baseline['baseline']['runs']} runs; its own spread: "
            + "; ".join(spread)
        )


def run(args: argparse.Namespace) -> int:
    _check_args(args)
    baseline = load_report(args.baseline)
    rounds = [load_report(path) for path in args.report]
    current = rounds[-1]
    paths, args.report = args.report, args.report[-1]
    rounds = (
        Rounds(
            gate_sequential.check_rounds(paths, rounds),
            args.order_seed,
            len(paths),
            check_rounds(args.rounds) if args.rounds else None,
        )
        if args.sequential
        else None
    )
    _check_settings(args, baseline, current)
    _notes(args, baseline, current)
    checks = evaluate(
        current,
        baseline,
        args.max_gap_increase,
        args.max_drop,
        fidelity_checks.Tolerances(
            args.max_kl_rise,
            args.max_agreement_drop,
            args.prompt_kl_rise,
            args.prompt_agreement_drop,
            args.max_prompts_past,
        ),
        alpha=args.alpha,
        rounds=rounds,
        drops=dict(args.benchmark_drop),
    )
    print(format_table(checks))
    return _verdict(args, checks, baseline)


def _verdict(args: argparse.Namespace, checks: list, baseline: dict) -> int:
    failed = [c.benchmark for c in checks if c.result == "FAIL"]
    if failed:
        print(f"gate: FAIL ({len(failed)} of {len(checks)}: {', '.join(failed)})")
        return 1
    pending = [c.benchmark for c in checks if c.pending]
    if pending:
        print(
            f"gate: undecided ({', '.join(pending)}): no benchmark regressed so far; run the "
            f"next round"
        )
        return gate_sequential.UNDECIDED_EXIT
    _summary(args, checks, baseline)
    blind = [c.benchmark for c in checks if c.blind]
    if blind:
        print(
            f"gate: {len(blind)} check(s) cannot see the drop asked about ({', '.join(blind)}): "
            f"a pass there is not evidence of no regression; see 'cannot see' above"
        )
        if not args.accept_blind:
            print(
                f"gate: BLIND (exit {BLIND_EXIT}): nothing failed, but not every check can "
                f"see what it was asked; ask about what the sample can see (--max-drop, "
                f"--benchmark-drop), size the sample for it, or pass --accept-blind"
            )
            return BLIND_EXIT
    return 0


def _summary(args: argparse.Namespace, checks: list, baseline: dict) -> None:
    """The pass line: what each kind of check judged, and the false-fail rate it holds."""
    arms = sum(c.benchmark.startswith("fidelity ") for c in checks)
    paired_n = sum(c.p_values[0] is not None for c in checks)
    sequential_n = sum(c.rule is not None for c in checks)
    unpaired_n = len(checks) - arms - paired_n - sequential_n
    tests = 2 * len(baseline["benchmarks"])
    level = (
        f"each test at {paired.per_test_alpha(args.alpha, len(baseline['benchmarks'])):.3g}"
        f" = alpha {args.alpha:g} / {tests} tests"
    )
    parts = [f"{paired_n} paired with the baseline, {level}"] if paired_n else []
    parts += (
        [
            f"{sequential_n} sequential, {level} ("
            f"{sum(c.rule == 'within' for c in checks)} decided within their max drop)"
        ]
        if sequential_n
        else []
    )
    parts += (
        [
            f"{unpaired_n} unpaired (max gap increase {args.max_gap_increase:g}, max drop "
            f"{args.max_drop:g}, each plus the 95% half-width; no false-fail rate is "
            f"claimed for these)"
        ]
        if unpaired_n
        else []
    )
    if arms:
        parts.append(
            f"fidelity of {arms} arms: "
            + "; ".join(
                f"{c.benchmark[9:]}: {c.allowance}" for c in checks if c.allowance
            )
        )
    print(f"gate: pass ({len(checks) - arms} benchmarks: " + "; ".join(parts) + ")")
    if paired_n or sequential_n:
        runs = (baseline.get("baseline") or {}).get("runs")
        which = (
            f"for all but {100 * paired.BASELINE_RISK:g}% of baselines of {runs} runs"
            if runs and paired_n
            else "on average over baselines (a one-run baseline's own luck is in every "
            "verdict against it: make it from several runs with `edge0-eval "
            "gate-baseline`)"
        )
        print(
            f"gate: a run of unchanged quality fails the {paired_n + sequential_n} "
            f"paired or sequential check(s) with probability at most {args.alpha:g} in "
            f"all (Bonferroni over the {tests} tests), {which}"
            + (
                f"; the {unpaired_n} unpaired check(s) are not covered"
                if unpaired_n
                else ""
            )
        )


def _settings(report: dict) -> dict:
    return {arm: entry.get("settings") for arm, entry in report.get("arms", {}).items()}
