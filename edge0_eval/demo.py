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
import json
import os
import shutil
import string
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from edge0_eval.checkpoints.convert import convert
from edge0_eval.checkpoints.tiny import TinyShape, write_tiny
from edge0_eval.engine.options import LORA_FILE, PREROUTER_FILE
from edge0_eval.errors import Edge0Error
from edge0_eval.evaluation.fidelity import fingerprint, gather_prompts, make_set
from edge0_eval.evaluation.fidelity_set import SET_PATH, read_set, write_set
from edge0_eval.evaluation.fixtures import write_fixtures

# What configs/edge0_tiny.py evaluates (tests check the two stay in step).
TINY_ARMS = ('teacher', 'int4_exact', 'prerouted_nolora', 'student')
TINY_MODELS = ('edge0-tiny-teacher', 'edge0-tiny-int4-exact', 'edge0-tiny-prerouted-nolora',
               'edge0-tiny-student')
TINY_DATASETS = ('aime2026', 'IFBench', 'openai_humaneval', 'GPQA_diamond', 'mmlu_pro_math',
                 'mmlu_pro_physics')
TINY_FIDELITY = 'edge0_fidelity'
# The tiny fidelity set: prompts per source and teacher tokens per prompt.
TINY_FIDELITY_LIMIT, TINY_FIDELITY_MAX_NEW = 6, 16


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument('--work-dir', default='outputs/demo',
                        help='where models, data and results go (default: outputs/demo)')
    parser.add_argument('--config', default=None,
                        help='OpenCompass config (default: configs/edge0_tiny.py of this checkout)')
    parser.add_argument('--fresh', action='store_true',
                        help='rebuild the tiny models instead of reusing them')
    parser.add_argument('--baseline', default=None,
                        help='gate the run against this report.json (default: '
                             'reports/tiny/report.json of this checkout, when present)')


def find_config(explicit: str | None = None) -> Path:
    candidates = [Path(explicit)] if explicit else [
        Path(__file__).resolve().parent.parent / 'configs' / 'edge0_tiny.py',
        Path.cwd() / 'configs' / 'edge0_tiny.py']
    for path in candidates:
        if path.is_file():
            return path
    raise Edge0Error(f'{candidates[0]} not found; run from the edge0-eval checkout or pass '
                     f'--config PATH')


def opencompass_command() -> list[str]:
    script = Path(sys.executable).parent / 'opencompass'
    if script.is_file():
        return [str(script)]
    found = shutil.which('opencompass')
    return [found] if found else [sys.executable, '-m', 'opencompass.cli.main']


def prepare(work: Path, fresh: bool = False) -> dict[str, str]:
    """Tiny teacher, student and fixture data under `work`; returns the run's environment."""
    teacher, student, data = work / 'tiny-teacher', work / 'tiny-student', work / 'data'
    if fresh:
        for path in (teacher, student):
            shutil.rmtree(path, ignore_errors=True)
    if not (teacher / 'config.json').exists():
        shutil.rmtree(teacher, ignore_errors=True)
        write_tiny(teacher, TinyShape(family='qwen3_5_moe'))
        shutil.rmtree(student, ignore_errors=True)
    if not (student / 'experts.index.json').exists():
        shutil.rmtree(student, ignore_errors=True)
        convert(str(teacher), str(student))
    write_fixtures(data)
    make_tiny_fidelity_set(teacher, data / SET_PATH)
    train_student_adapters(work, teacher, student)
    return {'COMPASS_DATA_CACHE': str(data.resolve()), 'EDGE0_TINY_TEACHER': str(teacher.resolve()),
            'EDGE0_TINY_STUDENT': str(student.resolve()), 'EDGE0_ARMS': ','.join(TINY_ARMS)}


def make_tiny_fidelity_set(teacher: Path, path: Path) -> Path:
    """The fidelity set of the tiny teacher; remade when the teacher changed."""
    if path.is_file():
        try:
            if read_set(path)['teacher']['fingerprint'] == fingerprint(teacher):
                return path
        except Edge0Error:
            pass   # unreadable or stale: make it again
    prompts, sources = gather_prompts(['humaneval', 'ifbench'], [], TINY_FIDELITY_LIMIT)
    return write_set(make_set(teacher, prompts, sources, max_new=TINY_FIDELITY_MAX_NEW), path)


def tiny_corpus(directory: Path) -> list[Path]:
    """Text that ships with every Python, one document per file: stage-1 training text."""
    directory.mkdir(parents=True, exist_ok=True)
    files = []
    for module in (json, string, textwrap):
        path = directory / f'{module.__name__.replace(".", "_")}.txt'
        path.write_text(Path(module.__file__).read_text(encoding='utf-8'), encoding='utf-8')
        files.append(path)
    return files


def tiny_prompts(path: Path) -> Path:
    prompts = ['What is 2 + 2?', 'Write a Python function that reverses a string.',
               'Name three primary colours.', 'Explain what a mixture of experts is.',
               'Answer with one letter: (A) red (B) blue.', 'Write a haiku about disks.',
               'def fib(n):', 'List the first five prime numbers.']
    path.write_text('\n'.join(json.dumps({'prompt': p}) for p in prompts) + '\n')
    return path


def _edge0(*args: str) -> None:
    cmd = [sys.executable, '-m', 'edge0_eval', *args]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise Edge0Error(f'`edge0-eval {" ".join(args[:1])}` failed:\n'
                         f'{(proc.stderr or proc.stdout)[-2000:]}')


def train_student_adapters(work: Path, teacher: Path, student: Path) -> None:
    """The student's prerouter heads (stage 1) and recovery LoRA (stage 2), short runs."""
    heads = student / PREROUTER_FILE
    if not heads.exists():
        corpus = tiny_corpus(work / 'corpus')
        _edge0('train-prerouter', str(student), '--text', *map(str, corpus), '--out', str(heads),
               '--steps', '300', '--max-tokens', '6000', '--no-progress')
    lora = student / LORA_FILE
    if not lora.exists():
        prompts = tiny_prompts(work / 'prompts.jsonl')
        _edge0('train-lora', str(teacher), str(student), '--prompts', str(prompts),
               '--out', str(lora), '--steps', '30', '--no-progress')


def offline_env(extra: dict[str, str]) -> dict[str, str]:
    env = dict(os.environ)
    env.update(extra)
    # Nothing may reach a hub: make the HF libraries fail fast instead of trying.
    env.update(HF_HUB_OFFLINE='1', HF_DATASETS_OFFLINE='1', TRANSFORMERS_OFFLINE='1')
    return env


def _count_items(path: Path) -> int:
    return len(json.loads(path.read_text(encoding='utf-8')))


def check_run(run_dir: Path, models=TINY_MODELS,
              datasets=TINY_DATASETS + (TINY_FIDELITY,)) -> list[str]:
    """Everything wrong with an OpenCompass run folder: missing or failed (model, dataset)."""
    problems = []
    for model in models:
        for dataset in datasets:
            pred = run_dir / 'predictions' / model / f'{dataset}.json'
            stats = run_dir / 'predictions' / model / f'{dataset}.engine_stats.json'
            result = run_dir / 'results' / model / f'{dataset}.json'
            where = f'{model}/{dataset}'
            if not pred.is_file():
                problems.append(f'{where}: no predictions ({pred}); see logs/infer/{model}')
                continue
            n = _count_items(pred)
            if not stats.is_file() or _count_items(stats) != n:
                problems.append(f'{where}: engine stats missing or not one per prediction')
            if not result.is_file():
                problems.append(f'{where}: not scored ({result} missing); see logs/eval/{model}')
                continue
            scored = json.loads(result.read_text(encoding='utf-8'))
            if 'error' in scored:
                problems.append(f'{where}: scoring failed: {scored["error"]}')
            elif not any(isinstance(v, (int, float)) for k, v in scored.items() if k != 'details'):
                problems.append(f'{where}: results hold no metric')
            elif not scored.get('details'):
                problems.append(f'{where}: results hold no per-item details')
    summaries = sorted((run_dir / 'summary').glob('summary_*.csv'))
    if not summaries:
        problems.append(f'{run_dir}/summary: no summary csv')
    return problems


def run_tiny(work: Path, config: Path, env: dict[str, str]) -> Path:
    """Run OpenCompass on the tiny config; returns the new run folder."""
    work = work.resolve()
    out = work / 'opencompass'
    before = set(out.glob('*')) if out.exists() else set()
    log = work / 'opencompass.log'
    cmd = opencompass_command() + [str(config.resolve()), '-w', str(out)]
    print(f'running: {" ".join(cmd)}  (log: {log})', flush=True)
    # OpenCompass leaves tmp/ and icl_inference_output/ in its working directory: use `work`.
    with open(log, 'w') as f:
        proc = subprocess.run(cmd, env=offline_env(env), stdout=f, stderr=subprocess.STDOUT,
                              cwd=work)
    new = sorted(p for p in set(out.glob('*')) - before if p.is_dir())
    if proc.returncode != 0 or not new:
        tail = log.read_text(errors='replace').strip().splitlines()[-15:]
        raise Edge0Error(f'opencompass exited {proc.returncode}; last lines of {log}:\n'
                         + '\n'.join(tail))
    return new[-1]


TINY_ARM_SPEC = ','.join(f'{arm}={model}' for arm, model in zip(TINY_ARMS, TINY_MODELS))


def find_baseline(explicit: str | None) -> Path | None:
    if explicit:
        return Path(explicit)
    default = Path(__file__).resolve().parent.parent / 'reports' / 'tiny' / 'report.json'
    return default if default.is_file() else None


def report_and_gate(run_dir: Path, out: Path, baseline: Path | None) -> Path:
    """The gap report of a tiny run, gated against `baseline` (a committed report.json)."""
    # Relative paths: the report records its command, and reports get committed.
    _edge0('report', os.path.relpath(run_dir), '--out', os.path.relpath(out),
           '--arms', TINY_ARM_SPEC)
    if baseline is not None:
        cmd = [sys.executable, '-m', 'edge0_eval', 'gate', str(out / 'report.json'),
               '--baseline', str(baseline)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        print(proc.stdout)
        if proc.returncode != 0:
            raise Edge0Error(f'the gate against {baseline} failed:\n{proc.stdout[-3000:]}'
                             f'{proc.stderr[-1000:]}')
    return out / 'report.json'


def run(args: argparse.Namespace) -> int:
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    config = find_config(args.config)
    start = time.perf_counter()
    env = prepare(work, fresh=args.fresh)
    print(f'prepared tiny teacher, student and fixture data under {work} '
          f'({time.perf_counter() - start:.0f}s)', flush=True)
    run_dir = run_tiny(work, config, env)
    problems = check_run(run_dir)
    if problems:
        raise Edge0Error(f'the OpenCompass run in {run_dir} is incomplete:\n  - '
                         + '\n  - '.join(problems))
    summary = sorted((run_dir / 'summary').glob('summary_*.csv'))
    if summary:
        print(summary[-1].read_text().replace(',', '\t'))
    report = report_and_gate(run_dir, work / 'report', find_baseline(args.baseline))
    print(f'report: {report}')
    print(f'demo ok: {len(TINY_MODELS)} arms x {len(TINY_DATASETS)} datasets + fidelity scored in '
          f'{run_dir} ({time.perf_counter() - start:.0f}s)')
    return 0
