"""The reports `edge0-eval gate` reads: every field it uses checked where it is read, so a NaN,
a missing score or a corrupt section is one error naming the file and the fix."""

from __future__ import annotations

import math
from pathlib import Path

from edge0_eval.errors import Edge0Error
from edge0_eval.evaluation.fidelity.report import teacher_sane
from edge0_eval.evaluation.outputs.predictions import strict_loads
from edge0_eval.evaluation.report.gap import OLD_SCHEMAS, SCHEMA


def _check_settings(path: str, arms) -> None:
    """The report's arms: an object of objects, each arm's settings None (not recorded) or
    {generation: object or None, scoring: object of objects, model: object (v2)}, as
    `report` writes them."""
    fix = "make it again with `edge0-eval report`"
    if not isinstance(arms, dict) or not all(
        isinstance(v, dict) for v in arms.values()
    ):
        raise Edge0Error(f"{path}: 'arms' must be an object of arm objects; {fix}")
    for arm, entry in arms.items():
        st = entry.get("settings")
        if st is not None and not (
            isinstance(st, dict)
            and isinstance(st.get("generation"), (dict, type(None)))
            and isinstance(st.get("scoring"), dict)
            and all(isinstance(v, dict) for v in st["scoring"].values())
            and isinstance(st.get("model", {}), dict)
        ):
            raise Edge0Error(
                f"{path}: arm {arm!r} settings are {st!r}, not {{generation, "
                f"scoring, model}} objects; {fix}"
            )


def load_report(path: str) -> dict:
    """A report.json, every field the gate reads checked: a NaN or a missing score is an error."""
    try:
        report = strict_loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:
        raise Edge0Error(f"{path}: cannot read ({exc})") from None
    if not isinstance(report, dict) or report.get("schema") not in (
        SCHEMA,
        *OLD_SCHEMAS,
    ):
        raise Edge0Error(
            f"{path}: not an edge0-eval report (schema {SCHEMA!r} expected; "
            f"make one with `edge0-eval report`)"
        )
    rows = report.get("benchmarks")
    if not isinstance(rows, list) or not (rows or report.get("fidelity")):
        raise Edge0Error(
            f"{path}: no benchmarks and no fidelity; a report with nothing in it "
            f"gates nothing (make it again with `edge0-eval report`)"
        )
    seen = set()
    for i, row in enumerate(rows):
        where = f"{path}: benchmarks[{i}]"
        if (
            not isinstance(row, dict)
            or not isinstance(row.get("benchmark"), str)
            or not isinstance(row.get("status"), str)
        ):
            raise Edge0Error(f"{where} needs a benchmark name and a status")
        where = f"{path}: benchmark {row['benchmark']!r}"
        if row["benchmark"] in seen:
            raise Edge0Error(f"{where} appears twice")
        seen.add(row["benchmark"])
        arms = row.get("arms")
        if not isinstance(arms, dict) or not all(
            isinstance(a, dict) and isinstance(a.get("status"), str)
            for a in arms.values()
        ):
            raise Edge0Error(
                f"{where}: 'arms' must map each arm to an object with a status"
            )
        for key in ("gap", "student", "delta_half_width", "teacher"):
            value = row.get(key)
            if value is not None and not _number(value):
                raise Edge0Error(f"{where}: {key} is {value!r}, not a finite number")
        if row.get("version") is not None and not isinstance(row["version"], str):
            raise Edge0Error(f"{where}: version is {row['version']!r}, not a string")
        for arm, entry in arms.items():
            per_item = entry.get("per_item")
            # The paired tests read these: each an item's score, a share in [0, 1].
            if per_item is not None and not (
                isinstance(per_item, dict)
                and all(_number(v) and 0 <= v <= 1 for v in per_item.values())
            ):
                raise Edge0Error(
                    f"{where}: arm {arm!r} per_item must map item ids to scores "
                    f"in [0, 1]; make it again with `edge0-eval report`"
                )
        if row["status"] == "ok":
            missing = [a for a in ("teacher", "student") if a not in arms]
            if missing:
                raise Edge0Error(f"{where}: status ok but arm(s) {missing} are absent")
            items = row.get("items")
            if not (
                isinstance(items, int) and not isinstance(items, bool) and items > 0
            ):
                raise Edge0Error(f"{where}: status ok but items is {items!r}")
            for key in ("gap", "student"):
                if row.get(key) is None:
                    raise Edge0Error(f"{where}: status ok but {key} is missing")
            hw = row.get("delta_half_width")
            if hw is not None and hw < 0:
                raise Edge0Error(f"{where}: delta_half_width {hw} is negative")
    _check_fidelity(path, report.get("fidelity"))
    _check_settings(path, report.get("arms", {}))
    _check_runs(path, report)
    return report


def _check_runs(path: str, report: dict) -> None:
    """A baseline of several runs (`gate-baseline`): its run count, and per arm and item the
    runs' scores, each a list of that many numbers in range (benchmarks: [0, 1]; fidelity:
    [KL >= 0, agreement in [0, 1]])."""
    meta = report.get("baseline")
    if meta is None:
        return
    fix = "make it again with `edge0-eval gate-baseline`"
    runs = meta.get("runs") if isinstance(meta, dict) else None
    if isinstance(runs, bool) or not isinstance(runs, int) or runs < 2:
        raise Edge0Error(f"{path}: baseline runs is {runs!r}, not a count >= 2; {fix}")

    def scores(where: str, table, ok) -> None:
        if not isinstance(table, dict) or not all(
            isinstance(v, list) and len(v) == runs and all(ok(x) for x in v)
            for v in table.values()
        ):
            raise Edge0Error(
                f"{path}: {where} must map items to their {runs} runs' scores; {fix}"
            )

    for row in report["benchmarks"]:
        for arm, entry in row.get("arms", {}).items():
            if entry.get("per_item_runs") is not None:
                scores(
                    f"benchmark {row['benchmark']!r} arm {arm!r} per_item_runs",
                    entry["per_item_runs"],
                    lambda v: _number(v) and 0 <= v <= 1,
                )
    fid = report.get("fidelity") or {}
    for arm, table in (fid.get("per_item_runs") or {}).items():
        scores(
            f"fidelity per_item_runs {arm!r}",
            table,
            lambda v: (
                isinstance(v, list)
                and len(v) == 2
                and _number(v[0])
                and v[0] >= 0
                and _number(v[1])
                and 0 <= v[1] <= 1
            ),
        )


# Every fidelity number the gate or the table reads: (low, high) of what can be measured.
_ARM_RANGES = {
    "kl": (0.0, math.inf),
    "agreement": (0.0, 100.0),
    "nll": (0.0, math.inf),
    "greedy_match": (0.0, math.inf),
}


def _check_fidelity(path: str, fid) -> None:
    """The fidelity section as `report` writes it: every arm a dict with a status, its metrics
    in range (KL >= 0, agreement in [0, 100] points), half-widths >= 0, item counts whole;
    per_item [KL >= 0, agreement share in [0, 1]] per item; decomposition deltas finite with
    half-widths >= 0; teacher_sanity an object with a boolean `ok` that its numbers bear out
    (_check_teacher_sanity)."""
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
        raise Edge0Error(
            f"{path}: fidelity must be an object with an 'arms' object; {fix}"
        )
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
                number(
                    f"{where}: {key}_half_width",
                    entry[f"{key}_half_width"],
                    0.0,
                    math.inf,
                    optional=True,
                )
        if "items" in entry:
            whole(f"{where}: items", entry["items"])
    _check_fidelity_values(fid, bad, number)
    sanity = fid.get("teacher_sanity")
    if sanity is not None and not (
        isinstance(sanity, dict) and isinstance(sanity.get("ok"), bool)
    ):
        bad(" teacher_sanity", f"is {sanity!r}, not an object with a boolean 'ok'")
    if sanity is not None:
        number(" teacher_sanity kl", sanity.get("kl"), *_ARM_RANGES["kl"])
        number(
            " teacher_sanity agreement",
            sanity.get("agreement"),
            *_ARM_RANGES["agreement"],
        )
        _check_teacher_sanity(fid, sanity, bad)


def _check_fidelity_values(fid: dict, bad, number) -> None:
    """per_item [KL >= 0, agreement share in [0, 1]] per item; decomposition deltas finite
    with half-widths >= 0 (bad and number: _check_fidelity's reporters)."""
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
            number(
                f"{where} half_width",
                value.get("half_width"),
                0.0,
                math.inf,
                optional=True,
            )


def _check_teacher_sanity(fid: dict, sanity: dict, bad) -> None:
    """The gate passes a teacher only on the numbers, never on the flag alone: `ok` must be
    what the sanity's KL and agreement say (fidelity.report.teacher_sane), those must be the
    teacher arm's, and an ok teacher's every item must be sane too (per_item)."""
    kl, agreement, ok = sanity["kl"], sanity["agreement"], sanity["ok"]
    if ok != teacher_sane(kl, agreement):
        bad(
            " teacher_sanity",
            f"says ok={ok} but its teacher scores KL {kl:.3g}, agreement "
            f"{agreement:.2f} on its own set (ok means KL 0 and agreement 100)",
        )
    teacher = fid["arms"].get("teacher")
    if teacher is not None and teacher.get("status") == "ok":
        arm = (teacher.get("kl"), teacher.get("agreement"))
        if arm != (kl, agreement):
            bad(
                " teacher_sanity",
                f"gives KL {kl!r}, agreement {agreement!r}, but the teacher arm "
                f"{arm[0]!r}, {arm[1]!r}",
            )
    items = (fid.get("per_item") or {}).get("teacher") or {}
    insane = [i for i, (k, a) in items.items() if not teacher_sane(k, 100.0 * a)]
    if ok and insane:
        bad(
            " teacher_sanity",
            f"says ok but the teacher's item {insane[0]!r} scores "
            f"{items[insane[0]]!r} ([KL, agreement] on its own set)",
        )


def _number(value) -> bool:
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
    )
