"""`edge0-eval gate`: CI regression gate, comparing a report.json with a baseline report.json.

For every benchmark in the baseline whose two reports carry per-item outcomes, the current run
is paired with the baseline item by item (evaluation/paired.py: an exact McNemar-type test for
0/1 outcomes, a permutation test for graded ones), which is the run-to-run change the gate
judges:
  student drop   (baseline student - current student)  significant at alpha        -> FAIL
  gap increase   (current gap - baseline gap)          significant at alpha        -> FAIL
so a run of unchanged quality fails with probability alpha. max_drop and max_gap_increase are
the drops the gate must be able to see: when the drop detectable at 80% power is larger, the
check says so ("cannot see ...") and the summary counts it, instead of passing quietly.
A baseline without per-item outcomes (made before they were recorded) is compared as before,
unpaired, with hw = the current report's 95% half-width of the teacher-student delta:
  gap increase > max_gap_increase + hw, student drop > max_drop + hw -> FAIL; regenerate it.
And always FAIL (never pass) when the benchmark is missing from the report, an arm is missing,
a task failed (OpenCompass shows '-' and still exits 0), details are absent or do not
reproduce the metric, the item count differs from the baseline, or the prompt version changed.
gap = teacher - student, in points. Both thresholds default to 2.0 points.
With fidelity in the baseline, one more check per arm (fidelity_report.gate_checks: KL rise and
agreement drop, each beyond its threshold plus the baseline's interval), named `fidelity ARM`.
Exit status: 0 all pass, 1 regression or failure, 2 bad input.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field
from pathlib import Path

from edge0_eval import cli_types as ct
from edge0_eval.errors import Edge0Error
from edge0_eval.evaluation import fidelity_report, paired
from edge0_eval.evaluation.predictions import strict_loads
from edge0_eval.evaluation.report import OLD_SCHEMAS, SCHEMA
from edge0_eval.evaluation.settings import model_changes, settings_differences

DEFAULT_MAX_GAP_INCREASE = 2.0
DEFAULT_MAX_DROP = 2.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("report", metavar="REPORT.json", help="report.json from edge0-eval report")
    parser.add_argument("--baseline", required=True, metavar="BASELINE.json",
                        help="the report.json to compare against")
    parser.add_argument("--max-gap-increase", type=ct.nonneg_float,
                        default=DEFAULT_MAX_GAP_INCREASE,
                        metavar="P", help="the widening of teacher - student, in points, the "
                        "gate must be able to detect (paired: a power statement; unpaired "
                        "baseline: allowed beyond the half-width) (default "
                        f"{DEFAULT_MAX_GAP_INCREASE})")
    parser.add_argument("--max-drop", type=ct.nonneg_float, default=DEFAULT_MAX_DROP, metavar="P",
                        help="the drop of the student's score, in points, the gate must be able "
                        "to detect (paired: a power statement; unpaired baseline: allowed "
                        f"beyond the half-width) (default {DEFAULT_MAX_DROP})")
    parser.add_argument("--alpha", type=ct.float_range(0.0, 0.5, low_open=True),
                        default=paired.DEFAULT_ALPHA, metavar="A",
                        help="false-fail rate of each paired check on a run of unchanged "
                        f"quality (default {paired.DEFAULT_ALPHA})")
    parser.add_argument("--max-kl-rise", type=ct.nonneg_float,
                        default=fidelity_report.DEFAULT_MAX_KL_RISE, metavar="NATS",
                        help="fidelity: allowed KL rise per arm beyond the baseline's 95%% "
                        f"half-width (default {fidelity_report.DEFAULT_MAX_KL_RISE})")
    parser.add_argument("--max-agreement-drop", type=ct.nonneg_float,
                        default=fidelity_report.DEFAULT_MAX_AGREEMENT_DROP, metavar="P",
                        help="fidelity: allowed top-1 agreement drop per arm, in points, beyond "
                        "the baseline's 95%% half-width (default "
                        f"{fidelity_report.DEFAULT_MAX_AGREEMENT_DROP})")


def run(args: argparse.Namespace) -> int:
    for flag, value in (("--max-gap-increase", args.max_gap_increase),
                        ("--max-drop", args.max_drop), ("--max-kl-rise", args.max_kl_rise),
                        ("--max-agreement-drop", args.max_agreement_drop)):
        if not (math.isfinite(value) and value >= 0):
            raise Edge0Error(f"{flag} {value}: must be a finite number >= 0")
    current, baseline = load_report(args.report), load_report(args.baseline)
    if current["benchmarks"] and not baseline["benchmarks"]:
        # Every benchmark would show as "new" and pass ungated.
        raise Edge0Error(f"{args.baseline}: no benchmarks, but {args.report} has "
                         f"{len(current['benchmarks'])}; regenerate the baseline with "
                         f"`edge0-eval report` on runs that include them")
    problems = settings_differences(_settings(current), "teacher", _settings(baseline))
    if problems:
        raise Edge0Error(f"{args.baseline}: made with other settings than {args.report}: "
                         + "; ".join(problems) + "; gate against a baseline run with the same "
                         "settings (or regenerate it)")
    for path, report in ((args.baseline, baseline), (args.report, current)):
        if report["schema"] != SCHEMA:
            print(f"gate: note: {path} is a {report['schema']} report: it has no per-sample "
                  f"records, open-thinking rule, data digests or model identity, so those are "
                  f"not compared; regenerate it with `edge0-eval report` ({SCHEMA})")
    for change in model_changes(_settings(current), _settings(baseline)):
        print(f"gate: note: model changed since the baseline (the change being judged): {change}")
    checks = evaluate(current, baseline, args.max_gap_increase, args.max_drop,
                      args.max_kl_rise, args.max_agreement_drop, alpha=args.alpha)
    print(format_table(checks))
    failed = [c.benchmark for c in checks if c.result == "FAIL"]
    if failed:
        print(f"gate: FAIL ({len(failed)} of {len(checks)}: {', '.join(failed)})")
        return 1
    arms = sum(c.benchmark.startswith("fidelity ") for c in checks)
    blind = [c.benchmark for c in checks if c.blind]
    if blind:
        print(f"gate: {len(blind)} check(s) cannot see the drop asked about ({', '.join(blind)}): "
              f"a pass there is not evidence of no regression; see 'cannot see' above")
    paired_n = sum(c.p_values[0] is not None for c in checks)
    unpaired_n = len(checks) - arms - paired_n
    parts = ([f"{paired_n} paired with the baseline at alpha {args.alpha:g}"] if paired_n else [])
    parts += ([f"{unpaired_n} unpaired (max gap increase {args.max_gap_increase:g}, max drop "
               f"{args.max_drop:g}, each plus the 95% half-width)"] if unpaired_n else [])
    if arms:
        parts.append(f"fidelity of {arms} arms, max KL move {args.max_kl_rise:g} of the "
                     f"baseline, max agreement drop {args.max_agreement_drop:g}, each plus the "
                     f"paired change's half-width")
    print(f"gate: pass ({len(checks) - arms} benchmarks: " + "; ".join(parts) + ")")
    return 0


def _settings(report: dict) -> dict:
    return {arm: entry.get("settings") for arm, entry in report.get("arms", {}).items()}


def _check_settings(path: str, arms) -> None:
    """The report's arms: an object of objects, each arm's settings None (not recorded) or
    {generation: object or None, scoring: object of objects, model: object (v2)}, as
    `report` writes them."""
    fix = "make it again with `edge0-eval report`"
    if not isinstance(arms, dict) or not all(isinstance(v, dict) for v in arms.values()):
        raise Edge0Error(f"{path}: 'arms' must be an object of arm objects; {fix}")
    for arm, entry in arms.items():
        st = entry.get("settings")
        if st is not None and not (
                isinstance(st, dict) and isinstance(st.get("generation"), (dict, type(None)))
                and isinstance(st.get("scoring"), dict)
                and all(isinstance(v, dict) for v in st["scoring"].values())
                and isinstance(st.get("model", {}), dict)):
            raise Edge0Error(f"{path}: arm {arm!r} settings are {st!r}, not {{generation, "
                             f"scoring, model}} objects; {fix}")


def load_report(path: str) -> dict:
    """A report.json, every field the gate reads checked: a NaN or a missing score is an error."""
    try:
        report = strict_loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:
        raise Edge0Error(f"{path}: cannot read ({exc})") from None
    if not isinstance(report, dict) or report.get("schema") not in (SCHEMA, *OLD_SCHEMAS):
        raise Edge0Error(f"{path}: not an edge0-eval report (schema {SCHEMA!r} expected; "
                         f"make one with `edge0-eval report`)")
    rows = report.get("benchmarks")
    if not isinstance(rows, list) or not (rows or report.get("fidelity")):
        raise Edge0Error(f"{path}: no benchmarks and no fidelity; a report with nothing in it "
                         f"gates nothing (make it again with `edge0-eval report`)")
    seen = set()
    for i, row in enumerate(rows):
        where = f"{path}: benchmarks[{i}]"
        if not isinstance(row, dict) or not isinstance(row.get("benchmark"), str) \
                or not isinstance(row.get("status"), str):
            raise Edge0Error(f"{where} needs a benchmark name and a status")
        where = f"{path}: benchmark {row['benchmark']!r}"
        if row["benchmark"] in seen:
            raise Edge0Error(f"{where} appears twice")
        seen.add(row["benchmark"])
        arms = row.get("arms")
        if not isinstance(arms, dict) or not all(isinstance(a, dict) and
                                                 isinstance(a.get("status"), str)
                                                 for a in arms.values()):
            raise Edge0Error(f"{where}: 'arms' must map each arm to an object with a status")
        for key in ("gap", "student", "delta_half_width", "teacher"):
            value = row.get(key)
            if value is not None and not _number(value):
                raise Edge0Error(f"{where}: {key} is {value!r}, not a finite number")
        if row.get("version") is not None and not isinstance(row["version"], str):
            raise Edge0Error(f"{where}: version is {row['version']!r}, not a string")
        for arm, entry in arms.items():
            per_item = entry.get("per_item")
            # The paired tests read these: each an item's score, a share in [0, 1].
            if per_item is not None and not (isinstance(per_item, dict) and all(
                    _number(v) and 0 <= v <= 1 for v in per_item.values())):
                raise Edge0Error(f"{where}: arm {arm!r} per_item must map item ids to scores "
                                 f"in [0, 1]; make it again with `edge0-eval report`")
        if row["status"] == "ok":
            missing = [a for a in ("teacher", "student") if a not in arms]
            if missing:
                raise Edge0Error(f"{where}: status ok but arm(s) {missing} are absent")
            items = row.get("items")
            if not (isinstance(items, int) and not isinstance(items, bool) and items > 0):
                raise Edge0Error(f"{where}: status ok but items is {items!r}")
            for key in ("gap", "student"):
                if row.get(key) is None:
                    raise Edge0Error(f"{where}: status ok but {key} is missing")
            hw = row.get("delta_half_width")
            if hw is not None and hw < 0:
                raise Edge0Error(f"{where}: delta_half_width {hw} is negative")
    _check_fidelity(path, report.get("fidelity"))
    _check_settings(path, report.get("arms", {}))
    return report


# Every fidelity number the gate or the table reads: (low, high) of what can be measured.
_ARM_RANGES = {"kl": (0.0, math.inf), "agreement": (0.0, 100.0), "nll": (0.0, math.inf),
               "greedy_match": (0.0, math.inf)}


def _check_fidelity(path: str, fid) -> None:
    """The fidelity section as `report` writes it: every arm a dict with a status, its metrics
    in range (KL >= 0, agreement in [0, 100] points), half-widths >= 0, item counts whole;
    per_item [KL >= 0, agreement share in [0, 1]] per item; decomposition deltas finite with
    half-widths >= 0; teacher_sanity an object with a boolean `ok`."""
    if fid is None:
        return
    fix = "make it again with `edge0-eval report`"

    def bad(where: str, what: str):
        raise Edge0Error(f"{path}: fidelity{where} {what}; {fix}")

    def number(where: str, value, low: float, high: float, optional: bool = False):
        if optional and value is None:
            return
        # A negative KL or an agreement over 100% cannot be measured: a corrupt report.
        if not (_number(value) and low <= value <= high):
            bad(where, f"is {value!r}, not a finite number in [{low:g}, {high:g}]")

    def whole(where: str, value):
        if not (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
            bad(where, f"is {value!r}, not a whole number >= 0")

    if not isinstance(fid, dict) or not isinstance(fid.get("arms"), dict):
        raise Edge0Error(f"{path}: fidelity must be an object with an 'arms' object; {fix}")
    if "items" in fid:
        whole(" items", fid["items"])
    for arm, entry in fid["arms"].items():
        where = f" arm {arm!r}"
        if not isinstance(entry, dict) or not isinstance(entry.get("status"), str):
            bad(where, "must be an object with a status")
        for key, (low, high) in _ARM_RANGES.items():
            if key in entry:
                number(f"{where}: {key}", entry[key], low, high)
            if f"{key}_half_width" in entry:
                number(f"{where}: {key}_half_width", entry[f"{key}_half_width"], 0.0, math.inf,
                       optional=True)
        if "items" in entry:
            whole(f"{where}: items", entry["items"])
    per_item = fid.get("per_item", {})
    if not isinstance(per_item, dict):
        bad(" per_item", "is not an object")
    for arm, items in per_item.items():
        if not isinstance(items, dict):
            bad(f" per_item {arm!r}", "is not an object of items")
        for item, pair in items.items():
            where = f" per_item {arm!r} item {item!r}"
            if not isinstance(pair, list) or len(pair) != 2:
                bad(where, f"is {pair!r}, not [KL, agreement]")
            number(f"{where} KL", pair[0], 0.0, math.inf)
            number(f"{where} agreement", pair[1], 0.0, 1.0)
    decomposition = fid.get("decomposition", {})
    if not isinstance(decomposition, dict):
        bad(" decomposition", "is not an object")
    for step, metrics in decomposition.items():
        if not isinstance(metrics, dict):
            bad(f" decomposition {step!r}", "is not an object")
        for metric, value in metrics.items():
            where = f" decomposition {step!r} {metric}"
            if not isinstance(value, dict):
                bad(where, "is not {delta, half_width}")
            number(f"{where} delta", value.get("delta"), -math.inf, math.inf)
            number(f"{where} half_width", value.get("half_width"), 0.0, math.inf, optional=True)
    sanity = fid.get("teacher_sanity")
    if sanity is not None and not (isinstance(sanity, dict) and isinstance(sanity.get("ok"), bool)):
        bad(" teacher_sanity", f"is {sanity!r}, not an object with a boolean 'ok'")


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass
class Check:
    benchmark: str
    result: str = "pass"            # pass | FAIL | new (in the report only; not gated)
    reasons: list[str] = field(default_factory=list)
    items: tuple = (None, None)     # (baseline, current)
    gap: tuple = (None, None)
    student: tuple = (None, None)
    gap_increase: float | None = None
    drop: float | None = None
    half_width: float | None = None
    p_values: tuple = (None, None)  # paired: (student drop, gap increase)
    detectable: float | None = None  # paired: the student drop detected at 80% power
    blind: bool = False             # paired: cannot see the drop it is asked about

    def fail(self, reason: str) -> None:
        self.result = "FAIL"
        self.reasons.append(reason)


def _arm_problems(row: dict) -> str:
    """Which arms are not ok, e.g. 'student failed', for a row whose status is not ok."""
    arms = row.get("arms", {})
    bad = [f"{arm} {arms[arm]['status'] if arm in arms else 'absent'}"
           for arm in ("teacher", "student") if arm not in arms or arms[arm]["status"] != "ok"]
    return f"{row['status']}" + (f" ({', '.join(bad)})" if bad else "")


def _per_item(row: dict, arm: str) -> dict | None:
    items = row.get("arms", {}).get(arm, {}).get("per_item")
    return items if isinstance(items, dict) and items else None


def _paired_checks(check: Check, base: dict, cur: dict, max_gap_increase: float,
                   max_drop: float, alpha: float) -> bool:
    """The paired tests of the module docstring; False when either report lacks per-item
    outcomes for both arms (then the unpaired comparison runs)."""
    outcomes = [_per_item(r, arm) for r in (base, cur) for arm in ("teacher", "student")]
    if any(o is None for o in outcomes):
        return False
    bt, bs, ct_, cs = outcomes
    if set(bs) != set(cs):
        check.fail(f"item ids differ from the baseline's ({len(set(bs) ^ set(cs))} not shared)")
        return True
    student = paired.change(bs, cs, alpha)
    # Per item, student - teacher: its drop is the gap's widening.
    gap = paired.change({i: bs[i] - bt[i] for i in bs}, {i: cs[i] - ct_[i] for i in cs}, alpha)
    check.drop, check.gap_increase = student.drop, gap.drop
    check.p_values, check.detectable = (student.p_value, gap.p_value), student.detectable
    if student.p_value < alpha:
        check.fail(f"student dropped {student.drop:.2f} (paired on {student.items} items, "
                   f"{student.test} p={student.p_value:.3g} < {alpha:g})")
    if gap.p_value < alpha:
        check.fail(f"gap widened {gap.drop:+.2f} (paired, {gap.test} p={gap.p_value:.3g} "
                   f"< {alpha:g})")
    for what, asked, found in (("drop", max_drop, student.detectable),
                               ("gap widening", max_gap_increase, gap.detectable)):
        if found is None or found > asked:
            check.blind = True
            seen = "none" if found is None else f"{found:.1f} points"
            check.reasons.append(f"cannot see a {asked:g}-point {what}: at 80% power this "
                                 f"sample detects {seen} (more items or samples would)")
    return True


def evaluate(current: dict, baseline: dict, max_gap_increase: float, max_drop: float,
             max_kl_rise: float = fidelity_report.DEFAULT_MAX_KL_RISE,
             max_agreement_drop: float = fidelity_report.DEFAULT_MAX_AGREEMENT_DROP,
             alpha: float = paired.DEFAULT_ALPHA) -> list[Check]:
    rows = {r["benchmark"]: r for r in current["benchmarks"]}
    checks = []
    for base in baseline["benchmarks"]:
        check = Check(base["benchmark"])
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
        if cur["items"] != base["items"]:
            check.fail(f"{cur['items']} items, baseline {base['items']}")
        if base["version"] and cur["version"] and base["version"] != cur["version"]:
            check.fail(f"prompt version {cur['version']}, baseline {base['version']}")
        if _paired_checks(check, base, cur, max_gap_increase, max_drop, alpha):
            continue
        check.reasons.append("unpaired: the baseline has no per-item outcomes (regenerate it "
                             "with `edge0-eval report` to pair)")
        # No interval (a single item) means no allowance for noise.
        hw = cur["delta_half_width"] or 0.0
        check.half_width = hw
        check.gap_increase = cur["gap"] - base["gap"]
        check.drop = base["student"] - cur["student"]
        if check.gap_increase > max_gap_increase + hw:
            check.fail(f"gap widened {check.gap_increase:+.2f} > {max_gap_increase:g} + {hw:.2f}")
        if check.drop > max_drop + hw:
            check.fail(f"student dropped {check.drop:.2f} > {max_drop:g} + {hw:.2f}")
    known = {c.benchmark for c in checks}
    for name, row in rows.items():
        if name not in known:
            checks.append(Check(name, "new", ["not in the baseline; not gated"],
                                (None, row["items"]), (None, row["gap"]),
                                (None, row["student"])))
    for fc in fidelity_report.gate_checks(current, baseline, max_kl_rise, max_agreement_drop):
        checks.append(Check(fc["name"], fc["result"], fc["reasons"], fc["items"]))
    return checks


def _f(value, signed: bool = False) -> str:
    if value is None:
        return "-"
    return f"{value:+.2f}" if signed else f"{value:.2f}"


def format_table(checks: list[Check]) -> str:
    header = ["benchmark", "items", "gap base", "gap now", "gap +", "student base",
              "student now", "drop", "+-hw", "p (drop, gap)", "detects", "result", "why"]
    rows = [[c.benchmark,
             f"{c.items[0] if c.items[0] is not None else '-'}->"
             f"{c.items[1] if c.items[1] is not None else '-'}",
             _f(c.gap[0]), _f(c.gap[1]), _f(c.gap_increase, True), _f(c.student[0]),
             _f(c.student[1]), _f(c.drop, True), _f(c.half_width),
             ", ".join(f"{p:.3g}" for p in c.p_values) if c.p_values[0] is not None else "-",
             _f(c.detectable), c.result,
             "; ".join(c.reasons)] for c in checks]
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    lines = ["  ".join(str(v).ljust(w) for v, w in zip(r, widths)).rstrip()
             for r in [header] + rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
