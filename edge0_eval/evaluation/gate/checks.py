"""The CI regression gate's checks (`edge0-eval gate`: gate.py), comparing a report.json with a
baseline report.json.

For every benchmark in the baseline whose two reports carry per-item outcomes, the current run
is paired with the baseline item by item (evaluation/significance/paired.py: an exact
McNemar-type test for 0/1 outcomes, a sign-flip test for graded ones; against a baseline of
several runs, `gate-baseline`, paired.baseline_change), which is the run-to-run change the gate
judges:
  student drop   (baseline student - current student)  significant at a            -> FAIL
  gap increase   (current gap - baseline gap)          significant at a            -> FAIL
each at a = alpha / (2 x the baseline's benchmarks) (paired.per_test_alpha), so a run of
unchanged quality fails these tests with probability at most alpha in all: averaged over
baselines when the baseline is one run (a lucky baseline run fails more often), and for all
but a share paired.BASELINE_RISK of baselines when it is several.
max_drop and max_gap_increase are the drops the gate must be able to see: when the drop
detectable at 80% power (at level a) is larger, or a benchmark's own drop (--benchmark-drop,
a gate config's sized drops) is, the check says so ("cannot see ...") and is counted blind:
`gate` then exits BLIND_EXIT unless told to accept it.
A baseline without per-item outcomes (made before they were recorded) is compared as before,
unpaired, with hw = the current report's 95% half-width of the teacher-student delta:
  gap increase > max_gap_increase + hw, student drop > max_drop + hw -> FAIL; regenerate it.
Those checks are not tests at a stated level: no false-fail rate is claimed for them.
And always FAIL (never pass) when the benchmark is missing from the report, an arm is missing,
a task failed (OpenCompass shows '-' and still exits 0), details are absent or do not
reproduce the metric, the item count differs from the baseline, or the prompt version changed.
gap = teacher - student, in points. Both thresholds default to 2.0 points.
With fidelity in the baseline, one more check per arm (gate/fidelity_checks.py: the mean KL
and agreement, and each prompt against its own tolerance), named `fidelity ARM`.
With --sequential (a gate run in rounds, gate_run.py) the paired tests are the anytime-valid
sequential tests of evaluation/gate/sequential_checks.py, over the rounds' reports.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from edge0_eval.errors import Edge0Error
from edge0_eval.evaluation.gate import fidelity_checks
from edge0_eval.evaluation.gate import sequential_checks as gate_sequential
from edge0_eval.evaluation.significance import paired, sequential

DEFAULT_MAX_GAP_INCREASE = 2.0
DEFAULT_MAX_DROP = 2.0
BLIND_EXIT = 4  # `gate`: nothing failed, but a check cannot see what it was asked to


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
    p_texts: tuple = ()  # paired: each test's p as printed (exact and mid-p beside it)
    detectable: float | None = None  # paired: the student drop detected at 80% power
    blind: bool = False  # cannot see the drop it is asked about
    rule: str | None = None  # sequential: regressed | within | undecided
    pending: bool = False  # sequential: undecided with items left (next round)
    allowance: str | None = None  # fidelity: what each rule allows, in its units

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


def _per_item(row: dict, arm: str, key: str = "per_item") -> dict | None:
    items = row.get("arms", {}).get(arm, {}).get(key)
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
    student, gap = gate_sequential.fixed_tests(bt, bs, ct_, cs, base, alpha)
    check.drop, check.gap_increase = student.drop, gap.drop
    check.p_values, check.detectable = (
        (student.p_value, gap.p_value),
        student.detectable,
    )
    check.p_texts = (student.p_text(named=False), gap.p_text(named=False))
    if student.p_value < alpha:
        check.fail(
            f"student dropped {student.drop:.2f} (paired on {student.items} items, "
            f"{student.p_text()} < {alpha:g})"
        )
    if gap.p_value < alpha:
        check.fail(f"gap widened {gap.drop:+.2f} (paired, {gap.p_text()} < {alpha:g})")
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


@dataclass(frozen=True)
class Rounds:
    """A sequential gate run's reports: each item's first round (benchmark -> item -> round),
    the run's order seed, the round judged, and the config's cumulative shares (None: the
    rounds' items are checked as prefixes of the seed's order only)."""

    first_round: dict
    seed: str
    number: int
    shares: list[float] | None = None


def _sequential_check(
    check: Check,
    base: dict,
    cur: dict,
    asked: tuple[float, float],
    alpha: float,
    rounds: Rounds,
    baseline: dict,
) -> None:
    drop_asked, gap_asked = asked
    wrong = gate_sequential.round_problems(
        baseline, base, cur, rounds.seed, rounds.number, rounds.shares
    )
    if wrong:
        check.fail(wrong)
        return
    verdict = gate_sequential.check_benchmark(
        base,
        cur,
        rounds.first_round.get(base["benchmark"], {}),
        drop_asked,
        gap_asked,
        alpha,
        rounds.seed,
    )
    check.rule, check.drop, check.gap_increase = (
        verdict.rule,
        verdict.drop,
        verdict.gap_increase,
    )
    if verdict.student[0] is not None:  # on the items seen so far, not the whole sample
        check.student, check.gap = verdict.student, verdict.gap
    check.blind = check.blind or (verdict.rule == "undecided" and verdict.exhausted)
    churn = (base.get("baseline_runs") or {}).get("churn")
    if churn is not None:
        # The threshold was sized at a declared churn; the baseline's runs measured it.
        seen = sequential.detectable_drop(
            base["items"], churn, None, sequential.sequential_alpha(alpha)
        )
        if seen is None or seen > drop_asked:
            check.blind = True
            check.reasons.append(
                f"cannot see a {drop_asked:g}-point drop at the churn the baseline's runs "
                f"measured ({100 * churn:.1f}%): the sequential rule catches "
                f"{'none' if seen is None else f'{seen:.1f} points'} at 80% power there "
                f"(re-size: `plan CONFIG --size-gate --churn-from BASELINE.json`)"
            )
    check.pending = verdict.rule == "undecided" and not verdict.exhausted
    check.reasons += verdict.notes
    for reason in verdict.failures:
        check.fail(reason)


def _unpaired_check(check: Check, base: dict, cur: dict, asked: tuple) -> None:
    """A baseline without per-item outcomes: the old half-width rule (no level claimed)."""
    drop_asked, gap_asked = asked
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
        check.fail(f"gap widened {check.gap_increase:+.2f} > {gap_asked:g} + {hw:.2f}")
    if check.drop > drop_asked + hw:
        check.fail(f"student dropped {check.drop:.2f} > {drop_asked:g} + {hw:.2f}")


def _benchmark_check(base, cur, asked, limits, level, rounds, baseline) -> Check:
    """One baseline benchmark's check; asked: the benchmark's own drop (or None), limits:
    (max drop, max gap increase)."""
    check = Check(base["benchmark"])
    drops = (asked, asked) if asked else limits
    if cur is None:
        check.fail("missing from the report")
        return check
    check.items = (base["items"], cur["items"])
    check.gap = (base["gap"], cur["gap"])
    check.student = (base["student"], cur["student"])
    if base["status"] != "ok":
        check.fail(f"baseline not comparable: {_arm_problems(base)}")
    if cur["status"] != "ok":
        check.fail(_arm_problems(cur))
    if check.result == "FAIL":
        return check
    if cur["items"] != base["items"] and rounds is None:
        check.fail(f"{cur['items']} items, baseline {base['items']}")
    if base["version"] and cur["version"] and base["version"] != cur["version"]:
        check.fail(f"prompt version {cur['version']}, baseline {base['version']}")
    if asked and asked > min(limits):
        # The sample was sized for a larger drop than the one asked about: a pass (even
        # a decided `within`) says nothing about the smaller one.
        check.blind = True
        check.reasons.append(
            f"cannot see a {min(limits):g}-point drop: this sample is sized for "
            f"{asked:g} points"
        )
    if rounds is not None:
        _sequential_check(check, base, cur, drops, level, rounds, baseline)
    elif not _paired_checks(check, base, cur, drops[1], drops[0], level):
        _unpaired_check(check, base, cur, drops)
    return check


def evaluate(
    current: dict,
    baseline: dict,
    max_gap_increase: float,
    max_drop: float,
    fidelity: fidelity_checks.Tolerances = fidelity_checks.Tolerances(),
    alpha: float = paired.DEFAULT_ALPHA,
    rounds: Rounds | None = None,
    drops: dict[str, float] | None = None,
) -> list[Check]:
    """The checks of every baseline benchmark, then the new ones and fidelity's; rounds makes
    them sequential (gate.py), drops gives a benchmark its own max drop and max gap
    increase."""
    rows = {r["benchmark"]: r for r in current["benchmarks"]}
    level = paired.per_test_alpha(alpha, len(baseline["benchmarks"]))
    names = [r["benchmark"] for r in baseline["benchmarks"]]
    unknown = sorted(set(drops or {}) - set(names))
    if unknown:
        raise Edge0Error(
            f"--benchmark-drop names {unknown}, not benchmarks of the baseline"
        )
    checks = [
        _benchmark_check(
            base,
            rows.get(base["benchmark"]),
            (drops or {}).get(base["benchmark"]),
            (max_drop, max_gap_increase),
            level,
            rounds,
            baseline,
        )
        for base in baseline["benchmarks"]
    ]
    for name, row in rows.items():
        if name not in names:
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
    for fc in fidelity_checks.gate_checks(current, baseline, fidelity):
        checks.append(Check(fc["name"], fc["result"], fc["reasons"], fc["items"]))
        checks[-1].blind, checks[-1].allowance = fc.get("blind"), fc.get("allowance")
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
        "p (drop; gap)",
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
            "; ".join(c.p_texts)
            if c.p_texts
            else ", ".join(f"{p:.3g}" for p in c.p_values)
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
