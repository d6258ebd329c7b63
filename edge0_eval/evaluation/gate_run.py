"""`edge0-eval gate-run CONFIG --baseline BASELINE.json`: run a gate config and gate it.

Whole (default): one OpenCompass run of the config's sample, its results checked (OpenCompass
exits 0 when tasks fail), its report written, the gate run against the baseline.

--sequential: the sample in the config's rounds (evaluation/rounds.py), all in one run folder.
Round 1 starts the folder; each later round deletes the sampled datasets' results (so
OpenCompass scores the grown prefix again) and resumes the folder with `-r`, where the round
partitioner infers only the new items. After every round its report is written and
`gate --sequential` judges the reports so far; the run stops at the first round where every
benchmark is decided (or one regressed), and says which rule stopped it.

The baseline is a whole run of the same config (`gate-run --baseline none`, then its report).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from edge0_eval.cli import main as cli_main
from edge0_eval.errors import ConfigError, Edge0Error
from edge0_eval.evaluation.arms import ARM_NAMES
from edge0_eval.evaluation.gate_sequential import UNDECIDED_EXIT
from edge0_eval.evaluation.progress import read_lines
from edge0_eval.evaluation.rounds import check_rounds, sample_size
from edge0_eval.evaluation.run_config import load_config

PROGRESS_EVERY_S = (
    30.0  # how often the arms' progress lines are printed while a run goes
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "config", type=Path, help="a gate config, e.g. configs/edge0_35b_gate.py"
    )
    parser.add_argument(
        "--baseline",
        required=True,
        metavar="BASELINE.json",
        help="report.json of a whole run of this config ('none': run and "
        "report only, e.g. to make the baseline)",
    )
    parser.add_argument(
        "--work-dir",
        type=Path,
        default=Path("outputs/gate"),
        help="OpenCompass outputs go to WORK/opencompass, reports to "
        "WORK/report* (default outputs/gate)",
    )
    parser.add_argument(
        "--sequential",
        action="store_true",
        help="run the sample in the config's rounds and stop when decided",
    )
    parser.add_argument(
        "--teacher-from",
        type=Path,
        default=None,
        metavar="RUN",
        help="whole mode: the teacher arm's outputs from this earlier run "
        "folder of the same config (run it once with EDGE0_ARMS=teacher; "
        "the config's arms then leave it out)",
    )


def opencompass_command() -> list[str]:
    script = Path(sys.executable).parent / "opencompass"
    if script.is_file():
        return [str(script)]
    found = shutil.which("opencompass")
    return [found] if found else [sys.executable, "-m", "opencompass.cli.main"]


def offline_env(extra: dict[str, str]) -> dict[str, str]:
    env = dict(os.environ)
    env.update(extra)
    # Nothing may reach a hub: make the HF libraries fail fast instead of trying.
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return env


def _count(path: Path) -> int:
    return len(json.loads(path.read_text(encoding="utf-8")))


def _predictions(folder: Path, dataset: str) -> list[Path]:
    """The dataset's predictions file, or its chunks _0, _1, ... (a sequential run's rounds)."""
    whole = folder / f"{dataset}.json"
    if whole.is_file():
        return [whole]
    chunks: list[Path] = []
    while (folder / f"{dataset}_{len(chunks)}.json").is_file():
        chunks.append(folder / f"{dataset}_{len(chunks)}.json")
    return chunks


def check_run(run_dir: Path, models, datasets) -> list[str]:
    """Everything wrong with an OpenCompass run folder: missing or failed (model, dataset)."""
    problems = []
    for model in models:
        for dataset in datasets:
            folder = run_dir / "predictions" / model
            preds = _predictions(folder, dataset)
            result = run_dir / "results" / model / f"{dataset}.json"
            where = f"{model}/{dataset}"
            if not preds:
                problems.append(
                    f"{where}: no predictions ({folder / dataset}.json); see "
                    f"logs/infer/{model}"
                )
                continue
            stats = [p.with_name(p.name[:-5] + ".engine_stats.json") for p in preds]
            if any(
                not s.is_file() or _count(s) != _count(p) for s, p in zip(stats, preds)
            ):
                problems.append(
                    f"{where}: engine stats missing or not one per prediction"
                )
            if not result.is_file():
                problems.append(
                    f"{where}: not scored ({result} missing); see logs/eval/{model}"
                )
                continue
            scored = json.loads(result.read_text(encoding="utf-8"))
            if "error" in scored:
                problems.append(f"{where}: scoring failed: {scored['error']}")
            elif not any(
                isinstance(v, (int, float)) for k, v in scored.items() if k != "details"
            ):
                problems.append(f"{where}: results hold no metric")
            elif not scored.get("details"):
                problems.append(f"{where}: results hold no per-item details")
    if not sorted((run_dir / "summary").glob("summary_*.csv")):
        problems.append(f"{run_dir}/summary: no summary csv")
    return problems


def run_opencompass(
    config: Path, out: Path, env: dict[str, str], log: Path, reuse: str | None = None
) -> Path:
    """Run OpenCompass on `config` into `out`; returns the run folder (new, or `reuse`)."""
    out = out.resolve()
    before = set(out.glob("*")) if out.exists() else set()
    cmd = opencompass_command() + [str(config.resolve()), "-w", str(out)]
    cmd += ["-r", reuse] if reuse else []
    print(f"running: {' '.join(cmd)}  (log: {log})", flush=True)
    # OpenCompass leaves tmp/ and icl_inference_output/ in its working directory.
    with open(log, "w") as f:
        proc = subprocess.Popen(
            cmd,
            env=offline_env(env),
            stdout=f,
            stderr=subprocess.STDOUT,
            cwd=log.parent,
        )
        shown: set[str] = set()
        while True:
            try:
                proc.wait(timeout=PROGRESS_EVERY_S)
                break
            except subprocess.TimeoutExpired:
                runs = [out / reuse] if reuse else sorted(set(out.glob("*")) - before)
                for text in read_lines(runs[-1]) if runs else []:
                    if text not in shown:  # only arms that moved since the last look
                        print(text, flush=True)
                        shown.add(text)
    new = (
        [out / reuse]
        if reuse
        else sorted(p for p in set(out.glob("*")) - before if p.is_dir())
    )
    if proc.returncode != 0 or not new:
        tail = log.read_text(errors="replace").strip().splitlines()[-15:]
        raise Edge0Error(
            f"opencompass exited {proc.returncode}; last lines of {log}:\n"
            + "\n".join(tail)
        )
    return new[-1]


def load_config_with(config: Path, env: dict[str, str]):
    """The config as OpenCompass parses it under `env` (its EDGE0_* variables)."""
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        return load_config(config)
    finally:
        os.environ.clear()
        os.environ.update(saved)


def arm_spec(models: list[str]) -> str:
    """`report --arms`: each model abbr (edge0-TIER-ARM) under its arm name."""
    spec = []
    for abbr in models:
        arm = next((a for a in ARM_NAMES if abbr.endswith(a.replace("_", "-"))), None)
        if arm is None:
            raise ConfigError(
                f"model {abbr!r}: its abbr names none of the arms {ARM_NAMES}"
            )
        spec.append(f"{arm}={abbr}")
    return ",".join(spec)


def _teacher_run(run: Path, datasets: list[str]) -> tuple[str, Path]:
    teachers = sorted(
        p.name for p in (run / "predictions").glob("*teacher") if p.is_dir()
    )
    if len(teachers) != 1:
        raise ConfigError(
            f"--teacher-from {run}: expected one teacher arm's predictions, "
            f"found {teachers or 'none'}"
        )
    problems = check_run(run, teachers, datasets)
    if problems:
        raise Edge0Error(
            f"--teacher-from {run} is incomplete:\n  - " + "\n  - ".join(problems)
        )
    return teachers[0], run


def gate_run(
    config: Path,
    baseline: str,
    work: Path,
    env: dict[str, str],
    sequential: bool = False,
    teacher_from: Path | None = None,
) -> int:
    """Run the gate config (whole, or in rounds) and gate it; returns the gate's exit status
    (0 also when baseline is 'none': run and report only)."""
    work.mkdir(parents=True, exist_ok=True)
    work = work.resolve()
    cfg = load_config_with(config, {**env, "EDGE0_GATE_ROUND": "0"})
    gate = cfg.get("edge0_gate") or {}
    models = [m["abbr"] for m in cfg["models"]]
    datasets = [d["abbr"] for d in cfg["datasets"]]
    if teacher_from is not None and sequential:
        raise ConfigError(
            "--teacher-from: a sequential run scores every arm in each round; "
            "run the teacher in the config's arms"
        )
    teacher = _teacher_run(teacher_from, datasets) if teacher_from is not None else None
    if teacher and any(m.endswith("teacher") for m in models):
        raise ConfigError(
            "--teacher-from: the config runs a teacher arm too; leave it out of "
            "EDGE0_ARMS"
        )
    reporting = (
        teacher is not None
        or any(m.endswith("teacher") for m in models)
        and any(not m.endswith("teacher") for m in models)
    )
    sampled = [d["abbr"] for d in cfg["datasets"] if sample_size(d) is not None]
    drops = [f"{b}={v}" for b, v in (gate.get("drops") or {}).items()]
    rounds = check_rounds(gate.get("rounds")) if sequential else [1.0]
    reports, run_dir, start = [], None, time.perf_counter()
    for number in range(1, len(rounds) + 1):
        tag = f"round {number} of {len(rounds)}" if sequential else "whole sample"
        if run_dir is not None:  # later rounds score the grown prefix afresh
            for model in models:
                for abbr in sampled:
                    (run_dir / "results" / model / f"{abbr}.json").unlink(
                        missing_ok=True
                    )
            shutil.rmtree(run_dir / "summary", ignore_errors=True)
        round_env = {**env, "EDGE0_GATE_ROUND": str(number if sequential else 0)}
        run_dir = run_opencompass(
            config,
            work / "opencompass",
            round_env,
            work / f"opencompass_{number}.log",
            reuse=run_dir.name if run_dir else None,
        )
        problems = check_run(run_dir, models, datasets)
        if problems:
            raise Edge0Error(
                f"the OpenCompass run in {run_dir} ({tag}) is incomplete:\n  - "
                + "\n  - ".join(problems)
            )
        if not reporting:  # one arm alone (e.g. the teacher, for --teacher-from)
            print(
                f"gate-run: {', '.join(models)} scored in {run_dir}: no teacher and student "
                f"to report (use it with --teacher-from)"
            )
            return 0
        out = work / (f"report_round{number}" if sequential else "report")
        runs = [run_dir] + ([teacher[1]] if teacher else [])
        arms = models + ([teacher[0]] if teacher else [])
        # Relative paths: the report records its command, and reports get committed.
        if (
            cli_main(
                [
                    "report",
                    *(os.path.relpath(r) for r in runs),
                    "--out",
                    os.path.relpath(out),
                    "--arms",
                    arm_spec(arms),
                ]
            )
            != 0
        ):
            raise Edge0Error(f"`edge0-eval report` failed on {run_dir} ({tag})")
        reports.append(str(out / "report.json"))
        print(
            f"{tag}: scored in {time.perf_counter() - start:.0f} s; report {reports[-1]}",
            flush=True,
        )
        if baseline == "none":
            continue
        args = [
            "gate",
            *(reports if sequential else reports[-1:]),
            "--baseline",
            baseline,
        ]
        args += ["--sequential"] if sequential else []
        args += [a for d in drops for a in ("--benchmark-drop", d)]
        code = cli_main(args)
        if code != UNDECIDED_EXIT or not sequential:
            print(
                f"gate-run: {'stopped after' if sequential else 'gated'} {tag}: "
                f"{'pass' if code == 0 else 'FAIL' if code == 1 else f'exit {code}'} "
                f"({time.perf_counter() - start:.0f} s)"
            )
            return code
    if sequential and baseline != "none":
        # Undecided after the last round means items left: the baseline holds items this
        # config's sample never reaches, so no round could decide.
        raise Edge0Error(
            f"the gate was still undecided after the last round ({len(rounds)}): "
            f"{baseline} holds items this config's sample never reaches; make the "
            f"baseline with this gate config (`gate-run CONFIG --baseline none`)"
        )
    return 0


def run(args: argparse.Namespace) -> int:
    if not args.config.is_file():
        raise ConfigError(f"{args.config}: config not found")
    return gate_run(
        args.config,
        args.baseline,
        args.work_dir,
        {},
        args.sequential,
        args.teacher_from,
    )
