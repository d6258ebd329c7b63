"""The arms of a report: which model abbr is which arm, and what each arm scored on each
benchmark (its datasets pooled per question for MMLU-Pro), read from the run folders.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from edge0_eval.errors import ConfigError, Edge0Error
from edge0_eval.evaluation.benchmarks import Benchmark, benchmark_for
from edge0_eval.evaluation.fidelity import report as fidelity_report
from edge0_eval.evaluation.outputs.runs import Run, load_dataset_result

# Table and plot order. student = prerouted + LoRA; the other two are ablations.
ARM_NAMES = ("teacher", "int4_exact", "prerouted_nolora", "student")
# Worst first: an arm's status on a benchmark is the worst of its datasets'.
_ARM_STATUS_ORDER = (
    "missing",
    "failed",
    "no_details",
    "inconsistent",
    "no_predictions",
    "ok",
)


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def shown(path: Path) -> str:
    """A run folder as the user gave it (relative stays relative: reports get committed)."""
    return str(path)


def model_index(runs: list[Run]) -> dict[str, Run]:
    index: dict[str, Run] = {}
    for r in runs:
        for model in r.models:
            if model in index:
                raise Edge0Error(
                    f"model {model!r} is in both {index[model].path} and {r.path}; "
                    f"pass only the run folder that should count"
                )
            index[model] = r
    return index


def parse_arms(spec: str | None, index: dict[str, Run]) -> dict[str, tuple[str, Run]]:
    """arm name -> (model abbr, run)."""
    found = ", ".join(index) or "none"
    if spec is None:
        teachers = [m for m in index if "teacher" in m.lower()]
        if len(index) != 2 or len(teachers) != 1:
            raise ConfigError(
                f"cannot tell teacher from student among the models found "
                f"({found}); pass --arms teacher=ABBR,student=ABBR"
            )
        student = next(m for m in index if m != teachers[0])
        return {
            "teacher": (teachers[0], index[teachers[0]]),
            "student": (student, index[student]),
        }
    arms = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, sep, abbr = part.partition("=")
        if not sep or name not in ARM_NAMES:
            raise ConfigError(
                f"--arms: {part!r} is not NAME=ABBR with NAME one of "
                f"{', '.join(ARM_NAMES)}"
            )
        if abbr not in index:
            raise ConfigError(
                f"--arms: no model {abbr!r} in the outputs (found: {found})"
            )
        if name in arms:
            raise ConfigError(f"--arms names {name} twice")
        twice = [other for other, (a, _) in arms.items() if a == abbr]
        if twice:
            raise ConfigError(
                f"--arms: {abbr!r} is given as both {twice[0]} and {name}; each "
                f"arm must be a different model (a teacher compared with itself "
                f"always shows gap 0)"
            )
        arms[name] = (abbr, index[abbr])
    for needed in ("teacher", "student"):
        if needed not in arms:
            raise ConfigError(f"--arms must name the {needed} (models found: {found})")
    return {name: arms[name] for name in ARM_NAMES if name in arms}


@dataclass
class ArmBench:
    """One arm on one benchmark, its datasets (MMLU-Pro categories) pooled per question."""

    abbr: str
    status: str = "missing"
    metric: str | None = None
    datasets: list[str] = field(default_factory=list)
    scores: dict[str, float] = field(default_factory=dict)  # item id -> [0, 1], avg@n
    # item id -> sample records
    samples: dict[str, list[dict]] = field(default_factory=dict)
    extra: dict[str, dict[str, float]] = field(default_factory=dict)
    # version key -> version
    versions: dict[str, str | None] = field(default_factory=dict)
    category_scores: dict[str, float] = field(default_factory=dict)
    reported: float | None = None
    engine: list[dict] = field(default_factory=list)
    data: dict[str, dict | None] = field(default_factory=dict)  # dataset -> data digest
    identities: list[dict | None] = field(default_factory=list)  # one per dataset
    notes: list[str] = field(default_factory=list)

    @property
    def score(self) -> float | None:
        if self.status in ("ok", "inconsistent", "no_predictions") and self.scores:
            return _mean(self.scores.values()) * 100.0
        return self.reported  # no_details: the results file's metric, unpaired


def collect_arm(abbr: str, run: Run) -> dict[str, tuple[Benchmark, ArmBench]]:
    by_bench: dict[str, tuple[Benchmark, ArmBench]] = {}
    for dataset in run.datasets:
        if fidelity_report.is_fidelity(dataset):
            continue  # not a benchmark: its own section (fidelity/report.py)
        bench = benchmark_for(dataset)
        _, ab = by_bench.setdefault(bench.name, (bench, ArmBench(abbr)))
        if ab.datasets and not bench.pooled:
            raise Edge0Error(
                f"{run.path}: datasets {ab.datasets[0]} and {dataset} both map to "
                f"{bench.name} for {abbr}; evaluate only one of them"
            )
        ab.datasets.append(dataset)
        res = load_dataset_result(run, abbr, bench, dataset)
        # Pooled items are named by category; otherwise by example index, so arms scored under
        # different abbrs of one benchmark (aime2026 vs aime2026_mathverify) still pair.
        prefix = f"{dataset}/" if bench.pooled else ""
        ab.scores.update({prefix + k: v for k, v in res.scores.items()})
        ab.samples.update({prefix + k: v for k, v in res.samples.items()})
        ab.data[dataset] = res.data
        ab.identities.append(res.identity)
        for metric, items in res.extra.items():
            ab.extra.setdefault(metric, {}).update(
                {prefix + k: v for k, v in items.items()}
            )
        ab.versions[dataset if bench.pooled else ""] = res.version
        if res.scores:
            ab.category_scores[dataset] = _mean(res.scores.values()) * 100.0
        ab.reported = res.reported if len(ab.datasets) == 1 else None
        ab.metric = ab.metric or res.metric
        ab.engine += res.engine
        ab.notes += [f"{abbr}/{dataset}: {n}" for n in res.notes]
        ab.status = (
            res.status if len(ab.datasets) == 1 else _worse(ab.status, res.status)
        )
    return by_bench


def _worse(a: str, b: str) -> str:
    return min(a, b, key=_ARM_STATUS_ORDER.index)


def check_versions(
    name: str, arms: dict[str, ArmBench], abbrs: dict[str, str]
) -> list[str]:
    """Mismatched prompt versions on one benchmark, as messages naming both arms."""
    present = [a for a in ARM_NAMES if a in arms and arms[a].status != "missing"]
    problems = []
    for key in sorted({k for a in present for k in arms[a].versions}):
        known = [
            (a, arms[a].versions.get(key)) for a in present if arms[a].versions.get(key)
        ]
        for arm, version in known[1:]:
            if version != known[0][1]:
                what = f"{name} ({key})" if key else name
                problems.append(
                    f"{what}: {known[0][0]} {abbrs[known[0][0]]} has prompt version "
                    f"{known[0][1]} but {arm} {abbrs[arm]} has {version}"
                )
    return problems


def version_text(ab: ArmBench) -> str | None:
    versions = sorted({v for v in ab.versions.values() if v})
    return ",".join(versions) or None


def fingerprint_parts(
    benches: dict[str, tuple[Benchmark, ArmBench]], notes: list[str], arm: str
) -> tuple[dict[str, dict | None], dict | None]:
    """(dataset -> data digest, the model identity) of one arm, for settings.arm_settings."""
    data = {d: digest for _, ab in benches.values() for d, digest in ab.data.items()}
    found = {
        repr(sorted(i.items())): i
        for _, ab in benches.values()
        for i in ab.identities
        if i is not None
    }
    if len(found) > 1:
        notes.append(
            f"{arm}: its datasets were generated by {len(found)} different models "
            f"(model_identity in the engine stats differs between datasets)"
        )
    return data, next(iter(found.values())) if len(found) == 1 else None
