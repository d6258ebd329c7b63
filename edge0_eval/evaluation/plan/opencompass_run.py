"""OpenCompass run from Python, as gate-run and the demo run it: its command, an offline
environment, the config as OpenCompass parses it under that environment (its EDGE0_*
variables), the run itself with its arms' progress lines, and everything wrong with a finished
run folder (OpenCompass exits 0 when tasks fail).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from edge0_eval.errors import Edge0Error
from edge0_eval.evaluation.plan.progress import read_lines
from edge0_eval.evaluation.plan.run_config import load_config

# how often the arms' progress lines are printed while a run goes
PROGRESS_EVERY_S = 30.0


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
