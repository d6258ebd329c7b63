"""`edge0-eval report`: teacher-vs-student gap report from OpenCompass output folders.

Scores come from the per-item `details` of each results file (full precision), never from the
rounded summary. Per benchmark: items, teacher, student, delta = student - teacher, and a 95%
interval for the delta from the paired per-item differences: mean +- 1.96 * sd / sqrt(n)
(sd with n - 1; normal approximation, no resampling, so it is deterministic).

Writes report.json (schema "edge0-eval/report/v1", read by `edge0-eval gate`), report.csv,
report.md and report.png into --out; with a fidelity dataset in the runs also its section
(`fidelity` in report.json, fidelity.png; see fidelity_report.py).
"""

from __future__ import annotations

import argparse
import math
import shlex
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from edge0_eval.errors import ConfigError, Edge0Error
from edge0_eval import cli_types as ct
from edge0_eval.evaluation import fidelity_report
from edge0_eval.evaluation.benchmarks import Benchmark, benchmark_for
from edge0_eval.evaluation.outputs import (BENCHMARK_ORDER, Run, expand_outputs,
                                            load_dataset_result, load_run)
from edge0_eval.evaluation.predictions import engine_summary, strict_loads
from edge0_eval.evaluation.settings import arm_settings, settings_differences
from edge0_eval.evaluation.report_writers import write_report

SCHEMA = "edge0-eval/report/v1"
Z95 = 1.96
# Table and plot order. student = prerouted + LoRA; the other two are ablations.
ARM_NAMES = ("teacher", "int4_exact", "prerouted_nolora", "student")
# Worst first: an arm's status on a benchmark is the worst of its datasets'.
_ARM_STATUS_ORDER = ("missing", "failed", "no_details", "inconsistent", "ok")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("outputs", nargs="+", metavar="OUTPUTS",
                        help="OpenCompass output folders: a run (<work_dir>/<timestamp>) or a "
                             "work_dir (its latest run); teacher and student may be in "
                             "different ones")
    parser.add_argument("--out", required=True, metavar="DIR", type=ct.directory,
                        help="folder for report.md, report.csv, report.json, report.png")
    parser.add_argument("--arms", metavar="NAME=ABBR,...",
                        help="model abbr per arm: teacher, student (prerouted + LoRA), and "
                             "optionally int4_exact, prerouted_nolora. Default: the two models "
                             "found, the one whose abbr contains 'teacher' as teacher")
    parser.add_argument("--reference", metavar="FILE",
                        help="published numbers to show as extra columns "
                             "(e.g. reports/reference/edge0_35b.json)")


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file; --out names a folder for report.md, "
                          f"report.csv, report.json and report.png")
    runs = [load_run(p) for p in expand_outputs(args.outputs)]
    reference = load_reference(args.reference) if args.reference else None
    command = command_line(args)
    report = build_report(runs, parse_arms(args.arms, _model_index(runs)), reference, command)
    write_report(report, out)
    bad = [f"{b['benchmark']}: {b['status']}" for b in report["benchmarks"] if b["status"] != "ok"]
    fidelity = report.get("fidelity")
    if fidelity is not None and fidelity.get("status") != "ok":
        bad.append(f"fidelity: {fidelity.get('status')}")
    if not report["benchmarks"] and fidelity is None:
        bad = ["no benchmark or fidelity results found"]
    print(f"wrote {out}/report.{{md,csv,json,png}}"
          + (f"; not ok: {', '.join(bad)}" if bad else ""))
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


# --------------------------------------------------------------------------- arms

def _shown(path: Path) -> str:
    """A run folder as the user gave it (relative stays relative: reports get committed)."""
    return str(path)


def _model_index(runs: list[Run]) -> dict[str, Run]:
    index: dict[str, Run] = {}
    for r in runs:
        for model in r.models:
            if model in index:
                raise Edge0Error(f"model {model!r} is in both {index[model].path} and {r.path}; "
                                 f"pass only the run folder that should count")
            index[model] = r
    return index


def parse_arms(spec: str | None, index: dict[str, Run]) -> dict[str, tuple[str, Run]]:
    """arm name -> (model abbr, run)."""
    found = ", ".join(index) or "none"
    if spec is None:
        teachers = [m for m in index if "teacher" in m.lower()]
        if len(index) != 2 or len(teachers) != 1:
            raise ConfigError(f"cannot tell teacher from student among the models found "
                              f"({found}); pass --arms teacher=ABBR,student=ABBR")
        student = next(m for m in index if m != teachers[0])
        return {"teacher": (teachers[0], index[teachers[0]]), "student": (student, index[student])}
    arms = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, sep, abbr = part.partition("=")
        if not sep or name not in ARM_NAMES:
            raise ConfigError(f"--arms: {part!r} is not NAME=ABBR with NAME one of "
                              f"{', '.join(ARM_NAMES)}")
        if abbr not in index:
            raise ConfigError(f"--arms: no model {abbr!r} in the outputs (found: {found})")
        if name in arms:
            raise ConfigError(f"--arms names {name} twice")
        twice = [other for other, (a, _) in arms.items() if a == abbr]
        if twice:
            raise ConfigError(f"--arms: {abbr!r} is given as both {twice[0]} and {name}; each "
                              f"arm must be a different model (a teacher compared with itself "
                              f"always shows gap 0)")
        arms[name] = (abbr, index[abbr])
    for needed in ("teacher", "student"):
        if needed not in arms:
            raise ConfigError(f"--arms must name the {needed} (models found: {found})")
    return {name: arms[name] for name in ARM_NAMES if name in arms}


# --------------------------------------------------------------------------- collection

@dataclass
class ArmBench:
    """One arm on one benchmark, its datasets (MMLU-Pro categories) pooled per question."""
    abbr: str
    status: str = "missing"
    metric: str | None = None
    datasets: list[str] = field(default_factory=list)
    scores: dict[str, float] = field(default_factory=dict)         # item id -> [0, 1]
    extra: dict[str, dict[str, float]] = field(default_factory=dict)
    versions: dict[str, str | None] = field(default_factory=dict)  # version key -> version
    category_scores: dict[str, float] = field(default_factory=dict)
    reported: float | None = None
    engine: list[dict] = field(default_factory=list)
    truncation: dict | None = field(default_factory=lambda: {"outputs": 0, "length": 0,
                                                             "open_thinking": 0})
    notes: list[str] = field(default_factory=list)

    @property
    def score(self) -> float | None:
        if self.status in ("ok", "inconsistent") and self.scores:
            return _mean(self.scores.values()) * 100.0
        return self.reported   # no_details: the results file's metric, unpaired


def _collect_arm(abbr: str, run: Run) -> dict[str, tuple[Benchmark, ArmBench]]:
    by_bench: dict[str, tuple[Benchmark, ArmBench]] = {}
    for dataset in run.datasets:
        if fidelity_report.is_fidelity(dataset):
            continue   # not a benchmark: its own section (fidelity_report.py)
        bench = benchmark_for(dataset)
        _, ab = by_bench.setdefault(bench.name, (bench, ArmBench(abbr)))
        if ab.datasets and not bench.pooled:
            raise Edge0Error(f"{run.path}: datasets {ab.datasets[0]} and {dataset} both map to "
                             f"{bench.name} for {abbr}; evaluate only one of them")
        ab.datasets.append(dataset)
        res = load_dataset_result(run, abbr, bench, dataset)
        # Pooled items are named by category; otherwise by example index, so arms scored under
        # different abbrs of one benchmark (aime2026 vs aime2026_mathverify) still pair.
        prefix = f"{dataset}/" if bench.pooled else ""
        ab.scores.update({prefix + k: v for k, v in res.scores.items()})
        for metric, items in res.extra.items():
            ab.extra.setdefault(metric, {}).update({prefix + k: v for k, v in items.items()})
        ab.versions[dataset if bench.pooled else ""] = res.version
        if res.scores:
            ab.category_scores[dataset] = _mean(res.scores.values()) * 100.0
        ab.reported = res.reported if len(ab.datasets) == 1 else None
        ab.metric = ab.metric or res.metric
        ab.engine += res.engine
        if ab.truncation is not None:     # one dataset without counts: none for the benchmark
            ab.truncation = None if res.truncation is None else {
                k: ab.truncation[k] + res.truncation[k] for k in ab.truncation}
        ab.notes += [f"{abbr}/{dataset}: {n}" for n in res.notes]
        ab.status = res.status if len(ab.datasets) == 1 else _worse(ab.status, res.status)
    return by_bench


def _worse(a: str, b: str) -> str:
    return min(a, b, key=_ARM_STATUS_ORDER.index)


def _check_versions(name: str, arms: dict[str, ArmBench], abbrs: dict[str, str]) -> list[str]:
    """Mismatched prompt versions on one benchmark, as messages naming both arms."""
    present = [a for a in ARM_NAMES if a in arms and arms[a].status != "missing"]
    problems = []
    for key in sorted({k for a in present for k in arms[a].versions}):
        known = [(a, arms[a].versions.get(key)) for a in present if arms[a].versions.get(key)]
        for arm, version in known[1:]:
            if version != known[0][1]:
                what = f"{name} ({key})" if key else name
                problems.append(f"{what}: {known[0][0]} {abbrs[known[0][0]]} has prompt version "
                                f"{known[0][1]} but {arm} {abbrs[arm]} has {version}")
    return problems


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

def load_reference(path: str) -> dict:
    try:
        ref = strict_loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:
        raise Edge0Error(f"--reference {path}: cannot read ({exc})") from exc
    arms = ref.get("arms") if isinstance(ref, dict) else None
    if not isinstance(arms, dict) or not all(
            isinstance(v, dict) and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                        for x in v.values())
            for v in arms.values()):
        raise Edge0Error(f"--reference {path}: expected {{\"arms\": {{\"teacher\": "
                         f"{{BENCHMARK: score}}, \"student\": {{...}}}}}}")
    ref.setdefault("file", str(path))
    return ref


def _sub(a, b):
    return None if a is None or b is None else a - b


def _ref_delta(ref: dict) -> float | None:
    # published numbers have one decimal; keep their difference free of float noise
    d = _sub(ref.get("student"), ref.get("teacher"))
    return None if d is None else round(d, 10)


def _status(rows: list[dict], fidelity: dict | None) -> str:
    """ok: something was measured (benchmarks or fidelity) and every part of it is ok."""
    parts = [r["status"] for r in rows] + ([fidelity["status"]] if fidelity is not None else [])
    return "ok" if parts and all(s == "ok" for s in parts) else "incomplete"


def build_report(runs: list[Run], arms: dict[str, tuple[str, Run]], reference: dict | None,
                 command: str) -> dict:
    abbrs = {arm: abbr for arm, (abbr, _) in arms.items()}
    collected = {arm: _collect_arm(abbr, r) for arm, (abbr, r) in arms.items()}
    names = {n for per in collected.values() for n in per}
    names = sorted(names, key=lambda n: (BENCHMARK_ORDER.index(n) if n in BENCHMARK_ORDER
                                         else len(BENCHMARK_ORDER), n))

    rows, problems, notes = [], [], [n for r in runs for n in r.notes]
    for name in names:
        per_arm = {arm: collected[arm][name][1] if name in collected[arm] else ArmBench(abbrs[arm])
                   for arm in arms}
        problems += _check_versions(name, per_arm, abbrs)
        bench = next(collected[a][name][0] for a in arms if name in collected[a])
        rows.append(_benchmark_row(name, bench, per_arm, abbrs, reference))
        notes += [n for ab in per_arm.values() for n in ab.notes]
        notes += [f"{name}: {n}" for n in rows[-1]["notes"]]
        notes += [f"{name}: prompt version of {arm} {ab.abbr} unknown (no summary csv or "
                  f"config); versions not compared" for arm, ab in per_arm.items()
                  if ab.status != "missing" and not _version_text(ab)]
    if problems:
        raise Edge0Error("refusing to compare different prompts: " + "; ".join(problems))
    settings = {arm: arm_settings(abbr, r, collected[arm]) for arm, (abbr, r) in arms.items()}
    problems = settings_differences(settings, "teacher")
    if problems:
        raise Edge0Error("refusing to pair arms run with different settings: "
                         + "; ".join(problems) + "; rerun one arm with the other's settings")
    notes += [f"{arm} {abbrs[arm]}: no config dump, so its generation and scoring settings are "
              f"not compared" for arm, st in settings.items() if st is None]

    engine = {arm: engine_summary([s for _, ab in collected[arm].values() for s in ab.engine])
              for arm in arms}
    fidelity = fidelity_report.build(arms)
    return {
        "schema": SCHEMA,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "outputs": [_shown(r.path) for r in runs],
        "arms": {arm: {"abbr": abbr, "run": _shown(r.path), "settings": settings[arm]}
                 for arm, (abbr, r) in arms.items()},
        "interval": {"method": "normal approximation on paired per-item differences "
                               "(student - teacher): mean +- z * sd / sqrt(n), sd with n - 1",
                     "level": 0.95, "z": Z95},
        "status": _status(rows, fidelity),
        "benchmarks": rows,
        "average": _average_row(rows, reference),
        "engine": engine,
        "fidelity": fidelity,
        "reference": None if reference is None else
        {k: reference.get(k) for k in ("name", "source", "file")},
        "notes": notes,
    }


def _benchmark_row(name: str, bench: Benchmark, per_arm: dict[str, ArmBench],
                   abbrs: dict[str, str], reference: dict | None) -> dict:
    teacher, student = per_arm["teacher"], per_arm["student"]
    status = _row_status(teacher, student)
    row = {
        "benchmark": name,
        "datasets": sorted({d for ab in per_arm.values() for d in ab.datasets}),
        "metric": bench.metric or teacher.metric or student.metric,
        "status": status,
        "items": len(teacher.scores) if status == "ok" else None,
        "version": _version_text(teacher) or _version_text(student),
        "teacher": teacher.score,
        "student": student.score,
        "delta": _sub(student.score, teacher.score),
        "gap": _sub(teacher.score, student.score),
        "delta_ci95": None,
        "delta_half_width": None,
        "delta_se": None,
        "decomposition": None,
        "arms": {arm: _arm_json(ab) for arm, ab in per_arm.items()},
        "reference": None,
        "notes": [],
    }
    if status == "ok":
        ids = sorted(teacher.scores)
        diffs = [100.0 * (student.scores[i] - teacher.scores[i]) for i in ids]
        mean, se = paired_mean_se(diffs)
        row["delta"], row["gap"] = mean, 0.0 - mean  # no -0.0
        if se is not None:
            half = Z95 * se
            row["delta_se"], row["delta_half_width"] = se, half
            row["delta_ci95"] = [mean - half, mean + half]
        row["decomposition"] = _decomposition(per_arm, row["notes"])
    elif status == "items_mismatch":
        row["notes"].append(f"item ids differ (teacher {len(teacher.scores)} items, student "
                            f"{len(student.scores)}); not paired")
    if reference:
        ref = {arm: reference["arms"].get(arm, {}).get(name) for arm in ("teacher", "student")}
        if any(v is not None for v in ref.values()):
            row["reference"] = {**ref, "delta": _ref_delta(ref)}
    return row


def _row_status(teacher: ArmBench, student: ArmBench) -> str:
    if "missing" in (teacher.status, student.status):
        return "missing_arm"
    for status in ("failed", "no_details", "inconsistent"):
        if status in (teacher.status, student.status):
            return status
    if set(teacher.scores) != set(student.scores):
        return "items_mismatch"
    return "ok"


def _version_text(ab: ArmBench) -> str | None:
    versions = sorted({v for v in ab.versions.values() if v})
    return ",".join(versions) or None


def _arm_json(ab: ArmBench) -> dict:
    out = {"abbr": ab.abbr, "status": ab.status, "score": ab.score,
           "items": len(ab.scores) if ab.scores else None, "datasets": ab.datasets,
           "version": _version_text(ab),
           "extra": {m: _mean(v.values()) * 100.0 for m, v in ab.extra.items() if v},
           "engine": engine_summary(ab.engine),
           # Outputs cut at the length limit, and of those still inside their thinking block.
           "truncation": ab.truncation if ab.truncation and ab.truncation["outputs"] else None,
           # Per-item outcomes, so another run (a baseline) pairs with this one item by item.
           "per_item": dict(sorted(ab.scores.items())) if ab.status == "ok" else None}
    if len(ab.datasets) > 1:   # pooled benchmark: also the summarizer's mean of categories
        out["categories"] = ab.category_scores
        out["category_mean"] = (_mean(ab.category_scores.values())
                                if len(ab.category_scores) == len(ab.datasets) else None)
    return out


def _decomposition(per_arm: dict[str, ArmBench], notes: list[str]) -> dict | None:
    """Gap = quantization loss + routing loss - LoRA recovery, from the ablation arms."""
    if "int4_exact" not in per_arm and "prerouted_nolora" not in per_arm:
        return None
    teacher = per_arm["teacher"]

    def score(arm):  # an ablation counts only when scored on exactly the teacher's items
        ab = per_arm.get(arm)
        if ab is None:
            return None
        if ab.status != "ok" or set(ab.scores) != set(teacher.scores):
            notes.append(f"{arm} {ab.abbr} left out of the decomposition ({ab.status}, "
                         f"{len(ab.scores)} of the teacher's {len(teacher.scores)} items)")
            return None
        return ab.score

    t, q, p, s = score("teacher"), score("int4_exact"), score("prerouted_nolora"), score("student")
    return {"teacher": t, "int4_exact": q, "prerouted_nolora": p, "student": s,
            "quantization_loss": _sub(t, q), "routing_loss": _sub(q, p),
            "lora_recovery": _sub(s, p), "total_gap": _sub(t, s)}


def _average_row(rows: list[dict], reference: dict | None) -> dict:
    """Unweighted mean over benchmarks (as the paper's avg), only over benchmarks that are ok."""
    ok = [r for r in rows if r["status"] == "ok"]
    avg = {"benchmarks": [r["benchmark"] for r in ok],
           "complete": bool(rows) and len(ok) == len(rows),
           "teacher": None, "student": None, "delta": None, "gap": None,
           "delta_ci95": None, "delta_half_width": None, "decomposition": None,
           "reference": None}
    if ok:
        for key in ("teacher", "student", "delta", "gap"):
            avg[key] = _mean(r[key] for r in ok)
        if all(r["delta_se"] is not None for r in ok):
            # Benchmarks are independent samples: var(mean) = sum(se^2) / B^2.
            half = Z95 * math.sqrt(sum(r["delta_se"] ** 2 for r in ok)) / len(ok)
            avg["delta_half_width"] = half
            avg["delta_ci95"] = [avg["delta"] - half, avg["delta"] + half]
        decs = [r["decomposition"] for r in ok]
        if all(decs):
            avg["decomposition"] = {k: (_mean(d[k] for d in decs)
                                        if all(d[k] is not None for d in decs) else None)
                                    for k in decs[0]}
    if reference and reference.get("average"):
        ref = {arm: reference["average"].get(arm) for arm in ("teacher", "student")}
        avg["reference"] = {**ref, "delta": _ref_delta(ref)}
    return avg
