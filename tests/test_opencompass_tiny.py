"""The real `opencompass` command on the tiny config, and the errors that must stop it early.

OpenCompass exits 0 even when every task failed, so these tests read the result files.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from edge0_eval.demo import (
    TINY_DATASETS,
    TINY_FIDELITY,
    TINY_MODELS,
    check_run,
    offline_env,
    report_and_gate,
)

REPO = Path(__file__).resolve().parent.parent
CONFIGS = REPO / "configs"


def _opencompass(config: Path, work: Path, env: dict, timeout: int = 900):
    script = Path(sys.executable).parent / "opencompass"
    cmd = [
        str(script) if script.exists() else shutil.which("opencompass"),
        str(config),
        "-w",
        str(work),
    ]
    # cwd: OpenCompass leaves tmp/ and icl_inference_output/ in its working directory.
    return subprocess.run(
        cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=work.parent
    )


def test_tiny_config_end_to_end(tiny_run, tmp_path):
    """The shared run (conftest.tiny_run) is this config's real `opencompass` run."""
    run_dir = tiny_run
    assert check_run(run_dir) == []
    for model in TINY_MODELS:
        for dataset in TINY_DATASETS:
            preds = json.loads(
                (run_dir / "predictions" / model / f"{dataset}.json").read_text()
            )
            stats = json.loads(
                (
                    run_dir / "predictions" / model / f"{dataset}.engine_stats.json"
                ).read_text()
            )
            assert [s["index"] for s in stats] == list(range(len(preds)))
            for s in stats:
                assert 0 < s["tokens"] <= 24
                assert {
                    "decode_tok_s",
                    "prefill_tok_s",
                    "peak_memory_gib",
                    "cache",
                } <= set(s)
            if "student" in model:
                assert all(s["pool"]["bytes_read"] > 0 for s in stats)
    # Raw-prompt and PromptList datasets both reached the models as chat messages.
    aime = json.loads(
        (run_dir / "predictions" / TINY_MODELS[0] / "aime2026.json").read_text()
    )
    assert aime["0"]["origin_prompt"][0]["role"] == "user"
    summary = next((run_dir / "summary").glob("summary_*.csv")).read_text().splitlines()
    rows = {line.split(",")[0]: line.split(",") for line in summary[1:]}
    for name in (
        "aime2026",
        "openai_humaneval",
        "GPQA_diamond",
        "mmlu_pro_per_question",
        "mmlu_pro",
        "IFBench",
    ):
        assert name in rows and "-" not in rows[name][4:], summary
    # Every arm scored the fidelity set on its served path; the teacher reproduces itself.
    for model in TINY_MODELS:
        preds = json.loads(
            (run_dir / "predictions" / model / f"{TINY_FIDELITY}.json").read_text()
        )
        assert len(preds) == len(
            json.loads(
                (run_dir / "results" / model / f"{TINY_FIDELITY}.json").read_text()
            )["details"]
        )
        # The fidelity set, the task's last dataset, moves the arm's progress item by item.
        state = json.loads((run_dir / "progress" / f"{model}.json").read_text())
        assert state["dataset"] == TINY_FIDELITY and state["items"] == state["total"], (
            state
        )
    # The CI gate: this run's gap report against the committed tiny baseline.
    report = report_and_gate(
        run_dir, tmp_path / "report", REPO / "reports" / "tiny" / "report.json"
    )
    report = json.loads(report.read_text())
    assert report["status"] == "ok"
    assert (
        report["fidelity"]["status"] == "ok"
        and report["fidelity"]["teacher_sanity"]["ok"]
    )


def test_tiny_config_lists_what_the_demo_checks(tiny_env):
    from mmengine.config import Config

    old = dict(os.environ)
    os.environ.update(tiny_env)
    try:
        cfg = Config.fromfile(str(CONFIGS / "edge0_tiny.py"))
    finally:
        os.environ.clear()
        os.environ.update(old)
    assert sorted(d["abbr"] for d in cfg["datasets"]) == sorted(
        TINY_DATASETS + (TINY_FIDELITY,)
    )
    assert [m["abbr"] for m in cfg["models"]] == list(TINY_MODELS)
    teacher, *students = cfg["models"]
    for student in students:
        for key in (
            "max_out_len",
            "generation_kwargs",
            "chat_template_kwargs",
            "max_seq_len",
        ):
            assert teacher[key] == student[key]


def test_check_run_reports_failed_tasks(tmp_path):
    run = tmp_path / "run"
    (run / "predictions" / "a").mkdir(parents=True)
    (run / "results" / "a").mkdir(parents=True)
    (run / "predictions" / "a" / "x.json").write_text(
        json.dumps({"0": {"prediction": ""}})
    )
    (run / "predictions" / "a" / "x.engine_stats.json").write_text("[{}]")
    (run / "results" / "a" / "x.json").write_text(json.dumps({"error": "boom"}))
    problems = check_run(run, models=("a", "b"), datasets=("x",))
    assert any("a/x: scoring failed: boom" in p for p in problems)
    assert any(p.startswith("b/x: no predictions") for p in problems)
    assert any("no summary csv" in p for p in problems)


@pytest.mark.parametrize(
    "config,variable",
    [("edge0_35b.py", "EDGE0_35B_TEACHER"), ("edge0_testbed.py", "EDGE0_TESTBED")],
)
def test_unset_model_path_is_one_clear_error(tmp_path, config, variable):
    env = {k: v for k, v in os.environ.items() if not k.startswith("EDGE0_")}
    proc = _opencompass(CONFIGS / config, tmp_path / "out", env, timeout=300)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert f"edge0-eval: {variable} is not set" in out and "Traceback" not in out
    assert not (tmp_path / "out").exists()


def test_missing_data_and_adapters_stop_before_any_model_loads(tiny_env, tmp_path):
    empty = tmp_path / "data"
    empty.mkdir()
    # A student directory without its adapters (the demo's student has trained ones).
    bare = tmp_path / "student-bare"
    shutil.copytree(
        tiny_env["EDGE0_TINY_STUDENT"],
        bare,
        ignore=shutil.ignore_patterns("lora*", "prerouter*"),
    )
    env = offline_env(tiny_env)
    env.update(
        COMPASS_DATA_CACHE=str(empty),
        EDGE0_8B_TEACHER=tiny_env["EDGE0_TINY_TEACHER"],
        EDGE0_8B_STUDENT=str(bare),
        EDGE0_ARMS="teacher,student,prerouted_nolora",
    )
    proc = _opencompass(CONFIGS / "edge0_8b.py", tmp_path / "out", env, timeout=300)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "Traceback" not in out
    assert "edge0-eval: cannot start the evaluation" in out
    for rel in (
        "data/aime2026/aime2026.jsonl",
        "data/humaneval/human-eval-v2-20210705.jsonl",
        "data/gpqa/gpqa_diamond.csv",
        "data/mmlu_pro",
        "data/IFBench/IFBench_test.jsonl",
    ):
        assert str(empty / rel) in out
    assert "edge0-8b-student: student LoRA adapter" in out
    assert "edge0-8b-prerouted-nolora: student prerouter heads" in out
    # Nothing ran: no task logs, predictions or results.
    (run_dir,) = list((tmp_path / "out").iterdir())
    assert sorted(p.name for p in run_dir.iterdir()) == ["configs"]


@pytest.mark.parametrize(
    "variable,value", [("EDGE0_TESTBED_ITEMS", "abc"), ("EDGE0_TESTBED_MAX_OUT", "-3")]
)
def test_testbed_config_refuses_bad_numbers(variable, value):
    env = {**os.environ, "EDGE0_TESTBED": "/nonexistent", variable: value}
    code = (
        "from mmengine.config import Config; "
        f"Config.fromfile({str(CONFIGS / 'edge0_testbed.py')!r}, format_python_code=False)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode != 0
    assert f"edge0-eval: {variable}={value!r} is not a whole number > 0" in proc.stderr
    assert "Traceback" not in proc.stderr
