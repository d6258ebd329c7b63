"""`edge0-eval gate`: CI regression gate, comparing a report.json with a baseline report.json.

For every benchmark in the baseline whose two reports carry per-item outcomes, the current run
is paired with the baseline item by item (evaluation/paired.py: an exact McNemar-type test for
0/1 outcomes, a permutation test for graded ones), which is the run-to-run change the gate
judges:
  student drop   (baseline student - current student)  significant at a            -> FAIL
  gap increase   (current gap - baseline gap)          significant at a            -> FAIL
each at a = alpha / (2 x the baseline's benchmarks) (paired.per_test_alpha), so a run of
unchanged quality fails the benchmark part with probability at most alpha in all.
max_drop and max_gap_increase are the drops the gate must be able to see: when the drop
detectable at 80% power (at level a) is larger, or a benchmark's own drop (--benchmark-drop,
a gate config's sized drops) is, the check says so ("cannot see ...") and the summary counts
it, instead of passing quietly.
A baseline without per-item outcomes (made before they were recorded) is compared as before,
unpaired, with hw = the current report's 95% half-width of the teacher-student delta:
  gap increase > max_gap_increase + hw, student drop > max_drop + hw -> FAIL; regenerate it.
And always FAIL (never pass) when the benchmark is missing from the report, an arm is missing,
a task failed (OpenCompass shows '-' and still exits 0), details are absent or do not
reproduce the metric, the item count differs from the baseline, or the prompt version changed.
gap = teacher - student, in points. Both thresholds default to 2.0 points.
With fidelity in the baseline, one more check per arm (fidelity_report.gate_checks: KL rise and
agreement drop, each beyond its threshold plus the baseline's interval), named `fidelity ARM`.
With --sequential (a gate run in rounds, evaluation/gate_run.py) the paired tests are the
anytime-valid sequential tests of evaluation/gate_sequential.py, over the rounds' reports.
Exit status: 0 all pass, 1 regression or failure, 2 bad input, 3 sequential and undecided with
items left (run the next round).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field

from edge0_eval.arguments import value_types as ct
from edge0_eval.errors import Edge0Error
from edge0_eval.evaluation import fidelity_report, gate_sequential, paired
from edge0_eval.evaluation.gate_input import load_report
from edge0_eval.evaluation.report import SCHEMA
from edge0_eval.evaluation.settings import model_changes, settings_differences

DEFAULT_MAX_GAP_INCREASE = 2.0
DEFAULT_MAX_DROP = 2.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "report",
        metavar="REPORT.json",
        nargs="+",
        help="report.json from edge0-eval report; with --sequential, the "
        "reports of the rounds so far in round order (the last is judged)",
    )
    parser.add_argument(
        "--baseline",
        required=True,
        metavar="BASELINE.json",
        help="the report.json to compare against",
    )
    parser.add_argument(
        "--max-gap-increase",
        type=ct.nonneg_float,
        default=DEFAULT_MAX_GAP_INCREASE,
        metavar="P",
        help="the widening of teacher - student, in points, the "
        "gate must be able to detect (paired: a power statement; unpaired "
        "baseline: allowed beyond the half-width) (default "
        f"{DEFAULT_MAX_GAP_INCREASE})",
    )
    parser.add_argument(
        "--max-drop",
        type=ct.nonneg_float,
        default=DEFAULT_MAX_DROP,
        metavar="P",
        help="the drop of the student's score, in points, the gate must be able "
        "to detect (paired: a power statement; unpaired baseline: allowed "
        f"beyond the half-width) (default {DEFAULT_MAX_DROP})",
    )
    parser.add_argument(
        "--alpha",
        type=ct.float_range(0.0, 0.5, low_open=True),
        default=paired.DEFAULT_ALPHA,
        metavar="A",
        help="false-fail rate of the benchmark checks together on a run of "
        "unchanged quality; each of the 2 tests per benchmark runs at A / "
        f"(2 x benchmarks) (default {paired.DEFAULT_ALPHA})",
    )
    parser.add_argument(
        "--sequential",
        action="store_true",
        help="sequential tests that may stop after any round: each benchmark "
        "regressed, within its max drop, or undecided (exit 3: run the next "
        "round)",
    )
    parser.add_argument(
        "--benchmark-drop",
        action="append",
        default=[],
        metavar="NAME=P",
        type=ct.named(ct.float_range(0.0, 100.0, low_open=True)),
        help="the max drop and max gap increase of one benchmark, in points "
        "(e.g. 'MMLU-Pro=8'); repeatable; others take --max-drop and "
        "--max-gap-increase",
    )
    parser.add_argument(
        "--max-kl-rise",
        type=ct.nonneg_float,
        default=fidelity_report.DEFAULT_MAX_KL_RISE,
        metavar="NATS",
        help="fidelity: allowed KL rise per arm beyond the baseline's 95%% "
        f"half-width (default {fidelity_report.DEFAULT_MAX_KL_RISE})",
    )
    parser.add_argument(
        "--max-agreement-drop",
        type=ct.nonneg_float,
        default=fidelity_report.DEFAULT_MAX_AGREEMENT_DROP,
        metavar="P",
        help="fidelity: allowed top-1 agreement drop per arm, in points, beyond "
        "the baseline's 95%% half-width (default "
        f"{fidelity_report.DEFAULT_MAX_AGREEMENT_DROP})",
    )


def run(args: argparse.Namespace) -> int:
    for flag, value in (
        ("--max-gap-increase", args.max_gap_increase),
        ("--max-drop", args.max_drop),
        ("--max-kl-rise", args.max_kl_rise),
        ("--max-agreement-drop", args.max_agreement_drop),
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
    rounds = [load_report(path) for path in args.report]
    current, baseline = rounds[-1], load_report(args.baseline)
    paths, args.report = args.report, args.report[-1]
    first_round = (
        gate_sequential.check_rounds(paths, rounds) if args.sequential else None
    )
    if current["benchmarks"] and not baseline["benchmarks"]:
        # Every benchmark would show as "new" and pass ungated.
        raise Edge0Error(
            f"{args.baseline}: no benchmarks, but {args.report} has "
            f"{len(current['benchmarks'])}; regenerate the baseline with "
            f"`edge0-eval report` on runs that include them"
        )
    problems = settings_differences(_settings(current), "teacher", _settings(baseline))
    if problems:
        raise Edge0Error(
            f"{args.baseline}: made with other settings than {args.report}: "
            + "; ".join(problems)
            + "; gate against a baseline run with the same "
            "settings (or regenerate it)"
        )
    for path, report in ((args.baseline, baseline), (args.report, current)):
        if report["schema"] != SCHEMA:
            print(
                f"gate: note: {path} is a {report['schema']} report: it has no per-sample "
                f"records, open-thinking rule, data digests or model identity, so those are "
                f"not compared; regenerate it with `edge0-eval report` ({SCHEMA})"
            )
    for change in model_changes(_settings(current), _settings(baseline)):
        print(
            f"gate: note: model changed since the baseline (the change being judged): {change}"
        )
    checks = evaluate(
        current,
        baseline,
        args.max_gap_increase,
        args.max_drop,
        args.max_kl_rise,
        args.max_agreement_drop,
        alpha=args.alpha,
        first_round=first_round,
        drops=dict(args.benchmark_drop),
    )
    print(format_table(checks))
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
    arms = sum(c.benchmark.startswith("fidelity ") for c in checks)
    blind = [c.benchmark for c in checks if c.blind]
    if blind:
        print(
            f"gate: {len(blind)} check(s) cannot see the drop asked about ({', '.join(blind)}): "
            f"a pass there is not evidence of no regression; see 'cannot see' above"
        )
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
            f"{args.max_drop:g}, each plus the 95% half-width)"
        ]
        if unpaired_n
        else []
    )
    if arms:
        parts.append(
            f"fidelity of {arms} arms, max KL move {args.max_kl_rise:g} of the "
            f"baseline, max agreement drop {args.max_agreement_drop:g}, each plus the "
            f"paired change's half-width"
        )
    print(f"gate: pass ({len(checks) - arms} benchmarks: " + "; ".join(parts) + ")")
    if paired_n or sequential_n:
        print(
            f"gate: a run of unchanged quality fails the benchmark checks with probability at "
            f"most {args.alpha:g} in all (Bonferroni over the {tests} tests)"
        )
    return 0


def _settings(report: dict) -> dict:
    return {arm: entry.get("settings") for arm, entry in report.get("arms", {}).items()}


@dataclass
class Check:
    benchmark: str
    result: str = "pass"  # pass | FAIL | new (in the report only; not gated)
    reasons: list[str] = field(default_factory=list)
    items: tuple = (None, None)  # (baseline, current)
    gap: tuple = (None, None)
    student: tuple = (None, None)
    gap_increase: float | None = None
    drop: float | None = None
    half_width: float | None = None
    p_values: tuple = (None, None)  # paired: (student drop, gap increase)
    detectable: float | None = None  # paired: the student drop detected at 80% power
    blind: bool = False  # cannot see the drop it is asked about
    rule: str | None = None  # sequential: regressed | within | undecided
    pending: bool = False  # sequential: undecided with items left (next round)

    def fail(self, reason: str) -> None:
        self.result = "FAIL"
        self.reasons.append(reason)


def _arm_problems(row: dict) -> str:
    """Which arms are not ok, e.g. 'student failed', for a row whose status is not ok."""
    arms = row.get("arms", {})
    bad = [
        f"{arm} {arms[arm]['status'] if arm in arms else 'absent'}"
        for arm in ("teacher", "student")
        if arm not in arms or arms[arm]["status"] != "ok"
    ]
    return f"{row['status']}" + (f" ({', '.join(bad)})" if bad else "")


def _per_item(row: dict, arm: str) -> dict | None:
    items = row.get("arms", {}).get(arm, {}).get("per_item")
    return items if isinstance(items, dict) and items else None


def _paired_checks(
    check: Check,
    base: dict,
    cur: dict,
    max_gap_increase: float,
    max_drop: float,
    alpha: float,
) -> bool:
    """The paired tests of the module docstring; False when either report lacks per-item
    outcomes for both arms (then the unpaired comparison runs)."""
    outcomes = [
        _per_item(r, arm) for r in (base, cur) for arm in ("teacher", "student")
    ]
    if any(o is None for o in outcomes):
        return False
    bt, bs, ct_, cs = outcomes
    if set(bs) != set(cs):
        check.fail(
            f"item ids differ from the baseline's ({len(set(bs) ^ set(cs))} not shared)"
        )
        return True
    unpaired = gate_sequential.teacher_gaps(bt, bs, ct_, cs)
    if unpaired:
        check.fail(unpaired)
        return True
    student = paired.change(bs, cs, alpha)
    # Per item, student - teacher: its drop is the gap's widening.
    gap = paired.change(
        {i: bs[i] - bt[i] for i in bs}, {i: cs[i] - ct_[i] for i in cs}, alpha
    )
    check.drop, check.gap_increase = student.drop, gap.drop
    check.p_values, check.detectable = (
        (student.p_value, gap.p_value),
        student.detectable,
    )
    if student.p_value < alpha:
        check.fail(
            f"student dropped {student.drop:.2f} (paired on {student.items} items, "
            f"{student.test} p={student.p_value:.3g} < {alpha:g})"
        )
    if gap.p_value < alpha:
        check.fail(
            f"gap widened {gap.drop:+.2f} (paired, {gap.test} p={gap.p_value:.3g} "
            f"< {alpha:g})"
        )
    for what, asked, found in (
        ("drop", max_drop, student.detectable),
        ("gap widening", max_gap_increase, gap.detectable),
    ):
        if found is None or found > asked:
            check.blind = True
            seen = "none" if found is None else f"{found:.1f} points"
            check.reasons.append(
                f"cannot see a {asked:g}-point {what}: at 80% power this "
                f"sample detects {seen} (more items or samples would)"
            )
    return True


def _sequential_check(
    check: Check,
    base: dict,
    cur: dict,
    first_round: dict,
    max_gap_increase: float,
    max_drop: float,
    alpha: float,
) -> None:
    verdict = gate_sequential.check_benchmark(
        base,
        cur,
        first_round.get(base["benchmark"], {}),
        max_drop,
        max_gap_increase,
        alpha,
    )
    check.rule, check.drop, check.gap_increase = (
        verdict.rule,
        verdict.drop,
        verdict.gap_increase,
    )
    if (
        verdict.student[0] is not None
    ):  # both on the items seen so far, not the whole sample
        check.student, check.gap = verdict.student, verdict.gap
    check.blind = check.blind or (verdict.rule == "undecided" and verdict.exhausted)
    check.pending = verdict.rule == "undecided" and not verdict.exhausted
    check.reasons += verdict.notes
    for reason in verdict.failures:
        check.fail(reason)


def evaluate(
    current: dict,
    baseline: dict,
    max_gap_increase: float,
    max_drop: float,
    max_kl_rise: float = fidelity_report.DEFAULT_MAX_KL_RISE,
    max_agreement_drop: float = fidelity_report.DEFAULT_MAX_AGREEMENT_DROP,
    alpha: float = paired.DEFAULT_ALPHA,
    first_round: dict | None = None,
    drops: dict[str, float] | None = None,
) -> list[Check]:
    """The checks of every baseline benchmark; first_round (benchmark -> item -> round) makes
    them sequential, drops gives a benchmark its own max drop and max gap increase."""
    rows = {r["benchmark"]: r for r in current["benchmarks"]}
    checks = []
    level = paired.per_test_alpha(alpha, len(baseline["benchmarks"]))
    unknown = sorted(
        set(drops or {}) - {r["benchmark"] for r in baseline["benchmarks"]}
    )
    if unknown:
        raise Edge0Error(
            f"--benchmark-drop names {unknown}, not benchmarks of the baseline"
        )
    for base in baseline["benchmarks"]:
        check = Check(base["benchmark"])
        asked = (drops or {}).get(base["benchmark"])
        drop_asked, gap_asked = (
            (asked, asked) if asked else (max_drop, max_gap_increase)
        )
        checks.append(check)
        cur = rows.get(base["benchmark"])
        if cur is None:
            check.fail("missing from the report")
            continue
        check.items = (base["items"], cur["items"])
        check.gap = (base["gap"], cur["gap"])
        check.student = (base["student"], cur["student"])
        if base["status"] != "ok":
            check.fail(f"baseline not comparable: {_arm_problems(base)}")
        if cur["status"] != "ok":
            check.fail(_arm_problems(cur))
        if check.result == "FAIL":
            continue
        if cur["items"] != base["items"] and first_round is None:
            check.fail(f"{cur['items']} items, baseline {base['items']}")
        if base["version"] and cur["version"] and base["version"] != cur["version"]:
            check.fail(f"prompt version {cur['version']}, baseline {base['version']}")
        if asked and asked > min(max_drop, max_gap_increase):
            # The sample was sized for a larger drop than the one asked about: a pass (even
            # a decided `within`) says nothing about the smaller one.
            check.blind = True
            check.reasons.append(
                f"cannot see a {min(max_drop, max_gap_increase):g}-point drop: "
                f"this sample is sized for {asked:g} points"
            )
        if first_round is not None:
            _sequential_check(
                check, base, cur, first_round, gap_asked, drop_asked, level
            )
            continue
        if _paired_checks(check, base, cur, gap_asked, drop_asked, level):
            continue
        check.reasons.append(
            "unpaired: the baseline has no per-item outcomes (regenerate it "
            "with `edge0-eval report` to pair)"
        )
        # No interval (a single item) means no allowance for noise.
        hw = cur["delta_half_width"] or 0.0
        check.half_width = hw
        check.gap_increase = cur["gap"] - base["gap"]
        check.drop = base["student"] - cur["student"]
        if check.gap_increase > gap_asked + hw:
            check.fail(
                f"gap widened {check.gap_increase:+.2f} > {gap_asked:g} + {hw:.2f}"
            )
        if check.drop > drop_asked + hw:
            check.fail(f"student dropped {check.drop:.2f} > {drop_asked:g} + {hw:.2f}")
    known = {c.benchmark for c in checks}
    for name, row in rows.items():
        if name not in known:
            checks.append(
                Check(
                    name,
                    "new",
                    ["not in the baseline; not gated"],
                    (None, row["items"]),
                    (None, row["gap"]),
                    (None, row["student"]),
                )
            )
    for fc in fidelity_report.gate_checks(
        current, baseline, max_kl_rise, max_agreement_drop
    ):
        checks.append(Check(fc["name"], fc["result"], fc["reasons"], fc["items"]))
    return checks


def _f(value, signed: bool = False) -> str:
    if value is None:
        return "-"
    return f"{value:+.2f}" if signed else f"{value:.2f}"


def format_table(checks: list[Check]) -> str:
    header = [
        "benchmark",
        "items",
        "gap base",
        "gap now",
        "gap +",
        "student base",
        "student now",
        "drop",
        "+-hw",
        "p (drop, gap)",
        "detects",
        "result",
        "why",
    ]
    rows = [
        [
            c.benchmark,
            f"{c.items[0] if c.items[0] is not None else '-'}->"
            f"{c.items[1] if c.items[1] is not None else '-'}",
            _f(c.gap[0]),
            _f(c.gap[1]),
            _f(c.gap_increase, True),
            _f(c.student[0]),
            _f(c.student[1]),
            _f(c.drop, True),
            _f(c.half_width),
            ", ".join(f"{p:.3g}" for p in c.p_values)
            if c.p_values[0] is not None
            else "-",
            _f(c.detectable),
            c.result,
            "; ".join(c.reasons),
        ]
        for c in checks
    ]
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    lines = [
        "  ".join(str(v).ljust(w) for v, w in zip(r, widths)).rstrip()
        for r in [header] + rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
