"""The tiny gate in CI: configs/edge0_tiny_gate.py through the real OpenCompass, gated against
reports/tiny_gate/report.json. A clean student passes; each silent fault of tests/test_fidelity.py
fails it; a student whose answers are degraded on an injected share of items fails its
benchmark part where the plan says the sample can see that drop; a broken student run in rounds
stops after the first.

The teacher is run once (`gate-run --teacher-from`, as on a tier whose teacher lives on another
machine); the clean student run holds the two arms the faults show on (int4_exact, student).
The silent expert faults show on int4_exact: one OpenCompass run holds that arm of a faulted
copy per fault, and each fault's report pairs it with the teacher and the clean student (one
run instead of a two-arm gate-run per fault: each run's arms are processes importing
OpenCompass)."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_fidelity import fault_expert_scales, fault_lora_b, fault_swap_experts

from edge0_eval.cli import main
from edge0_eval.demo import make_agreement_set
from edge0_eval.evaluation.plan.opencompass_run import (
    check_run,
    load_config_with,
    offline_env,
    run_opencompass,
)
from edge0_eval.evaluation.plan.planner import PlanOptions, make_plan
from edge0_eval.gate_run import gate_run

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "configs" / "edge0_tiny_gate.py"
BASELINE = REPO / "reports" / "tiny_gate" / "report.json"
STUDENTS = "int4_exact,student"
INJECTED = 0.30  # share of the student's agreement items whose answer is blanked


@pytest.fixture(scope="module")
def gate_env(tiny_env):
    env = {k: v for k, v in tiny_env.items() if k != "EDGE0_ARMS"}
    make_agreement_set(CONFIG, env)
    return env


@pytest.fixture(scope="module")
def drops(gate_env) -> list[str]:
    """The config's thresholds, as gate-run passes them to the gate."""
    gate = load_config_with(CONFIG, gate_env)["edge0_gate"]
    return [
        a for b, v in gate["drops"].items() for a in ("--benchmark-drop", f"{b}={v}")
    ]


@pytest.fixture(scope="module")
def teacher_run(gate_env, tmp_path_factory):
    work = tmp_path_factory.mktemp("teacher")
    assert gate_run(CONFIG, "none", work, {**gate_env, "EDGE0_ARMS": "teacher"}) == 0
    (run,) = (work / "opencompass").iterdir()
    return run


@pytest.fixture(scope="module")
def clean(gate_env, teacher_run, tmp_path_factory):
    work = tmp_path_factory.mktemp("clean")
    env = {**gate_env, "EDGE0_ARMS": STUDENTS}
    # The sample is sized for 12.0 points, not the 2 asked by default: accepted, by name.
    code = gate_run(
        CONFIG, str(BASELINE), work, env, teacher_from=teacher_run, accept_blind=True
    )
    return code, work


def _table(report: Path, drops: list[str], capsys) -> dict[str, str]:
    """The gate's table against the baseline, by check name (rerun: the verdict is fixed)."""
    capsys.readouterr()
    main(["gate", str(report), "--baseline", str(BASELINE), *drops])
    out = capsys.readouterr().out
    return {
        l.split("  ")[0]: l
        for l in out.splitlines()
        if l.startswith(("edge0_", "fidelity"))
    }


def test_clean_student_passes(clean, drops, capsys):
    code, work = clean
    assert code == 0
    table = _table(work / "report" / "report.json", drops, capsys)
    assert set(table) == {
        "edge0_agreement",
        "fidelity teacher",
        "fidelity int4_exact",
        "fidelity student",
    }
    assert all(
        " pass " in line or line.rstrip().endswith("pass") for line in table.values()
    )
    report = json.loads((work / "report" / "report.json").read_text())
    (row,) = report["benchmarks"]
    # The sample is the config's: 234 items; the teacher answers every one as its set says.
    assert row["items"] == 234 and row["teacher"] == 100.0 and 20 < row["student"] < 90


SILENT = (fault_expert_scales, fault_swap_experts)  # both show on int4_exact


def _faulted(fault) -> str:
    """The abbr of int4_exact on the student copy `fault` broke."""
    return f"edge0-tiny-{fault.__name__.replace('_', '-')}-int4-exact"


@pytest.fixture(scope="module")
def silent_faults(gate_env, tmp_path_factory) -> Path:
    """One OpenCompass run of the gate config whose models are its int4_exact arm on a copy
    of the student per silent fault, each under its own abbr (_faulted)."""
    work = tmp_path_factory.mktemp("faults")
    models = []
    for fault in SILENT:
        broken = work / fault.__name__
        shutil.copytree(gate_env["EDGE0_TINY_STUDENT"], broken)
        fault(broken)
        env = {
            **gate_env,
            "EDGE0_ARMS": "int4_exact",
            "EDGE0_TINY_STUDENT": str(broken),
        }
        cfg = load_config_with(CONFIG, env)
        (model,) = cfg["models"]
        # a ConfigDict: it dumps its type by dotted name
        model["abbr"] = _faulted(fault)
        models.append(model)
    cfg["models"] = models
    config = work / "silent_faults.py"
    cfg.dump(str(config))
    run = run_opencompass(config, work / "opencompass", gate_env, work / "oc.log")
    datasets = [d["abbr"] for d in cfg["datasets"]]
    assert check_run(run, [m["abbr"] for m in models], datasets) == []
    return run


@pytest.mark.parametrize(
    "fault,arm",
    [(fault_expert_scales, "int4_exact"), (fault_swap_experts, "int4_exact")],
)
def test_silent_expert_faults_fail_it(
    fault, arm, clean, teacher_run, silent_faults, drops, tmp_path, capsys
):
    """The faulted arm in place of the clean one, reported and gated as gate-run does."""
    (students,) = (clean[1] / "opencompass").iterdir()
    arms = dict(teacher="edge0-tiny-teacher", student="edge0-tiny-student")
    arms[arm] = _faulted(fault)
    out = tmp_path / "report"
    runs = [str(r) for r in (teacher_run, students, silent_faults)]
    spec = ",".join(f"{a}={m}" for a, m in arms.items())
    assert main(["report", *runs, "--out", str(out), "--arms", spec]) == 0
    gate = ["gate", str(out / "report.json"), "--baseline", str(BASELINE), *drops]
    assert main(gate) == 1
    table = _table(out / "report.json", drops, capsys)
    assert "FAIL" in table[f"fidelity {arm}"] and "KL rose" in table[f"fidelity {arm}"]


def test_broken_student_in_rounds_fails_and_stops_after_the_first(
    gate_env, tmp_path, capfd
):
    """The LoRA fault, run in rounds (every arm in each round): the first round decides."""
    broken = tmp_path / "student"
    shutil.copytree(gate_env["EDGE0_TINY_STUDENT"], broken)
    fault_lora_b(broken)
    env = {**gate_env, "EDGE0_TINY_STUDENT": str(broken)}
    assert (
        gate_run(
            CONFIG,
            str(BASELINE),
            tmp_path / "work",
            env,
            sequential=True,
            accept_blind=True,
        )
        == 1
    )
    out = capfd.readouterr().out
    assert "gate-run: stopped after round 1 of 4: FAIL" in out
    assert not (tmp_path / "work" / "report_round2").exists()
    fid = next(l for l in out.splitlines() if l.startswith("fidelity student "))
    assert "FAIL" in fid and "KL rose" in fid
    agreement = next(l for l in out.splitlines() if l.startswith("edge0_agreement "))
    assert "234->30" in agreement  # the first round: 30 of the sample's 234 items


def _blank_share(predictions: Path, share: float) -> int:
    """Blank the answers of a fixed share of items (by a hash of their index): an outcome-level
    fault, scored by OpenCompass as any answer is."""
    preds = json.loads(predictions.read_text())
    hit = 0
    for key, item in preds.items():
        if int(hashlib.sha256(key.encode()).hexdigest(), 16) % 1000 < share * 1000:
            item["prediction"] = ""
            hit += 1
    predictions.write_text(json.dumps(preds))
    return hit


def test_degraded_answers_fail_where_the_plan_has_the_power(
    clean, gate_env, teacher_run, drops, tmp_path, capsys, monkeypatch
):
    _, work = clean
    (run,) = (work / "opencompass").iterdir()
    degraded = tmp_path / "out" / run.name
    shutil.copytree(run, degraded)
    student = "edge0-tiny-student"
    blanked = _blank_share(
        degraded / "predictions" / student / "edge0_agreement.json", INJECTED
    )
    (degraded / "results" / student / "edge0_agreement.json").unlink()
    shutil.rmtree(degraded / "summary")
    # OpenCompass scores the changed answers (eval only, in the copied run folder).
    env = offline_env({**gate_env, "EDGE0_ARMS": STUDENTS})
    proc = subprocess.run(
        [
            str(Path(sys.executable).parent / "opencompass"),
            str(CONFIG),
            "-m",
            "eval",
            "-w",
            str(tmp_path / "out"),
            "-r",
            run.name,
        ],
        env=env,
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-2000:]
    out = tmp_path / "report"
    assert (
        main(
            [
                "report",
                str(degraded),
                str(teacher_run),
                "--out",
                str(out),
                "--arms",
                "teacher=edge0-tiny-teacher,int4_exact=edge0-tiny-int4-exact,"
                "student=edge0-tiny-student",
            ]
        )
        == 0
    )
    report = json.loads((out / "report.json").read_text())
    base = json.loads(BASELINE.read_text())
    drop = base["benchmarks"][0]["student"] - report["benchmarks"][0]["student"]
    # The plan's power for this sample (the config's churn) is within the injected drop.
    for key, value in gate_env.items():
        monkeypatch.setenv(key, value)
    plan = make_plan(PlanOptions(config=CONFIG, tok_s=27.0))
    power = plan.power["edge0_agreement"]
    assert blanked > 0.2 * 234 and drop > power["detectable_drop"]
    assert drop > power["sequential_drop"]
    table = _table(out / "report.json", drops, capsys)
    assert (
        "FAIL" in table["edge0_agreement"]
        and "student dropped" in table["edge0_agreement"]
    )
    # Fidelity is not what the answers changed: every arm still passes it.
    assert not any(
        "FAIL" in line for name, line in table.items() if name.startswith("fidelity")
    )
