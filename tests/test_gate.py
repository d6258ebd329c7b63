"""`edge0-eval gate` outcomes on reports built from hand-made OpenCompass trees."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from oc_tree import OCRun

from edge0_eval.cli import main
from edge0_eval.evaluation.gate.checks import BLIND_EXIT, evaluate

T, S = "qwen-teacher-fp16", "edge0-student"

# GPQA-Diamond with 100 items: the teacher gets items 0..79 right; the student the same items
# except `lost` of them, starting at `shift`.


def build(
    root: Path,
    lost: int,
    *,
    aime_failed=False,
    drop_ifbench=False,
    he_items=5,
    gpqa_prompt="{question}",
    shift: int = 0,
) -> Path:
    run = OCRun(root)
    teacher = [1] * 80 + [0] * 20
    student = [1] * 80 + [0] * 20
    for i in range(
        shift, shift + lost
    ):  # the student loses these of the teacher's items
        student[i] = 0
    run.add(T, "GPQA_diamond", teacher, prompt=gpqa_prompt)
    run.add(S, "GPQA_diamond", student, prompt=gpqa_prompt)
    run.add(T, "aime2026", [1, 1, 0, 0])
    run.add(S, "aime2026", [1, 0, 0, 0], failed="missing" if aime_failed else None)
    run.add(T, "openai_humaneval", [1] * he_items)
    run.add(S, "openai_humaneval", [1] * (he_items - 1) + [0])
    if not drop_ifbench:
        run.add(T, "IFBench", [1, 1, 0, 0], loose=[1, 1, 1, 0])
        run.add(S, "IFBench", [1, 0, 0, 0], loose=[1, 1, 0, 0])
    return run.finish()


def report(tmp_path: Path, name: str, rc: int = 0, **kw) -> Path:
    run_dir = build(tmp_path / name, **kw)
    out = tmp_path / f"{name}_report"
    assert main(["report", str(run_dir), "--out", str(out)]) == rc
    return out / "report.json"


def gate(current: Path, baseline: Path, *extra, accept_blind: bool = True) -> int:
    """The gate; these samples (4-5 items, and 100) cannot see 2 points, so accept that
    unless a test is about it."""
    blind = ["--accept-blind"] if accept_blind else []
    return main(["gate", str(current), "--baseline", str(baseline), *extra, *blind])


@pytest.fixture
def baseline(tmp_path):
    return report(tmp_path, "base", lost=2)  # student gap 2 points on GPQA


def test_identical_report_passes(tmp_path, baseline, capsys):
    assert gate(report(tmp_path, "same", lost=2), baseline) == 0
    out = capsys.readouterr().out
    assert "gate: pass" in out
    for name in ("AIME 2026", "HumanEval", "GPQA-Diamond", "IFBench"):
        assert name in out


def test_churn_without_a_drop_passes(tmp_path, baseline, capsys):
    """A rerun after a numerical change redraws which items the student gets: paired item by
    item, two lost and two regained is no drop (the unpaired gate saw only the totals)."""
    assert gate(report(tmp_path, "churn", lost=2, shift=40), baseline) == 0
    line = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("GPQA"))
    assert "pass" in line and "+0.00" in line


def test_crafted_regression_fails(tmp_path, baseline, capsys):
    # 13 more items lost, none regained: the paired test's p is at most 2**-13
    assert gate(report(tmp_path, "regress", lost=15), baseline) == 1
    out = capsys.readouterr().out
    line = next(l for l in out.splitlines() if l.startswith("GPQA"))
    assert "FAIL" in line
    assert "student dropped 13.00 (paired on 100 items, mcnemar-randomized p=" in line
    assert "gap widened +13.00 (paired, sign-flip-midp p=" in line
    # The randomized verdict prints the exact and mid-p beside its own.
    assert "(exact 0.000122, mid-p 6.1e-05)" in line
    assert "gate: FAIL (1 of 4: GPQA-Diamond)" in out
    # the false-fail rate the user accepts decides: at alpha 1e-9 it is not evidence enough
    assert (
        gate(tmp_path / "regress_report" / "report.json", baseline, "--alpha", "1e-9")
        == 0
    )


def test_a_sample_too_small_to_see_the_drop_says_so(tmp_path, baseline, capsys):
    """AIME here has 4 items: no drop of 2 points can be seen, and the gate says so, with an
    exit status of its own unless told to accept it (it exited 0)."""
    same = report(tmp_path, "same", lost=2)
    assert gate(same, baseline, accept_blind=False) == BLIND_EXIT == 4
    out = capsys.readouterr().out
    aime = next(l for l in out.splitlines() if l.startswith("AIME"))
    assert "cannot see a 2-point drop" in aime
    assert "cannot see the drop asked about (AIME 2026" in out
    assert "gate: BLIND (exit 4)" in out
    assert gate(same, baseline) == 0
    assert "gate: BLIND" not in capsys.readouterr().out
    # A failure still wins over blindness.
    assert gate(report(tmp_path, "regress", lost=15), baseline, accept_blind=False) == 1


def test_failed_task_fails(tmp_path, baseline, capsys):
    assert (
        gate(report(tmp_path, "failed", rc=1, lost=2, aime_failed=True), baseline) == 1
    )
    line = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("AIME"))
    assert "FAIL" in line and "failed (student failed)" in line


def test_missing_benchmark_fails(tmp_path, baseline, capsys):
    assert gate(report(tmp_path, "missing", lost=2, drop_ifbench=True), baseline) == 1
    line = next(
        l for l in capsys.readouterr().out.splitlines() if l.startswith("IFBench")
    )
    assert "FAIL" in line and "missing from the report" in line


def test_item_count_change_is_refused(tmp_path, baseline, capsys):
    """One more HumanEval item: another sample, whose data digest is another size. It was
    compared only on equal sizes; now the gate refuses the baseline, naming the data."""
    assert gate(report(tmp_path, "items", lost=2, he_items=6), baseline) == 2
    err = capsys.readouterr().err
    assert "student openai_humaneval data {'predictions': 6," in err
    assert "baseline {'predictions': 5," in err


def test_prompt_version_change_fails(tmp_path, baseline, capsys):
    assert (
        gate(report(tmp_path, "prompt", lost=2, gpqa_prompt="Q: {question}"), baseline)
        == 1
    )
    line = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("GPQA"))
    assert "FAIL" in line and "prompt version" in line


def test_missing_arm_fails(tmp_path, baseline, capsys):
    cur = json.loads(baseline.read_text())
    row = next(r for r in cur["benchmarks"] if r["benchmark"] == "HumanEval")
    row["status"] = "missing_arm"
    row["arms"]["student"]["status"] = "missing"
    path = tmp_path / "cur.json"
    path.write_text(json.dumps(cur))
    assert gate(path, baseline) == 1
    line = next(
        l for l in capsys.readouterr().out.splitlines() if l.startswith("HumanEval")
    )
    assert "missing_arm (student missing)" in line


def _row(name, teacher, student, hw, items=100, status="ok", version="abcdef"):
    return {
        "benchmark": name,
        "status": status,
        "items": items,
        "version": version,
        "teacher": teacher,
        "student": student,
        "gap": teacher - student,
        "delta_half_width": hw,
        "arms": {},
    }


def test_thresholds_exactly():
    base = {"benchmarks": [_row("A", 80.0, 78.0, 3.0), _row("B", 80.0, 78.0, 3.0)]}
    # A: gap +5.0 == 2.0 + 3.0 (not beyond) -> pass; B: gap +5.5 > 5.0 -> FAIL
    cur = {
        "benchmarks": [
            _row("A", 80.0, 73.0, 3.0),
            _row("B", 80.5, 73.0, 3.0),
            _row("C", 50.0, 50.0, 1.0),
        ]
    }
    checks = {c.benchmark: c for c in evaluate(cur, base, 2.0, 10.0)}
    assert checks["A"].result == "pass" and checks["A"].gap_increase == pytest.approx(
        5.0
    )
    assert checks["B"].result == "FAIL" and checks["B"].gap_increase == pytest.approx(
        5.5
    )
    assert checks["B"].drop == pytest.approx(5.0)  # within max_drop 10 + 3
    assert checks["C"].result == "new"  # not in the baseline: shown, not gated
    # the student drop alone fails, even when the teacher dropped too (gap unchanged)
    cur = {"benchmarks": [_row("A", 70.0, 68.0, 1.0), _row("B", 80.0, 78.0, 1.0)]}
    checks = {c.benchmark: c for c in evaluate(cur, base, 2.0, 2.0)}
    assert checks["A"].result == "FAIL" and checks["A"].reasons[1:] == [
        "student dropped 10.00 > 2 + 1.00"
    ]
    assert (
        checks["A"]
        .reasons[0]
        .startswith("unpaired: the baseline has no per-item outcomes")
    )
    assert checks["B"].result == "pass"
    # a baseline row that was not ok cannot vouch for anything
    bad_base = {"benchmarks": [_row("A", 80.0, 78.0, 3.0, status="failed")]}
    assert evaluate(cur, bad_base, 2.0, 2.0)[0].result == "FAIL"


def test_gate_rejects_non_report(tmp_path, baseline, capsys):
    other = tmp_path / "x.json"
    other.write_text(json.dumps({"arms": {}}))
    assert gate(other, baseline) == 2
    assert "not an edge0-eval report" in capsys.readouterr().err
