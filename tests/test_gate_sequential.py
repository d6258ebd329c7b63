"""`edge0-eval gate --sequential` on the reports of a gate run's rounds (hand-made trees): the
rule that stopped each benchmark, the round it fired in, and the errors for rounds that are
not one run."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from oc_tree import OCRun

from edge0_eval.cli import main
from edge0_eval.evaluation.gate.rounds import run_order
from edge0_eval.evaluation.gate.sequential_checks import UNDECIDED_EXIT, check_benchmark

T, S = "qwen-teacher-fp16", "edge0-student"
ITEMS = 120
TEACHER = [1] * 90 + [0] * 30
ASK = ["--benchmark-drop", "GPQA-Diamond=20"]


SEED = "c0ffee"  # the gate run's order seed (gate-run draws one per run)


def report(
    tmp_path: Path,
    name: str,
    student: list[int],
    items: int = ITEMS,
    teacher: list[int] = TEACHER,
    seed: str | None = SEED,
    ids: bool = True,
) -> Path:
    """The report of a round that has scored the first `items` of the sample in the run's
    order (rounds.run_order for the seed; None: the draw's own order, a whole run such as the
    baseline): item k of the round is question order[k] of the sample, and OpenCompass names
    it by its row (ids=False: by its place in the round, as no OpenCompass output does)."""
    order = run_order(len(teacher), seed or "", "GPQA_diamond")[:items]
    named = order if ids else None
    run = OCRun(tmp_path / name)
    for model, outcomes in ((T, teacher), (S, student)):
        picked = [outcomes[j] for j in order]
        run.add(model, "GPQA_diamond", picked, questions=order, ids=named)
    out = tmp_path / f"{name}_report"
    assert main(["report", str(run.finish()), "--out", str(out)]) == 0
    return out / "report.json"


def gate(baseline: Path, *rounds: Path, extra=ASK, seed: str = SEED) -> int:
    return main(
        [
            "gate",
            *map(str, rounds),
            "--baseline",
            str(baseline),
            "--sequential",
            "--order-seed",
            seed,
            "--accept-blind",
            *extra,
        ]
    )


def _line(out: str) -> str:
    return next(l for l in out.splitlines() if l.startswith("GPQA"))


@pytest.fixture
def baseline(tmp_path):
    return report(tmp_path, "base", TEACHER, seed=None)


def test_same_student_is_decided_within_in_an_early_round(tmp_path, baseline, capsys):
    rounds = [
        report(tmp_path, f"r{i}", TEACHER, items=n) for i, n in enumerate((30, 60))
    ]
    assert gate(baseline, *rounds[:1]) == UNDECIDED_EXIT
    assert "undecided after 30 items" in capsys.readouterr().out
    assert gate(baseline, *rounds) == 0
    out = capsys.readouterr().out
    line = _line(out)
    assert "pass" in line and "student drop: within 20 points, decided at item" in line
    assert "(round 2;" in line
    assert (
        "1 sequential, each test at 0.025 = alpha 0.05 / 2 tests (1 decided within their "
        "max drop)"
    ) in out
    assert "probability at most 0.05 in all (Bonferroni over the 2 tests)" in out
    # Decided within 20 points, asked about 2 (the default): said, and counted as blind.
    assert "cannot see a 2-point drop: this sample is sized for 20 points" in line
    assert "1 check(s) cannot see the drop asked about (GPQA-Diamond)" in out


def test_broken_student_fails_in_the_first_round(tmp_path, baseline, capsys):
    broken = [0] * ITEMS  # loses every item the teacher gets
    assert gate(baseline, report(tmp_path, "r0", broken, items=30)) == 1
    out = capsys.readouterr().out
    assert "FAIL" in _line(out) and "student drop: regressed" in _line(out)
    assert "(round 1; e-value" in _line(out)
    assert "gate: FAIL (1 of 1: GPQA-Diamond)" in out
    assert _line(out).count("student drop: regressed") == 1  # said once, as a failure


def test_gate_run_passes_round_shares_to_the_gate_digit_for_digit():
    """The gate recomputes each round's items from the shares: ceil(2/3 x 3) = 2, but a
    share printed as 0.666667 would give 3."""
    from edge0_eval.gate import _share_list
    from edge0_eval.gate_run import _gate_args

    rounds = [1 / 3, 2 / 3, 1.0]
    args = _gate_args(["r1.json"], "b.json", "7", rounds, {}, False)
    assert _share_list(args[args.index("--rounds") + 1]) == rounds


def test_undecided_on_the_whole_sample_cannot_see(tmp_path, baseline, capsys):
    # 8 of the teacher's items lost, 8 others regained: no drop, and 120 items at this churn
    # cannot decide a 2-point threshold.
    churn = list(TEACHER)
    for i in range(8):
        churn[i], churn[100 + i] = 0, 1
    assert gate(baseline, report(tmp_path, "all", churn), extra=[]) == 0
    out = capsys.readouterr().out
    assert (
        "cannot see a 2-point drop: the whole sample (120 items) left the sequential rule undecided"
        in out
    )
    assert "cannot see the drop asked about (GPQA-Diamond" in out


def test_rounds_that_are_not_one_run_are_refused(tmp_path, baseline, capsys):
    first = report(tmp_path, "r0", TEACHER, items=30)
    other = list(TEACHER)
    changed = run_order(ITEMS, SEED, "GPQA_diamond")[3]  # the run's 4th item
    other[changed] = 1 - other[changed]
    second = report(tmp_path, "r1", other, items=60)
    assert gate(baseline, first, second) == 2
    err = capsys.readouterr().err
    assert f"GPQA-Diamond student item {changed} is scored otherwise than in" in err
    # Given backwards, the first round's items are missing from the "later" one.
    assert gate(baseline, report(tmp_path, "r2", TEACHER, items=60), first) == 2
    assert "is missing than in" in capsys.readouterr().err


def test_rounds_are_checked_item_by_item_against_the_baseline(
    tmp_path, baseline, capsys
):
    """A round's items in the run's order pair with the baseline's by their rows; items named
    otherwise (by their place in the round) would pair with other questions: each item's
    digest against the baseline's refuses that. The seed is required."""
    first = report(tmp_path, "r0", TEACHER, items=30)
    assert gate(baseline, first) == UNDECIDED_EXIT
    capsys.readouterr()
    shuffled = report(tmp_path, "r1", TEACHER, items=30, ids=False)
    assert gate(baseline, shuffled) == 2
    assert "of this round's items are not the baseline's questions" in (
        capsys.readouterr().err
    )
    assert main(["gate", str(first), "--baseline", str(baseline), "--sequential"]) == 2
    assert "--sequential needs --order-seed SEED" in capsys.readouterr().err


def test_items_outside_the_baseline_are_refused(tmp_path, capsys):
    small = report(tmp_path, "small", TEACHER[:40], teacher=TEACHER[:40], seed=None)
    assert gate(small, report(tmp_path, "r0", TEACHER, items=60)) == 2
    assert "of this round's items are not the baseline's questions" in (
        capsys.readouterr().err
    )


def test_bad_options_are_one_error(tmp_path, baseline, capsys):
    one = report(tmp_path, "r0", TEACHER, items=30)
    assert main(["gate", str(one), str(one), "--baseline", str(baseline)]) == 2
    assert "pass --sequential" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:  # argparse, at parse time
        gate(baseline, one, extra=["--benchmark-drop", "GPQA-Diamond=0"])
    assert exc.value.code == 2
    assert "'GPQA-Diamond=0': 0 must be in (0, 100]" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gate(baseline, one, extra=["--benchmark-drop", "GPQA-Diamond"])
    assert "'GPQA-Diamond' is not NAME=VALUE" in capsys.readouterr().err
    assert gate(baseline, one, extra=["--benchmark-drop", "AIME=5"]) == 2
    assert "not benchmarks of the baseline" in capsys.readouterr().err
    assert gate(baseline, one, extra=["--max-drop", "0"]) == 2
    assert "must be in (0, 100] points" in capsys.readouterr().err


def test_gate_run_undecided_after_its_last_round_is_an_error(tmp_path, monkeypatch):
    """`gate` answering 'run the next round' after the last one (a baseline holding items the
    sample never reaches) must not end `gate-run` as a pass. OpenCompass and the report are
    stood in for: the loop's decision is what is tested."""
    from edge0_eval import gate_run as gr
    from edge0_eval.errors import Edge0Error

    cfg = {
        "edge0_gate": {"rounds": [0.5, 1.0]},
        "models": [{"abbr": "edge0-x-teacher"}, {"abbr": "edge0-x-student"}],
        "datasets": [{"abbr": "d", "reader_cfg": {"test_range": 10}}],
    }
    calls = []
    monkeypatch.setattr(gr, "load_config_with", lambda config, env: cfg)
    monkeypatch.setattr(gr, "run_opencompass", lambda *a, **k: tmp_path / "run")
    monkeypatch.setattr(gr, "check_run", lambda *a: [])
    monkeypatch.setattr(
        gr,
        "cli_main",
        lambda args: calls.append(args) or (UNDECIDED_EXIT if args[0] == "gate" else 0),
    )
    with pytest.raises(Edge0Error, match=r"still undecided after the last round \(2\)"):
        gr.gate_run(Path("x.py"), "base.json", tmp_path / "w", {}, sequential=True)
    assert [c[0] for c in calls] == ["report", "gate", "report", "gate"]
    # The order seed was drawn before round 1, recorded, and given to every gate call.
    seed = (tmp_path / "w" / "order_seed.txt").read_text().strip()
    assert len(seed) == 16 and all(
        c[c.index("--order-seed") + 1] == seed for c in calls if c[0] == "gate"
    )


@pytest.mark.parametrize("sequential", [True, False])
def test_a_teacher_without_a_student_item_is_one_failure(
    tmp_path, baseline, capsys, sequential
):
    """The gap pairs teacher and student per item: a baseline whose teacher lacks one of the
    student's items fails naming it, in both modes (it raised KeyError)."""
    import json

    short = json.loads(baseline.read_text())
    per_item = short["benchmarks"][0]["arms"]["teacher"]["per_item"]
    gone = sorted(per_item)[-1]
    del per_item[gone]
    broken = tmp_path / "short.json"
    broken.write_text(json.dumps(short))
    extra = ASK + (["--sequential", "--order-seed", SEED] if sequential else [])
    whole = report(tmp_path, "all", TEACHER, seed=SEED if sequential else None)
    assert (
        main(
            [
                "gate",
                str(whole),
                "--baseline",
                str(broken),
                *extra,
            ]
        )
        == 1
    )
    line = _line(capsys.readouterr().out)
    assert "the baseline's teacher has no outcome for 1 of the student's items" in line
    assert f"(e.g. {gone})" in line


def test_a_round_that_lost_items_fails(tmp_path, baseline, capsys):
    """The last round's report with 30 of the items the baseline student passed removed: the
    round no longer holds what its order seed and round give, so the gate fails as the fixed
    gate does (before, it passed 'within')."""
    path = report(tmp_path, "all", TEACHER)
    data = json.loads(path.read_text())
    row = data["benchmarks"][0]
    lost = [i for i, v in row["arms"]["student"]["per_item"].items() if v == 1][:30]
    for entry in row["arms"].values():
        for i in lost:
            del entry["per_item"][i]
    path.write_text(json.dumps(data))
    assert gate(baseline, path) == 1
    assert "GPQA_diamond holds 90 items" in _line(capsys.readouterr().out)
    rounds = ["--rounds", "0.25,0.5,1"]
    # With the config's shares a round must hold exactly its share: 30 of 120 is round 1's,
    # not round 2's.
    first = report(tmp_path, "r1", TEACHER, items=30)
    assert gate(baseline, first, extra=ASK + rounds) == UNDECIDED_EXIT
    capsys.readouterr()
    assert gate(baseline, first, first, extra=ASK + rounds) == 1
    assert "round 2: teacher GPQA_diamond holds 30 items" in capsys.readouterr().out


def _collapse_runs(rng, alpha: float, runs: int, collapse: bool) -> float:
    """The share of `runs` sequential gates over a 14-item benchmark (the hour gate's) that
    fail: a student that passed 10 of 14 (71%) and now passes none, or, unchanged, a run
    whose items each pass at the baseline's own rate; each run its own order seed."""
    failed = 0
    for k in range(runs):
        ids = [str(i) for i in range(14)]
        rates = rng.permutation([0.95] * 10 + [0.05] * 4)
        base_s = {i: float(rng.random() < r) for i, r in zip(ids, rates)}
        if collapse:
            base_s = {i: float(r > 0.5) for i, r in zip(ids, rates)}
        now = {
            i: 0.0 if collapse else float(rng.random() < r) for i, r in zip(ids, rates)
        }
        rows = [
            {
                "arms": {
                    "teacher": {"per_item": dict.fromkeys(ids, 1.0)},
                    "student": {"per_item": s},
                }
            }
            for s in (base_s, now)
        ]
        verdict = check_benchmark(*rows, {}, 20.0, 20.0, alpha, f"s{k}")
        failed += bool(verdict.failures)
    return failed / runs


def test_a_collapse_fails_in_sequential_mode_with_the_level_kept():
    """A 14-item benchmark whose student collapses from 71% to 0: the bets alone caught it
    31% of the time (the rest ended undecided, a pass); the last round's fixed test over all
    items (at a fifth of the level, the bets at the rest) fails it every time. 1,000 runs at
    the hour gate's per-test level (0.05 / 8); unchanged students fail at most alpha (1,000
    runs at 0.05, binomial 99% bound)."""
    rng = np.random.default_rng(57)
    caught = _collapse_runs(rng, 0.05 / 8, 1000, collapse=True)
    false = _collapse_runs(rng, 0.05, 1000, collapse=False)
    print(f"collapse caught {caught:.3f}; unchanged false FAIL {false:.3f} at 0.05")
    assert caught >= 0.95 and false <= 0.05 + 0.018
