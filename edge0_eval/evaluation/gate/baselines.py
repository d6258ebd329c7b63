"""A gate baseline made from several runs of the same config (`edge0-eval gate-baseline`).

One baseline run serves every CI run compared with it, so its own luck is in every verdict: a
baseline run that happened to pass more items than the student's rates give fails clean CI
runs more often than alpha, every time (over 600 simulated one-run baselines the per-run
false-fail rate at a 0.5% level was 0.5% on average but 9.2% at the 99th percentile), and a
rerun with the same seeds cannot clear it. A baseline of R runs holds, per arm and item, the
mean of its R scores (`per_item`, what every check reads) and the R scores themselves
(`per_item_runs`), from which paired.baseline_change measures each item's run-to-run variance
and bounds the false-fail rate per baseline, not only on average over baselines. Its own
spread is reported per benchmark (`baseline_runs`: each run's scores, their sd, and the churn:
the share of items whose student score differs between two runs, averaged over pairs of runs),
and per fidelity arm (each run's mean KL and agreement, and the largest per-prompt range); the
fidelity checks size their allowances from the per-prompt runs (gate/fidelity_checks.py).

The runs must be one config's, one model's and one code's: the same settings (fail closed,
settings.baseline_differences), the same model identity, the same benchmarks and items, every
row ok. Per-sample records are per run and are left out.
"""

from __future__ import annotations

import copy
import itertools
import math
from datetime import datetime, timezone

from edge0_eval.errors import Edge0Error
from edge0_eval.evaluation.outputs.settings import baseline_differences, model_changes
from edge0_eval.evaluation.report.gap import SCHEMA

MIN_RUNS = 2


def _settings(report: dict) -> dict:
    return {arm: entry.get("settings") for arm, entry in report.get("arms", {}).items()}


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def _sd(values: list[float]) -> float:
    mean = _mean(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def _check_same(paths: list[str], reports: list[dict]) -> None:
    first = reports[0]
    fix = "a baseline is several runs of one gate config, model and code"
    for path, report in zip(paths[1:], reports[1:]):
        if report["schema"] != SCHEMA or first["schema"] != SCHEMA:
            raise Edge0Error(
                f"{path}: a {report['schema']} report; make every run's report with "
                f"`edge0-eval report` ({SCHEMA})"
            )
        problems = baseline_differences(_settings(report), _settings(first))
        problems += model_changes(_settings(report), _settings(first))
        if problems:
            raise Edge0Error(
                f"{path}: not a run like {paths[0]}: "
                + "; ".join(problems)
                + f"; {fix}"
            )
        names = [[r["benchmark"] for r in rep["benchmarks"]] for rep in (first, report)]
        if names[0] != names[1]:
            raise Edge0Error(
                f"{path}: benchmarks {names[1]}, {paths[0]} {names[0]}; {fix}"
            )
        if bool(first.get("fidelity")) != bool(report.get("fidelity")):
            raise Edge0Error(f"{path}: fidelity in one run and not the other; {fix}")
    for path, report in zip(paths, reports):
        for row in report["benchmarks"]:
            if row["status"] != "ok":
                raise Edge0Error(
                    f"{path}: {row['benchmark']} is {row['status']}; a baseline is made "
                    f"of complete runs"
                )
        fid = report.get("fidelity")
        if fid and fid.get("status") != "ok":
            raise Edge0Error(
                f"{path}: fidelity is {fid.get('status')}; a baseline is made of "
                f"complete runs"
            )


def _combine_row(path0: str, rows: list[dict], paths: list[str]) -> dict:
    row = copy.deepcopy(rows[0])
    runs = len(rows)
    for arm, entry in row["arms"].items():
        per_run = [r["arms"][arm].get("per_item") or {} for r in rows]
        if any(set(p) != set(per_run[0]) for p in per_run) or not per_run[0]:
            bad = next(
                paths[k] for k, p in enumerate(per_run) if set(p) != set(per_run[0])
            )
            raise Edge0Error(
                f"{bad}: {row['benchmark']} {arm} scored other items than {path0}; the "
                f"runs of a baseline score the same sample"
            )
        ids = sorted(per_run[0])
        entry["per_item_runs"] = {i: [p[i] for p in per_run] for i in ids}
        entry["per_item"] = {i: _mean(p[i] for p in per_run) for i in ids}
        entry["score"] = 100.0 * _mean(entry["per_item"].values())
        entry["samples"] = None  # per run: they do not combine
        entry["score_half_width"] = None
    teacher, student = row["arms"]["teacher"], row["arms"]["student"]
    row["teacher"], row["student"] = teacher["score"], student["score"]
    row["gap"] = row["teacher"] - row["student"]
    row["delta"] = -row["gap"]
    for key in ("delta_ci95", "delta_half_width", "delta_se"):
        row[key] = None  # paired with the runs instead (paired.baseline_change)
    scores = [r["student"] for r in rows]
    pairs = list(itertools.combinations(range(runs), 2))
    outcomes = [r["arms"]["student"]["per_item"] for r in rows]
    row["baseline_runs"] = {
        "runs": runs,
        "student": scores,
        "teacher": [r["teacher"] for r in rows],
        "student_sd": _sd(scores),
        "churn": _mean(
            _mean(outcomes[a][i] != outcomes[b][i] for i in outcomes[a])
            for a, b in pairs
        ),
    }
    return row


def _combine_fidelity(paths: list[str], sections: list[dict]) -> dict:
    fid = copy.deepcopy(sections[0])
    fid["per_item_runs"], fid["baseline_runs"] = {}, {}
    for arm, per_item in sections[0].get("per_item", {}).items():
        per_run = [s.get("per_item", {}).get(arm) or {} for s in sections]
        if any(set(p) != set(per_item) for p in per_run):
            raise Edge0Error(
                f"fidelity {arm}: the runs scored other prompts than {paths[0]}; the "
                f"runs of a baseline score the same set"
            )
        ids = sorted(per_item)
        fid["per_item_runs"][arm] = {i: [p[i] for p in per_run] for i in ids}
        fid["per_item"][arm] = {
            i: [_mean(p[i][0] for p in per_run), _mean(p[i][1] for p in per_run)]
            for i in ids
        }
        entry = fid["arms"][arm]
        entry["kl"] = _mean(v[0] for v in fid["per_item"][arm].values())
        entry["agreement"] = 100.0 * _mean(v[1] for v in fid["per_item"][arm].values())
        for key in ("nll", "greedy_match"):
            entry[key] = _mean(s["arms"][arm][key] for s in sections)
        for key in list(entry):
            if key.endswith("_half_width"):
                entry[key] = None
        fid["baseline_runs"][arm] = {
            "kl": [s["arms"][arm]["kl"] for s in sections],
            "agreement": [s["arms"][arm]["agreement"] for s in sections],
            "max_prompt_kl_range": max(
                max(p[i][0] for p in per_run) - min(p[i][0] for p in per_run)
                for i in ids
            ),
        }
    fid["notes"] = fid.get("notes", []) + [
        f"baseline of {len(sections)} runs: per prompt the mean of its runs"
    ]
    return fid


def combine(paths: list[str], reports: list[dict], command: str) -> dict:
    """The baseline report of several runs' reports (module docstring)."""
    if len(reports) < MIN_RUNS:
        raise Edge0Error(
            f"a baseline of several runs needs at least {MIN_RUNS} reports, got "
            f"{len(reports)}; one run's report is itself a (one-run) baseline"
        )
    _check_same(paths, reports)
    out = copy.deepcopy(reports[0])
    out["benchmarks"] = [
        _combine_row(paths[0], [rep["benchmarks"][k] for rep in reports], paths)
        for k in range(len(reports[0]["benchmarks"]))
    ]
    if out.get("fidelity"):
        out["fidelity"] = _combine_fidelity(paths, [r["fidelity"] for r in reports])
    average = out.get("average") or {}
    ok = out["benchmarks"]
    for key in ("teacher", "student", "gap", "delta"):
        average[key] = _mean(r[key] for r in ok) if ok else None
    for key in ("delta_ci95", "delta_half_width"):
        average[key] = None
    out["average"] = average
    out["created"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    out["command"] = command
    out["baseline"] = {"runs": len(reports), "reports": list(paths)}
    return out


def spread_lines(baseline: dict) -> list[str]:
    """The baseline's own spread, one line per benchmark and fidelity arm (several runs)."""
    runs = (baseline.get("baseline") or {}).get("runs")
    if not runs:
        return []
    lines = []
    for row in baseline["benchmarks"]:
        spread = row.get("baseline_runs") or {}
        if spread:
            lines.append(
                f"{row['benchmark']}: student "
                + ", ".join(f"{v:.2f}" for v in spread["student"])
                + f" (sd {spread['student_sd']:.2f} points), churn "
                f"{100 * spread['churn']:.1f}% between runs"
            )
    for arm, spread in (
        (baseline.get("fidelity") or {}).get("baseline_runs") or {}
    ).items():
        lines.append(
            f"fidelity {arm}: KL "
            + ", ".join(f"{v:.4g}" for v in spread["kl"])
            + f" (sd of the means {_sd(spread['kl']):.3g}); largest per-prompt KL range "
            f"{spread['max_prompt_kl_range']:.3g} (the per-prompt rule's)"
        )
    return lines
