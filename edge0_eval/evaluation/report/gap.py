"""The teacher-vs-student gap report from OpenCompass output folders (`edge0-eval report`).

Scores come from the per-item `details` of each results file (full precision), never from the
rounded summary. Per benchmark: items, teacher, student, delta = student - teacher, and a 95%
interval for the delta from the paired per-item differences: mean +- t * sd / sqrt(n)
(sd with n - 1, t the 95% quantile with n - 1 degrees of freedom; no resampling, so it is
deterministic). With several
samples per item (dataset `n`) an item's score is the mean over its samples (avg@n) and the
item stays the unit of every interval and test: clustered by item (outputs/samples.py).

Writes report.json (schema SCHEMA, read by `edge0-eval gate`; per arm, benchmark, item and
sample: score, finish reason, whether thinking closed, output tokens), report.csv, report.md
and report.png into --out; with a fidelity dataset in the runs also its section (`fidelity` in
report.json, fidelity.png; see fidelity/report.py). Headline definitions and the reference
column: definitions.py; settings fingerprints: outputs/settings.py.
"""

from __future__ import annotations

import math
from datetime import datetime, timezone

from edge0_eval.errors import Edge0Error
from edge0_eval.evaluation.benchmarks import Benchmark
from edge0_eval.evaluation.fidelity import report as fidelity_report
from edge0_eval.evaluation.outputs import samples as sampling
from edge0_eval.evaluation.outputs.predictions import engine_summary
from edge0_eval.evaluation.outputs.runs import BENCHMARK_ORDER, NEEDS_PREDICTIONS, Run
from edge0_eval.evaluation.outputs.settings import arm_settings, settings_differences
from edge0_eval.evaluation.outputs.thinking import rule_of
from edge0_eval.evaluation.report.arms import (
    ArmBench,
    check_versions,
    collect_arm,
    fingerprint_parts,
    shown,
    version_text,
)
from edge0_eval.evaluation.report.definitions import (
    average_reference,
    headline,
    reference_for,
)
from edge0_eval.evaluation.report.flips import add_flips
from edge0_eval.evaluation.significance.paired import EXACT_BELOW, exact_interval

# v2: per-sample records, the open-thinking rule, headline definitions, data digests and model
# identity. A v1 report still reads (gate: with a note saying what it lacks).
SCHEMA = "edge0-eval/report/v2"
OLD_SCHEMAS = ("edge0-eval/report/v1",)


# --------------------------------------------------------------------------- statistics


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def paired_mean_se(diffs: list[float]) -> tuple[float, float | None]:
    """(mean, standard error) of paired differences; no error for fewer than two items."""
    n = len(diffs)
    mean = _mean(diffs)
    if n < 2:
        return mean, None
    var = sum((d - mean) ** 2 for d in diffs) / (n - 1)
    return mean, math.sqrt(var / n)


# --------------------------------------------------------------------------- the report


def _sub(a, b):
    return None if a is None or b is None else a - b


def _status(rows: list[dict], fidelity: dict | None) -> str:
    """ok: something was measured (benchmarks or fidelity) and every part of it is ok."""
    parts = [r["status"] for r in rows] + (
        [fidelity["status"]] if fidelity is not None else []
    )
    return "ok" if parts and all(s == "ok" for s in parts) else "incomplete"


def build_report(
    runs: list[Run],
    arms: dict[str, tuple[str, Run]],
    reference: dict | None,
    command: str,
) -> dict:
    abbrs = {arm: abbr for arm, (abbr, _) in arms.items()}
    collected = {arm: collect_arm(abbr, r) for arm, (abbr, r) in arms.items()}
    names = {n for per in collected.values() for n in per}
    names = sorted(
        names,
        key=lambda n: (
            BENCHMARK_ORDER.index(n) if n in BENCHMARK_ORDER else len(BENCHMARK_ORDER),
            n,
        ),
    )

    rows, problems, notes = [], [], [n for r in runs for n in r.notes]
    for name in names:
        per_arm = {
            arm: collected[arm][name][1]
            if name in collected[arm]
            else ArmBench(abbrs[arm])
            for arm in arms
        }
        problems += check_versions(name, per_arm, abbrs)
        bench = next(collected[a][name][0] for a in arms if name in collected[a])
        rows.append(_benchmark_row(name, bench, per_arm, abbrs, reference))
        if rows[-1]["status"] == "ok":
            add_flips(rows[-1], per_arm, arms)
        notes += [n for ab in per_arm.values() for n in ab.notes]
        notes += [f"{name}: {n}" for n in rows[-1]["notes"]]
        notes += [
            f"{name}: prompt version of {arm} {ab.abbr} unknown (no summary csv or "
            f"config); versions not compared"
            for arm, ab in per_arm.items()
            if ab.status != "missing" and not version_text(ab)
        ]
    if problems:
        raise Edge0Error(
            "refusing to compare different prompts: " + "; ".join(problems)
        )
    settings = _settings(arms, collected, notes)

    engine = {
        arm: engine_summary([s for _, ab in collected[arm].values() for s in ab.engine])
        for arm in arms
    }
    fidelity = fidelity_report.build(arms)
    return {
        "schema": SCHEMA,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "outputs": [shown(r.path) for r in runs],
        "arms": {
            arm: {"abbr": abbr, "run": shown(r.path), "settings": settings[arm]}
            for arm, (abbr, r) in arms.items()
        },
        "interval": {
            "method": "paired per-item differences (student - teacher): mean +- "
            "t * sd / sqrt(n), sd with n - 1, t Student's with n - 1 degrees of "
            "freedom (the average's: Welch-Satterthwaite over the benchmarks); "
            "an item with several samples is one observation (its mean): "
            "clustered by item",
            "level": 0.95,
        },
        "open_thinking": _open_thinking(settings),
        "status": _status(rows, fidelity),
        "benchmarks": rows,
        "average": _average_row(rows, reference),
        "engine": engine,
        "fidelity": fidelity,
        "reference": None
        if reference is None
        else {k: reference.get(k) for k in ("name", "source", "file")},
        "notes": notes,
    }


def _settings(arms: dict, collected: dict, notes: list[str]) -> dict:
    """Each arm's generation and scoring settings; arms whose settings differ refused."""
    settings = {
        arm: arm_settings(abbr, r, *fingerprint_parts(collected[arm], notes, arm))
        for arm, (abbr, r) in arms.items()
    }
    problems = settings_differences(settings, "teacher")
    if problems:
        raise Edge0Error(
            "refusing to pair arms run with different settings: "
            + "; ".join(problems)
            + "; rerun one arm with the other's settings"
        )
    notes += [
        f"{arm} {arms[arm][0]}: no config dump, so its generation and scoring settings are "
        f"not compared"
        for arm, st in settings.items()
        if st["generation"] is None
    ]
    return settings


def _open_thinking(settings: dict) -> dict:
    """Which rule scored outputs whose thinking never closed (thinking.py), per dataset."""
    rules = {
        d: rule_of(fields.get("eval_cfg"))
        for st in settings.values()
        for d, fields in (st["scoring"] or {}).items()
        if "eval_cfg" in fields
    }
    kinds = sorted(set(rules.values()))
    return {
        "rule": kinds[0] if len(kinds) == 1 else ("mixed" if kinds else None),
        "datasets": dict(sorted(rules.items())),
        "meaning": {
            "empty": "an output cut inside its <think> block scores as an empty answer",
            "pass": "OpenCompass's pass-through: the open block's text is scored "
            "as the answer",
        },
    }


def _benchmark_row(
    name: str,
    bench: Benchmark,
    per_arm: dict[str, ArmBench],
    abbrs: dict[str, str],
    reference: dict | None,
) -> dict:
    teacher, student = per_arm["teacher"], per_arm["student"]
    status = _row_status(teacher, student)
    n = sampling.samples_per_item(teacher.samples or student.samples)
    row = {
        "benchmark": name,
        "datasets": sorted({d for ab in per_arm.values() for d in ab.datasets}),
        "metric": bench.metric or teacher.metric or student.metric,
        "definition": headline(
            bench, bench.metric or teacher.metric or student.metric, n
        ),
        "status": status,
        "items": len(teacher.scores) if status == "ok" else None,
        "version": version_text(teacher) or version_text(student),
        "teacher": teacher.score,
        "student": student.score,
        "delta": _sub(student.score, teacher.score),
        "gap": _sub(teacher.score, student.score),
        "delta_ci95": None,
        "delta_half_width": None,
        "delta_se": None,
        "decomposition": None,
        "arms": {arm: _arm_json(ab, bench) for arm, ab in per_arm.items()},
        "truncation_flags": [],
        # Per arm, what its missing predictions left uncomputed (runs.NEEDS_PREDICTIONS).
        "not_computed": {
            arm: list(NEEDS_PREDICTIONS)
            for arm, ab in per_arm.items()
            if ab.status == "no_predictions"
        },
        "reference": None,
        "reference_omitted": None,
        "notes": [],
    }
    if status == "ok":
        ids = sorted(teacher.scores)
        diffs = [100.0 * (student.scores[i] - teacher.scores[i]) for i in ids]
        mean, se = paired_mean_se(diffs)
        row["delta"], row["gap"] = mean, 0.0 - mean  # no -0.0
        if se is not None:
            half = sampling.t95(len(diffs) - 1) * se
            row["delta_se"], row["delta_half_width"] = se, half
            row["delta_ci95"] = [mean - half, mean + half]
        exact = exact_interval(diffs, unit=100.0) if len(diffs) < EXACT_BELOW else None
        if exact is not None:
            # Few 0/1 items: the t interval under-covers, and is width 0 when all agree.
            row["delta_ci95"] = list(exact)
            row["delta_half_width"] = max(mean - exact[0], exact[1] - mean)
        row["decomposition"] = _decomposition(per_arm, row["notes"])
        for arm, ab in per_arm.items():
            diff = (
                sampling.truncation_difference(ab.samples, teacher.samples)
                if arm != "teacher"
                else None
            )
            row["arms"][arm]["truncation_vs_teacher"] = diff
            if diff and diff["flag"]:
                row["truncation_flags"].append(
                    f"{arm} cut at the length limit {diff['arm']:.1f}% vs teacher "
                    f"{diff['teacher']:.1f}% ({diff['difference']:+.1f} points, paired "
                    f"two-sided p {diff['p_value']:.3f}): its comparison with the teacher "
                    f"mixes quality with cut-off outputs"
                )
    elif status == "items_mismatch":
        row["notes"].append(
            f"item ids differ (teacher {len(teacher.scores)} items, student "
            f"{len(student.scores)}); not paired"
        )
    if reference:
        row["reference"], row["reference_omitted"] = reference_for(
            reference, name, row["definition"]
        )
    return row


def _row_status(teacher: ArmBench, student: ArmBench) -> str:
    if "missing" in (teacher.status, student.status):
        return "missing_arm"
    for status in ("failed", "no_details", "inconsistent", "no_predictions"):
        if status in (teacher.status, student.status):
            return status
    if set(teacher.scores) != set(student.scores):
        return "items_mismatch"
    return "ok"


def _arm_json(ab: ArmBench, bench: Benchmark) -> dict:
    ok = ab.status == "ok"
    half = (
        sampling.mean_half_width([100.0 * v for v in ab.scores.values()])[1]
        if ok and ab.scores
        else None
    )
    out = {
        "abbr": ab.abbr,
        "status": ab.status,
        "score": ab.score,
        "score_half_width": half,  # 95%, clustered by item
        "items": len(ab.scores) if ab.scores else None,
        "datasets": ab.datasets,
        "samples_per_item": sampling.samples_per_item(ab.samples),
        "version": version_text(ab),
        "extra": {m: _mean(v.values()) * 100.0 for m, v in ab.extra.items() if v},
        "pass_at_k": (sampling.pass_at_k(ab.samples) or None)
        if ok and bench.pass_at_k and (sampling.samples_per_item(ab.samples) or 0) > 1
        else None,
        "engine": engine_summary(ab.engine),
        # Outputs cut at the length limit, and of those still inside their thinking block.
        "truncation": sampling.truncation(ab.samples) if ab.samples else None,
        # Per-item outcomes (the mean over an item's samples) and every sample's record,
        # so another run (a baseline) or arm pairs with this one item by item.
        "per_item": dict(sorted(ab.scores.items())) if ok else None,
        "samples": dict(sorted(ab.samples.items())) if ok else None,
    }
    if (
        len(ab.datasets) > 1
    ):  # pooled benchmark: also the summarizer's mean of categories
        out["categories"] = ab.category_scores
        out["category_mean"] = (
            _mean(ab.category_scores.values())
            if len(ab.category_scores) == len(ab.datasets)
            else None
        )
    return out


def _decomposition(per_arm: dict[str, ArmBench], notes: list[str]) -> dict | None:
    """Gap = quantization loss + routing loss - LoRA recovery, from the ablation arms."""
    if "int4_exact" not in per_arm and "prerouted_nolora" not in per_arm:
        return None
    teacher = per_arm["teacher"]

    def score(
        arm,
    ):  # an ablation counts only when scored on exactly the teacher's items
        ab = per_arm.get(arm)
        if ab is None:
            return None
        if ab.status != "ok" or set(ab.scores) != set(teacher.scores):
            notes.append(
                f"{arm} {ab.abbr} left out of the decomposition ({ab.status}, "
                f"{len(ab.scores)} of the teacher's {len(teacher.scores)} items)"
            )
            return None
        return ab.score

    t, q, p, s = (
        score("teacher"),
        score("int4_exact"),
        score("prerouted_nolora"),
        score("student"),
    )
    return {
        "teacher": t,
        "int4_exact": q,
        "prerouted_nolora": p,
        "student": s,
        "quantization_loss": _sub(t, q),
        "routing_loss": _sub(q, p),
        "lora_recovery": _sub(s, p),
        "total_gap": _sub(t, s),
    }


def _average_row(rows: list[dict], reference: dict | None) -> dict:
    """Unweighted mean over benchmarks (as the paper's avg), only over benchmarks that are ok."""
    ok = [r for r in rows if r["status"] == "ok"]
    avg = {
        "benchmarks": [r["benchmark"] for r in ok],
        "complete": bool(rows) and len(ok) == len(rows),
        "teacher": None,
        "student": None,
        "delta": None,
        "gap": None,
        "delta_ci95": None,
        "delta_half_width": None,
        "decomposition": None,
        "reference": None,
    }
    if ok:
        for key in ("teacher", "student", "delta", "gap"):
            avg[key] = _mean(r[key] for r in ok)
        if all(r["delta_se"] is not None for r in ok):
            # Benchmarks are independent samples: var(mean) = sum(se^2) / B^2, its degrees
            # of freedom Welch-Satterthwaite's.
            var = sum(r["delta_se"] ** 2 for r in ok)
            fourth = sum(r["delta_se"] ** 4 / (r["items"] - 1) for r in ok)
            half = (
                sampling.t95(var**2 / fourth) * math.sqrt(var) / len(ok) if var else 0.0
            )
            avg["delta_half_width"] = half
            avg["delta_ci95"] = [avg["delta"] - half, avg["delta"] + half]
        decs = [r["decomposition"] for r in ok]
        if all(decs):
            avg["decomposition"] = {
                k: (
                    _mean(d[k] for d in decs)
                    if all(d[k] is not None for d in decs)
                    else None
                )
                for k in decs[0]
            }
    avg["reference_omitted"] = None
    if reference:
        avg["reference"], avg["reference_omitted"] = average_reference(reference, rows)
    return avg
