"""`edge0-eval gate-baseline`: a baseline from several runs' reports (hand-made OpenCompass
trees), its spread, the gate against it, and the refusals: runs that are not one config's, and
(fail closed) settings the gate cannot verify."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from oc_tree import OCRun

from edge0_eval.cli import main

T, S = "qwen-teacher-fp16", "edge0-student"
ITEMS = 100
TEACHER = [1] * 80 + [0] * 20


def student(lost: range) -> list[int]:
    out = list(TEACHER)
    for i in lost:
        out[i] = 0
    return out


def report(tmp_path: Path, name: str, outcomes: list[int], **finish) -> Path:
    run = OCRun(tmp_path / name)
    run.add(T, "GPQA_diamond", TEACHER)
    run.add(S, "GPQA_diamond", outcomes)
    out = tmp_path / f"{name}_report"
    assert main(["report", str(run.finish(**finish)), "--out", str(out)]) == 0
    return out / "report.json"


@pytest.fixture
def runs(tmp_path) -> list[Path]:
    """Three runs of one student whose outcomes churn: each loses 4 items, other ones."""
    return [
        report(tmp_path, f"run{k}", student(range(4 * k, 4 * k + 4))) for k in range(3)
    ]


def test_baseline_of_runs_holds_means_runs_and_spread(tmp_path, runs, capsys):
    out = tmp_path / "baseline.json"
    assert main(["gate-baseline", *map(str, runs), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "gate-baseline: 3 runs" in printed
    assert "GPQA-Diamond: student 76.00, 76.00, 76.00 (sd 0.00 points)" in printed
    base = json.loads(out.read_text())
    row = base["benchmarks"][0]
    arm = row["arms"]["student"]
    assert arm["per_item_runs"]["0"] == [0, 1, 1] and arm["per_item"]["0"] == 2 / 3
    assert row["student"] == pytest.approx(76.0) and base["baseline"]["runs"] == 3
    # Each pair of runs differs on 8 of 100 items.
    assert row["baseline_runs"]["churn"] == pytest.approx(0.08)
    # The gate pairs a run with the baseline's runs (paired.baseline_change) and says what
    # its false-fail statement covers.
    same = report(tmp_path, "again", student(range(12, 16)))
    assert main(["gate", str(same), "--baseline", str(out), "--accept-blind"]) == 0
    printed = capsys.readouterr().out
    assert "gate: baseline of 3 runs; its own spread: GPQA-Diamond" in printed
    assert "for all but 1% of baselines of 3 runs" in printed
    worse = report(tmp_path, "worse", student(range(30)))
    assert main(["gate", str(worse), "--baseline", str(out), "--accept-blind"]) == 1
    line = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("GPQA"))
    assert "student dropped 26.00" in line and "baseline-runs p=" in line


def test_runs_of_other_configs_or_too_few_are_refused(tmp_path, runs, capsys):
    out = str(tmp_path / "b.json")
    assert main(["gate-baseline", str(runs[0]), "--out", out]) == 2
    assert "needs at least 2 reports" in capsys.readouterr().err
    fewer = tmp_path / "fewer"
    run = OCRun(fewer)
    run.add(T, "GPQA_diamond", TEACHER[:50])
    run.add(S, "GPQA_diamond", TEACHER[:50])
    assert main(["report", str(run.finish()), "--out", str(tmp_path / "fr")]) == 0
    other = tmp_path / "fr" / "report.json"
    assert main(["gate-baseline", str(runs[0]), str(other), "--out", out]) == 2
    assert "not a run like" in capsys.readouterr().err


def test_settings_the_gate_cannot_verify_are_refused(tmp_path, runs, capsys):
    """Fail closed: a run without a config dump was compared on nothing, silently; a field
    only one side records was skipped."""
    bare = report(tmp_path, "bare", TEACHER, config=False)
    assert main(["gate", str(bare), "--baseline", str(runs[0])]) == 2
    assert "this report has no config dump" in capsys.readouterr().err
    assert main(["gate", str(runs[0]), "--baseline", str(bare)]) == 2
    assert "the baseline has no config dump" in capsys.readouterr().err
    extra = json.loads(runs[1].read_text())
    for entry in extra["arms"].values():
        entry["settings"]["generation"]["new_field"] = 1
    path = tmp_path / "extra.json"
    path.write_text(json.dumps(extra))
    assert main(["gate", str(path), "--baseline", str(runs[0])]) == 2
    assert "new_field: not recorded in the baseline" in capsys.readouterr().err
