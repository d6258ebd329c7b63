"""`edge0-eval demo`: the embedded default, end to end, offline.

1. builds a tiny fp16 teacher (`make-tiny`) and its int4 streaming student (`convert`),
2. writes fixture data for all five benchmarks (`data fixtures`) and the fidelity set from the
   teacher (`fidelity make`: HumanEval and IFBench prompts, the teacher's continuations),
3. runs the real `opencompass configs/edge0_tiny.py` with environment variables pointing at them,
4. checks the result files itself (OpenCompass exits 0 even when every task failed): every
   benchmark must have predictions, engine stats and a scored results file for both arms.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import string
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

from edge0_eval import gate_run
from edge0_eval.arguments.fields import add_fields, option
from edge0_eval.checkpoints.conversion import convert
from edge0_eval.checkpoints.tiny import TinyShape, write_tiny
from edge0_eval.engine.options import LORA_FILE, PREROUTER_FILE
from edge0_eval.errors import Edge0Error
from edge0_eval.evaluation import agreement
from edge0_eval.evaluation.data.fixtures import write_fixtures
from edge0_eval.evaluation.fidelity.scoring import fingerprint, gather_prompts, make_set
from edge0_eval.evaluation.fidelity.sets import SET_PATH, read_set, write_set
from edge0_eval.evaluation.plan import opencompass_run
from edge0_eval.evaluation.plan.opencompass_run import offline_env, opencompass_command
from model_wrappers.models.mlx_lm_model import MLXLMModel

# What configs/edge0_tiny.py evaluates (tests check the two stay in step).
TINY_ARMS = ("teacher", "int4_exact", "prerouted_nolora", "student")
TINY_MODELS = tuple(f"edge0-tiny-{arm.replace('_', '-')}" for arm in TINY_ARMS)
TINY_DATASETS = tuple(
    "aime2026 IFBench openai_humaneval GPQA_diamond mmlu_pro_math mmlu_pro_physics".split()
)
TINY_FIDELITY = "edge0_fidelity"
# The tiny fidelity set: prompts per source and teacher tokens per prompt.
TINY_FIDELITY_LIMIT, TINY_FIDELITY_MAX_NEW = 6, 16
AGREEMENT_BATCH = 32  # prompts per generate call when the tiny teacher answers the set


@dataclass
class DemoOptions:
    """demo's flags, each declared once."""

    work_dir: str = option(
        "outputs/demo", "where models, data and results go (default: outputs/demo)"
    )
    config: str | None = option(
        None, "OpenCompass config (default: configs/edge0_tiny.py of this checkout)"
    )
    fresh: bool = option(False, "rebuild the tiny models instead of reusing them")
    baseline: str | None = option(
        None,
        "gate the run against this report.json (default: reports/tiny/report.json, "
        "with --gate reports/tiny_gate/report.json of this checkout, when present)",
    )
    gate: bool = option(
        False,
        "run the tiny gate (configs/edge0_tiny_gate.py: fidelity and agreement with "
        "the teacher) instead, with `gate-run`",
    )
    sequential: bool = option(
        False, "with --gate: in rounds, stopping when the sequential rule decides"
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_fields(parser, DemoOptions)


def find_config(explicit: str | None = None, name: str = "edge0_tiny.py") -> Path:
    candidates = (
        [Path(explicit)]
        if explicit
        else [
            Path(__file__).resolve().parent.parent / "configs" / name,
            Path.cwd() / "configs" / name,
        ]
    )
    for path in candidates:
        if path.is_file():
            return path
    raise Edge0Error(
        f"{candidates[0]} not found; run from the edge0-eval checkout or pass "
        f"--config PATH"
    )


def prepare(work: Path, fresh: bool = False) -> dict[str, str]:
    """Tiny teacher, student and fixture data under `work`; returns the run's environment."""
    teacher, student, data = work / "tiny-teacher", work / "tiny-student", work / "data"
    if fresh:
        for path in (teacher, student):
            shutil.rmtree(path, ignore_errors=True)
    if not (teacher / "config.json").exists():
        shutil.rmtree(teacher, ignore_errors=True)
        write_tiny(teacher, TinyShape(family="qwen3_5_moe"))
        shutil.rmtree(student, ignore_errors=True)
    if not (student / "experts.index.json").exists():
        shutil.rmtree(student, ignore_errors=True)
        convert(str(teacher), str(student))
    write_fixtures(data)
    make_tiny_fidelity_set(teacher, data / SET_PATH)
    train_student_adapters(work, teacher, student)
    return {
        "COMPASS_DATA_CACHE": str(data.resolve()),
        "EDGE0_TINY_TEACHER": str(teacher.resolve()),
        "EDGE0_TINY_STUDENT": str(student.resolve()),
        "EDGE0_ARMS": ",".join(TINY_ARMS),
    }


def make_tiny_fidelity_set(teacher: Path, path: Path) -> Path:
    """The fidelity set of the tiny teacher; remade when the teacher changed."""
    if path.is_file():
        try:
            if read_set(path)["teacher"]["fingerprint"] == fingerprint(teacher):
                return path
        except Edge0Error:
            pass  # unreadable or stale: make it again
    prompts, sources = gather_prompts(["humaneval", "ifbench"], [], TINY_FIDELITY_LIMIT)
    return write_set(
        make_set(teacher, prompts, sources, max_new=TINY_FIDELITY_MAX_NEW), path
    )


def make_agreement_set(config: Path, env: dict[str, str]) -> Path:
    """The agreement set (evaluation/agreement.py) of the gate config's teacher arm, answered
    with its exact settings through its own model class; remade when either changed."""
    cfg = opencompass_run.load_config_with(config, {**env, "EDGE0_ARMS": "teacher"})
    (model,) = cfg["models"]
    keys = ("max_out_len", "max_seq_len", "generation_kwargs", "chat_template_kwargs")
    settings = {k: model.get(k) for k in (*keys, "stop_words", "meta_template")}
    settings = json.loads(json.dumps(settings, default=str))
    prompts = agreement.prompts()
    header = {
        "fingerprint": fingerprint(Path(model["path"])),
        "settings": settings,
        "prompts": hashlib.sha256("\n".join(prompts).encode()).hexdigest(),
    }
    path = Path(env["COMPASS_DATA_CACHE"]) / agreement.SET_PATH
    if path.is_file():
        try:
            if agreement.read_set(path)[0] == header:
                return path
        except Edge0Error:
            pass  # unreadable: make it again
    teacher = MLXLMModel(
        path=model["path"],
        **{k: v for k, v in settings.items() if k != "max_out_len" and v is not None},
    )
    # Every row equals its run alone (tests/test_batch_wrappers.py), so a larger batch than
    # the config's gives the same answers, sooner.
    answers = [
        a
        for i in range(0, len(prompts), AGREEMENT_BATCH)
        for a in teacher.generate(
            prompts[i : i + AGREEMENT_BATCH], max_out_len=model["max_out_len"]
        )
    ]
    return agreement.write_set(
        path, [{"prompt": p, "reference": a} for p, a in zip(prompts, answers)], header
    )


def run_gate(args: argparse.Namespace, work: Path) -> int:
    """`demo --gate`: the tiny gate config through `gate-run`, against its committed baseline
    (none yet: run and report only)."""
    config = find_config(args.config, "edge0_tiny_gate.py")
    env = prepare(work, fresh=args.fresh)
    start = time.perf_counter()
    make_agreement_set(config, env)
    print(f"agreement set ready ({time.perf_counter() - start:.0f}s)", flush=True)
    default = (
        Path(__file__).resolve().parent.parent / "reports" / "tiny_gate" / "report.json"
    )
    baseline = args.baseline or (str(default) if default.is_file() else "none")
    # The gate config chooses its own arms (the demo's env names the tiny config's four).
    env = {k: v for k, v in env.items() if k != "EDGE0_ARMS"}
    # The tiny gate proves the pipeline: its sample is sized for a larger drop than the
    # default 2 points asked, and the gate says so; the demo accepts that, by name.
    return gate_run.gate_run(
        config, baseline, work / "gate", env, args.sequential, accept_blind=True
    )


def tiny_corpus(directory: Path) -> list[Path]:
    """Text that ships with every Python, one document per file: stage-1 training text."""
    directory.mkdir(parents=True, exist_ok=True)
    files = []
    for module in (json, string, textwrap):
        path = directory / f"{module.__name__.replace('.', '_')}.txt"
        path.write_text(
            Path(module.__file__).read_text(encoding="utf-8"), encoding="utf-8"
        )
        files.append(path)
    return files


def tiny_prompts(path: Path) -> Path:
    prompts = [
        "What is 2 + 2?",
        "Write a Python function that reverses a string.",
        "Name three primary colours.",
        "Explain what a mixture of experts is.",
        "Answer with one letter: (A) red (B) blue.",
        "Write a haiku about disks.",
        "def fib(n):",
        "List the first five prime numbers.",
    ]
    path.write_text("\n".join(json.dumps({"prompt": p}) for p in prompts) + "\n")
    return path


def _edge0(*args) -> None:
    cmd = [sys.executable, "-m", "edge0_eval", *map(str, args)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise Edge0Error(
            f"`edge0-eval {' '.join(args[:1])}` failed:\n"
            f"{(proc.stderr or proc.stdout)[-2000:]}"
        )


def train_student_adapters(work: Path, teacher: Path, student: Path) -> None:
    """The student's prerouter heads (stage 1) and recovery LoRA (stage 2), short runs."""
    heads = student / PREROUTER_FILE
    if not heads.exists():
        corpus = tiny_corpus(work / "corpus")
        quick = ("--steps", "300", "--max-tokens", "6000", "--no-progress")
        _edge0("train-prerouter", student, "--text", *corpus, "--out", heads, *quick)
    lora = student / LORA_FILE
    if not lora.exists():
        prompts = tiny_prompts(work / "prompts.jsonl")
        quick = ("--steps", "30", "--no-progress")
        _edge0(
            "train-lora", teacher, student, "--prompts", prompts, "--out", lora, *quick
        )


def check_run(
    run_dir: Path, models=TINY_MODELS, datasets=TINY_DATASETS + (TINY_FIDELITY,)
) -> list[str]:
    """Everything wrong with a tiny run folder (opencompass_run.check_run on the tiny config's
    lists)."""
    return opencompass_run.check_run(run_dir, models, datasets)


def run_tiny(work: Path, config: Path, env: dict[str, str]) -> Path:
    """Run OpenCompass on the tiny config; returns the new run folder."""
    work = work.resolve()
    out = work / "opencompass"
    before = set(out.glob("*")) if out.exists() else set()
    log = work / "opencompass.log"
    cmd = opencompass_command() + [str(config.resolve()), "-w", str(out)]
    print(f"running: {' '.join(cmd)}  (log: {log})", flush=True)
    # OpenCompass leaves tmp/ and icl_inference_output/ in its working directory: use `work`.
    with open(log, "w") as f:
        proc = subprocess.run(
            cmd, env=offline_env(env), stdout=f, stderr=subprocess.STDOUT, cwd=work
        )
    new = sorted(p for p in set(out.glob("*")) - before if p.is_dir())
    if proc.returncode != 0 or not new:
        tail = log.read_text(errors="replace").strip().splitlines()[-15:]
        raise Edge0Error(
            f"opencompass exited {proc.returncode}; last lines of {log}:\n"
            + "\n".join(tail)
        )
    return new[-1]


TINY_ARM_SPEC = ",".join(f"{arm}={model}" for arm, model in zip(TINY_ARMS, TINY_MODELS))


def find_baseline(explicit: str | None) -> Path | None:
    if explicit:
        return Path(explicit)
    default = (
        Path(__file__).resolve().parent.parent / "reports" / "tiny" / "report.json"
    )
    return default if default.is_file() else None


def report_and_gate(run_dir: Path, out: Path, baseline: Path | None) -> Path:
    """The gap report of a tiny run, gated against `baseline` (a committed report.json)."""
    # Relative paths: the report records its command, and reports get committed.
    rel = os.path.relpath
    _edge0("report", rel(run_dir), "--out", rel(out), "--arms", TINY_ARM_SPEC)
    if baseline is not None:
        cmd = [sys.executable, "-m", "edge0_eval", "gate", str(out / "report.json")]
        # 2-3 items per benchmark see no small drop: the tiny suite checks the pipeline,
        # and the gate still prints what it cannot see.
        cmd += ["--baseline", str(baseline), "--accept-blind"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        print(proc.stdout)
        if proc.returncode != 0:
            raise Edge0Error(
                f"the gate against {baseline} failed:\n{proc.stdout[-3000:]}"
                f"{proc.stderr[-1000:]}"
            )
    return out / "report.json"


def run(args: argparse.Namespace) -> int:
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    if args.gate:
        return run_gate(args, work)
    config = find_config(args.config)
    start = time.perf_counter()
    env = prepare(work, fresh=args.fresh)
    print(
        f"prepared tiny teacher, student and fixture data under {work} "
        f"({time.perf_counter() - start:.0f}s)",
        flush=True,
    )
    run_dir = run_tiny(work, config, env)
    problems = check_run(run_dir)
    if problems:
        raise Edge0Error(
            f"the OpenCompass run in {run_dir} is incomplete:\n  - "
            + "\n  - ".join(problems)
        )
    summary = sorted((run_dir / "summary").glob("summary_*.csv"))
    if summary:
        print(summary[-1].read_text().replace(",", "\t"))
    report = report_and_gate(run_dir, work / "report", find_baseline(args.baseline))
    print(f"report: {report}")
    print(f"page: {report.with_name('report.html')} (open it in a browser, offline)")
    print(
        f"demo ok: {len(TINY_MODELS)} arms x {len(TINY_DATASETS)} datasets + fidelity scored in "
        f"{run_dir} ({time.perf_counter() - start:.0f}s)"
    )
    return 0
