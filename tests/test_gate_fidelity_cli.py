"""Through the command line, on the committed tiny gate report: a baseline of three scorings
that jitter (3% of each prompt's KL) catches every prompt's KL x1.10 and passes a fourth
scoring; a baseline whose arms lack one the gate judges is refused (fail closed)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest

from edge0_eval.cli import main

TINY = Path(__file__).resolve().parent.parent / "reports/tiny_gate/report.json"


def _scoring(tmp_path: Path, name: str, rng, factor: float = 1.0) -> str:
    """The tiny gate report with its non-teacher arms' per-prompt KL jittered by 3%."""
    report = json.loads(TINY.read_text())
    fid = report["fidelity"]
    for arm, items in fid["per_item"].items():
        if arm == "teacher":
            continue
        for pair in items.values():
            pair[0] *= factor * (1 + 0.03 * rng.normal())
        fid["arms"][arm]["kl"] = float(np.mean([p[0] for p in items.values()]))
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(report))
    return str(path)


def test_a_three_run_baseline_catches_a_uniform_kl_rise(tmp_path, capsys):
    rng = np.random.default_rng(11)
    runs = [_scoring(tmp_path, f"run{k}", rng) for k in range(3)]
    base = str(tmp_path / "baseline.json")
    assert main(["gate-baseline", *runs, "--out", base]) == 0
    gate = ["--baseline", base, "--accept-blind"]
    assert main(["gate", _scoring(tmp_path, "risen", rng, 1.10), *gate]) == 1
    printed = capsys.readouterr().out
    assert "fidelity student" in printed and "KL rose" in printed
    assert main(["gate", _scoring(tmp_path, "again", rng), *gate]) == 0
    passed = next(l for l in capsys.readouterr().out.splitlines() if "gate: pass" in l)
    assert "student: mean KL move at most" in passed
    assert "noise of the mean over the baseline's 3 runs" in passed


@pytest.mark.parametrize("arms", [{}, "no student"])
def test_a_baseline_whose_arms_lack_a_judged_arm_is_refused(tmp_path, capsys, arms):
    report = json.loads(TINY.read_text())
    base = copy.deepcopy(report)
    if arms == {}:
        base["arms"] = {}
    else:
        del base["arms"]["student"]
    paths = [tmp_path / "base.json", tmp_path / "now.json"]
    for path, data in zip(paths, (base, report)):
        path.write_text(json.dumps(data))
    assert main(["gate", str(paths[1]), "--baseline", str(paths[0])]) == 2
    err = capsys.readouterr().err
    assert "'student'" in err and "have no settings" in err and str(paths[0]) in err
