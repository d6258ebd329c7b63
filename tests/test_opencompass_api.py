"""The tiny suite through servers: OpenCompass with served arms (Edge0APIModel) beside the
in-process ones, on loopback.

Two `edge0-eval serve` processes serve the student (one `student_api` arm lists both); the teacher
is served by `mlx_lm.server`. Greedy: every served prediction equals the in-process arm's (the
in-process student's are the shared tiny run's, conftest.tiny_run: the same config and
settings), the report pairs a served arm with an in-process one and carries the served
samples' engine stats.
Sampled, two answers per question: the student's served predictions equal the in-process
student's at the same seeds and sample indices, also after its servers are killed mid-run and
the run resumed with `opencompass -r` (nothing lost, nothing drawn twice differently).

On the CPU, mlx_lm.server serves a float32 copy of the fp16 teacher: MLX's CPU gather_mm runs
float32 only (the in-process teacher upcasts the same weights itself: the same numbers).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from live_server import free_port, launch_serve, stop, wait_healthy

from edge0_eval.demo import TINY_DATASETS, check_run, offline_env, opencompass_command

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "configs" / "edge0_tiny.py"
ARMS = ("teacher", "student", "teacher_api", "student_api")
MODELS = {arm: "edge0-tiny-" + arm.replace("_", "-") for arm in ARMS}
SERVE = (
    "--mode",
    "prerouted",
    "--slots-per-layer",
    "8",
    "--served-model-name",
    "edge0-student",
    "--max-batch",
    "4",
)


@pytest.fixture(scope="module")
def servers(tiny_env, tmp_path_factory):
    """Two student servers and mlx_lm.server on a float32 copy of the teacher."""
    work = tmp_path_factory.mktemp("served")
    teacher32 = work / "teacher-f32"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "mlx_lm",
            "convert",
            "--hf-path",
            tiny_env["EDGE0_TINY_TEACHER"],
            "--mlx-path",
            str(teacher32),
            "--dtype",
            "float32",
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    port = free_port()
    teacher = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlx_lm",
            "server",
            "--model",
            str(teacher32),
            "--port",
            str(port),
        ],
        stdout=open(work / "teacher.log", "w"),
        stderr=subprocess.STDOUT,
    )
    state = dict(
        work=work, teacher=f"http://127.0.0.1:{port}/v1", students=[], procs=[]
    )
    try:
        for i in range(2):
            proc, student_port = launch_serve(
                tiny_env["EDGE0_TINY_STUDENT"], *SERVE, log=work / f"student{i}.log"
            )
            state["procs"].append(proc)
            state["students"].append(student_port)
        for proc, student_port in zip(state["procs"], state["students"]):
            wait_healthy(student_port, proc, 120)
        wait_healthy(port, teacher, 120)
        yield state
    finally:
        for proc in state["procs"]:  # a restarted server included
            stop(proc)
        stop(teacher)


def _opencompass(env: dict, work: Path, *extra: str, wait: bool = True):
    cmd = opencompass_command() + [str(CONFIG), "-w", str(work), *extra]
    log = open(work.parent / f"{work.name}.log", "a")
    proc = subprocess.Popen(
        cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=work.parent
    )
    if wait:
        assert proc.wait(900) == 0, (work.parent / f"{work.name}.log").read_text()[
            -3000:
        ]
    return proc


def _predictions(run: Path, model: str, dataset: str) -> dict:
    path = run / "predictions" / model / f"{dataset}.json"
    return {k: v["prediction"] for k, v in json.loads(path.read_text()).items()}


def _served(port: int) -> int:
    return httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).json()["served"]


def test_served_arms_equal_the_in_process_arms_and_the_report_pairs_them(
    tiny_env, tiny_run, servers, tmp_path
):
    # The in-process student is the shared run's; the teacher runs here too, as the report's
    # in-process arm (the shared run also scores fidelity, which a served arm leaves out).
    arms = [arm for arm in ARMS if arm != "student"]
    env = offline_env(tiny_env)
    env.update(
        EDGE0_ARMS=",".join(arms),
        EDGE0_TINY_TEACHER_API=servers["teacher"],
        EDGE0_TINY_STUDENT_API=",".join(
            f"http://127.0.0.1:{p}/v1" for p in servers["students"]
        ),
    )
    before = [_served(p) for p in servers["students"]]
    _opencompass(env, tmp_path / "out")
    (run,) = [p for p in (tmp_path / "out").iterdir() if p.is_dir()]
    assert (
        check_run(run, models=tuple(MODELS[a] for a in arms), datasets=TINY_DATASETS)
        == []
    )
    local_runs = dict(student=tiny_run, teacher=run)
    for dataset in TINY_DATASETS:
        for local, served in (("student", "student_api"), ("teacher", "teacher_api")):
            mine = _predictions(local_runs[local], MODELS[local], dataset)
            assert mine and _predictions(run, MODELS[served], dataset) == mine, (
                dataset,
                served,
            )
    # The one student arm listed both hosts, and each answered some of its requests.
    assert all(_served(p) > b for p, b in zip(servers["students"], before))

    stats = json.loads(
        (
            run
            / "predictions"
            / MODELS["student_api"]
            / "GPQA_diamond.engine_stats.json"
        ).read_text()
    )
    local = json.loads(
        (
            tiny_run
            / "predictions"
            / MODELS["student"]
            / "GPQA_diamond.engine_stats.json"
        ).read_text()
    )
    assert [s["seed"] for s in stats] == [s["seed"] for s in local]
    assert {s["api_base"] for s in stats} <= {
        f"http://127.0.0.1:{p}/v1" for p in servers["students"]
    }
    for s in stats:
        # the same student files
        assert s["model_identity"] == local[0]["model_identity"]
        assert s["cache"] == "not evicted" and s["pool"]["bytes_read"] >= 0
        assert "blocked_load_s" in s["engine"] and s["decode_tok_s"] >= 0

    # The report pairs the served student with the in-process teacher (their settings match)
    # and reads the served samples' engine stats.
    out = tmp_path / "report"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "edge0_eval",
            "report",
            str(run),
            "--out",
            str(out),
            "--arms",
            f"teacher={MODELS['teacher']},student={MODELS['student_api']}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((out / "report.json").read_text())
    assert report["status"] == "ok" and report["fidelity"] is None
    served = report["engine"]["student"]
    assert served["samples"] == sum(
        len(_predictions(run, MODELS["student_api"], d)) for d in TINY_DATASETS
    )
    assert (
        served["cache"] == {"not evicted": served["samples"]}
        and served["decode_tok_s"] > 0
    )
    assert "Edge0APIModel" in json.dumps(report["arms"]["student"]["settings"]["model"])
    assert (
        report["arms"]["student"]["settings"]["generation"]
        == report["arms"]["teacher"]["settings"]["generation"]
    )


def test_sampled_repeats_survive_killed_servers_and_a_resume(
    tiny_env, servers, tmp_path
):
    """Sampled, two answers per question, the arm listing both hosts: both are killed mid-run
    (with one left, its requests would just move to the other), restarted, and `-r` finishes."""
    ports = servers["students"]
    env = offline_env(tiny_env)
    env.update(
        EDGE0_ARMS="student,student_api",
        EDGE0_TINY_SAMPLED="1",
        EDGE0_TINY_STUDENT_API=",".join(f"http://127.0.0.1:{p}/v1" for p in ports),
    )
    work = tmp_path / "out"
    run_oc = _opencompass(env, work, "-m", "infer", wait=False)
    start = sum(_served(p) for p in ports)
    deadline = time.monotonic() + 600
    while (
        sum(_served(p) for p in ports) < start + 5
    ):  # a few served answers, then the kill
        assert time.monotonic() < deadline and run_oc.poll() is None
        time.sleep(0.05)
    for proc in servers["procs"]:
        proc.send_signal(signal.SIGKILL)
    assert run_oc.wait(900) == 0
    (run,) = [p for p in work.iterdir() if p.is_dir()]
    served_dir = run / "predictions" / MODELS["student_api"]
    done = {p.name for p in served_dir.glob("*.json")} if served_dir.is_dir() else set()
    assert len({d for d in TINY_DATASETS if f"{d}.json" in done}) < len(TINY_DATASETS)

    servers["procs"] = [
        launch_serve(
            tiny_env["EDGE0_TINY_STUDENT"],
            *SERVE,
            port=p,
            log=servers["work"] / f"student{i}-again.log",
        )[0]
        for i, p in enumerate(ports)
    ]
    for proc, port in zip(servers["procs"], ports):
        wait_healthy(port, proc, 120)
    _opencompass(env, work, "-m", "infer", "-r", run.name)
    for dataset in TINY_DATASETS:
        mine = _predictions(run, MODELS["student"], dataset)
        assert mine and _predictions(run, MODELS["student_api"], dataset) == mine, (
            dataset
        )
    # Sampled for real: the two copies of a question drew different answers somewhere.
    preds = _predictions(run, MODELS["student"], "IFBench")
    half = len(preds) // 2
    assert any(preds[str(i)] != preds[str(i + half)] for i in range(half))
