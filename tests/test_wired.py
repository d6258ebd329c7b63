"""Metal wiring (mlx-lm's own `wired_limit`, used as is): a no-op without Metal, restored
after use, and entered by the entry points that run a model."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.generate import wired_limit

from edge0_eval.cli import main
from edge0_eval.engine.engine import Engine
from edge0_eval.engine.options import EngineOptions
from edge0_eval.evaluation.fidelity.scoring import model_logprobs

RECOMMENDED = 2**40  # large: mlx-lm warns when the model nears it


class FakeWiredLimit:
    """mx.set_wired_limit as Metal behaves: set a limit, return the previous one."""

    def __init__(self, previous: int = 7):
        self.limit, self.calls, self.seen = previous, [], []

    def __call__(self, limit: int) -> int:
        previous, self.limit = self.limit, limit
        self.calls.append(limit)
        return previous


@pytest.fixture
def metal(monkeypatch):
    """A device that reports a recommended working set, as Metal does."""
    fake = FakeWiredLimit()
    real = mx.device_info()
    monkeypatch.setattr(
        mx,
        "device_info",
        lambda: {**real, "max_recommended_working_set_size": RECOMMENDED},
    )
    monkeypatch.setattr(mx, "set_wired_limit", fake)
    return fake


def test_no_op_without_metal(monkeypatch):
    assert (
        "max_recommended_working_set_size" not in mx.device_info()
        or mx.metal.is_available()
    )
    if mx.metal.is_available():
        pytest.skip("this device has Metal")
    calls = []
    monkeypatch.setattr(mx, "set_wired_limit", lambda limit: calls.append(limit) or 0)
    with wired_limit(nn.Linear(4, 4)):
        value = mx.ones(3).sum().item()
    assert value == 3 and calls == []


def test_sets_the_recommended_limit_and_restores_the_previous_one(metal):
    with wired_limit(nn.Linear(4, 4)):
        assert metal.limit == RECOMMENDED
    assert metal.limit == 7 and metal.calls == [RECOMMENDED, 7]
    with pytest.raises(RuntimeError):
        with wired_limit(nn.Linear(4, 4)):
            raise RuntimeError("a failed generation")
    assert metal.limit == 7  # restored on the way out of an error too


def test_bench_arms_run_wired(edge0_qwen, metal, tmp_path):
    assert (
        main(
            [
                "bench",
                str(edge0_qwen),
                "--arms",
                "mlx-lm,resident",
                "--cache",
                "warm",
                "--tokens",
                "2",
                "--prompt-tokens",
                "4",
                "--raw-reads",
                "0",
            ]
        )
        == 0
    )
    assert metal.calls == [RECOMMENDED, 7, RECOMMENDED, 7] and metal.limit == 7


def test_fidelity_scoring_and_student_generation_run_wired(edge0_qwen, metal):
    from model_wrappers.models.edge0_model import Edge0Model

    engine = Engine.load(
        edge0_qwen, EngineOptions(mode="reactive", experts_per_token=2)
    )
    try:
        prompt = engine.tokenizer.encode("hello there")
        out = model_logprobs(
            engine,
            [{"prompt_ids": prompt, "tokens": [5, 6], "topk_ids": [[5, 7], [6, 8]]}],
        )[0]
        assert len(out["argmax"]) == 2 and metal.calls == [RECOMMENDED, 7]
    finally:
        engine.close()

    student = Edge0Model(
        path=str(edge0_qwen),
        mode="reactive",
        no_lora=True,
        no_prerouter=True,
        experts_per_token=2,
        generation_kwargs=dict(temperature=0.0),
    )
    generate = student.engine.generate_batch

    def spy(*args, **kwargs):  # on this instance only: what limit is set while it runs
        metal.seen.append(metal.limit)
        return generate(*args, **kwargs)

    student.engine.generate_batch = spy
    metal.calls.clear()
    student.generate([[{"role": "user", "content": "2 + 2?"}]], max_out_len=3)
    assert metal.seen == [RECOMMENDED] and metal.calls == [RECOMMENDED, 7]
