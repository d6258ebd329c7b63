"""Shared fixtures: tiny checkpoints built once per test session, and the one OpenCompass run
of the tiny config that several test files read."""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path

import pytest
from filelock import FileLock
from perturbed_heads import heads_of_kind

from edge0_eval.checkpoints.tiny import TinyShape, write_tiny
from edge0_eval.engine.engine import Engine, EngineOptions
from edge0_eval.engine.lora import apply_lora, save_adapter
from edge0_eval.evaluation.plan.opencompass_run import offline_env, opencompass_command

TINY_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "edge0_tiny.py"
# The two longest files (minutes each), started first, one per worker.
FIRST = ("tests/test_opencompass_api.py", "tests/test_tiny_gate.py")


def pytest_collection_modifyitems(config, items):
    """Units of work for pytest-xdist (`make test` runs `-n 2 --dist loadfile`): each test
    file is one. The longest go first: xdist hands units out in order, so each worker starts
    on one and the rest fill in around them. (The files that read tiny_run share it across
    workers by a lock, as tiny_env: xdist's loadgroup, which would keep them on one worker,
    groups nothing under pytest 9, whose node ids it can no longer rename.)"""
    rank = {unit: n for n, unit in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(FIRST)))


def pytest_configure(config):
    if not hasattr(config, "workerinput"):
        _write_yapf_grammar_cache()


def _write_yapf_grammar_cache() -> None:
    """OpenCompass dumps its config through yapf, whose first import in a user's cache folder
    writes a grammar pickle that later imports read. Two workers' `opencompass` runs on a fresh
    machine race there: one reads the file while the other is still writing it (EOFError).
    Importing yapf once here, before the workers start, writes it while nothing else runs."""
    try:
        import yapf  # noqa: F401
    except ImportError:
        pass  # without the eval extra the OpenCompass tests skip or fail on their own


def _made_once(tmp_path_factory, worker_id, name: str, make):
    """`make(folder)` (its result JSON-able) run once for the test session, in a new folder:
    under pytest-xdist once for all workers, the others waiting on a lock in their shared
    base temporary folder and reading its result there. A make that failed left no result:
    the next worker to need it makes it again, in a folder of its own."""
    if worker_id == "master":
        return make(tmp_path_factory.mktemp(name))
    shared = tmp_path_factory.getbasetemp().parent
    with FileLock(str(shared / f"{name}.lock")):
        made = shared / f"{name}.json"
        if not made.is_file():
            folder = Path(tempfile.mkdtemp(prefix=name, dir=shared))
            made.write_text(json.dumps(make(folder)))
        return json.loads(made.read_text())


@pytest.fixture(scope="session")
def tiny_env(tmp_path_factory, worker_id):
    """Tiny teacher, converted student with trained adapters, and fixture data, as `edge0-eval
    demo` prepares them (about 100 s of CPU: made once for every OpenCompass test, and under
    pytest-xdist once for both workers). Tests that break a model break a copy."""
    from edge0_eval.demo import prepare

    return _made_once(tmp_path_factory, worker_id, "tiny_env", prepare)


@pytest.fixture(scope="session")
def tiny_run(tiny_env, tmp_path_factory, worker_id) -> Path:
    """The run folder of the real `opencompass configs/edge0_tiny.py` on tiny_env, as `edge0-eval
    demo` runs it: four in-process arms, greedy, batch_size 4, six datasets and fidelity. Made
    once (about 2 min alone: each arm's task is a process that imports OpenCompass) for the
    tests that read it, and under pytest-xdist once for both workers, as tiny_env:
    test_opencompass_tiny checks the run, test_batch_wrappers regenerates its predictions
    alone, test_opencompass_api compares served arms with its student. Read only."""

    def make(folder: Path) -> str:
        return str(_tiny_run(tiny_env, folder))

    return Path(_made_once(tmp_path_factory, worker_id, "tiny_run", make))


def _tiny_run(tiny_env: dict, folder: Path) -> Path:
    work = folder / "out"
    work.mkdir(parents=True)
    # cwd: OpenCompass leaves tmp/ and icl_inference_output/ in its working directory.
    proc = subprocess.run(
        opencompass_command() + [str(TINY_CONFIG), "-w", str(work)],
        env=offline_env(tiny_env),
        capture_output=True,
        text=True,
        timeout=900,
        cwd=folder,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run_dir,) = [p for p in work.iterdir() if p.is_dir()]
    return run_dir


@pytest.fixture(scope="session")
def tiny_qwen(tmp_path_factory):
    """fp16 qwen3_5_moe, 4 layers (3 GatedDeltaNet + 1 full attention), 16 experts, top-4."""
    return write_tiny(
        tmp_path_factory.mktemp("ckpt") / "qwen", TinyShape(family="qwen3_5_moe")
    )


@pytest.fixture(scope="session")
def tiny_bailing(tmp_path_factory):
    """fp16 bailing_hybrid, 4 layers (layer 0 dense), 16 experts in 8 groups, top-4."""
    return write_tiny(
        tmp_path_factory.mktemp("ckpt") / "bailing", TinyShape(family="bailing_hybrid")
    )


@pytest.fixture(scope="session")
def tiny_qwen_q4(tmp_path_factory):
    """The same qwen shape, quantized by mlx-lm to int4 (group 64)."""
    return write_tiny(
        tmp_path_factory.mktemp("ckpt") / "qwen_q4",
        TinyShape(family="qwen3_5_moe"),
        quantize_bits=4,
    )


@pytest.fixture(scope="session")
def tiny_bailing_q4(tmp_path_factory):
    return write_tiny(
        tmp_path_factory.mktemp("ckpt") / "bailing_q4",
        TinyShape(family="bailing_hybrid"),
        quantize_bits=4,
    )


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory):
    """fp16 qwen2_moe, 4 layers (all MoE, attention with q/k/v bias), 16 experts, top-4."""
    return write_tiny(
        tmp_path_factory.mktemp("ckpt") / "qwen2", TinyShape(family="qwen2_moe")
    )


@pytest.fixture(scope="session")
def tiny_qwen2_q4(tmp_path_factory):
    return write_tiny(
        tmp_path_factory.mktemp("ckpt") / "qwen2_q4",
        TinyShape(family="qwen2_moe"),
        quantize_bits=4,
    )


def _convert(src, tmp_path_factory, name):
    from edge0_eval.checkpoints.conversion import convert

    return convert(src, tmp_path_factory.mktemp("conv") / name, progress=False)


@pytest.fixture(scope="session")
def edge0_qwen(tiny_qwen_q4, tmp_path_factory):
    """tiny_qwen_q4 in the streaming layout."""
    return _convert(tiny_qwen_q4, tmp_path_factory, "qwen")


@pytest.fixture(scope="session")
def edge0_bailing(tiny_bailing_q4, tmp_path_factory):
    return _convert(tiny_bailing_q4, tmp_path_factory, "bailing")


@pytest.fixture(scope="session")
def edge0_qwen2(tiny_qwen2_q4, tmp_path_factory):
    return _convert(tiny_qwen2_q4, tmp_path_factory, "qwen2")


@pytest.fixture(scope="session")
def tiny_qwen64_q4(tmp_path_factory):
    """64 experts, top-8, wider experts: expert bytes dominate, so budgets show in memory."""
    shape = TinyShape(
        family="qwen3_5_moe",
        experts=64,
        experts_per_token=8,
        hidden=128,
        heads=4,
        moe_intermediate=128,
        seed=1,
    )
    return write_tiny(
        tmp_path_factory.mktemp("ckpt") / "qwen64_q4", shape, quantize_bits=4
    )


@pytest.fixture(scope="session")
def edge0_qwen64(tiny_qwen64_q4, tmp_path_factory):
    return _convert(tiny_qwen64_q4, tmp_path_factory, "qwen64")


@pytest.fixture(scope="session", params=["qwen", "bailing", "qwen2"])
def forced_student(request, tmp_path_factory):
    """(family, converted student, heads files by kind, a random LoRA): the teacher-forced
    scorers' tests (test_forced, test_layer_major) score the same students."""
    converted = request.getfixturevalue(f"edge0_{request.param}")
    out = tmp_path_factory.mktemp("forced")
    engine = Engine.load(converted, EngineOptions(mode="reactive", no_lora=True))
    heads = {
        kind: heads_of_kind(engine, out / f"{kind}.safetensors", kind)
        for kind in ("context", "next_token", "wrap")
    }
    apply_lora(engine.model, r=4, init="random", seed=3, family=engine.family.name)
    lora = save_adapter(engine.model, out / "lora.safetensors")
    engine.close()
    return request.param, converted, heads, lora
