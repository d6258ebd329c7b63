"""Teacher-forced fidelity: the set, the scorer on the served path, the report and the gate."""

from __future__ import annotations

import json
import shutil
import zlib

import mlx.core as mx
import numpy as np
import pytest

from edge0_eval.engine.engine import Engine, EngineOptions
from edge0_eval.engine.lora import apply_lora, save_adapter
from edge0_eval.engine.prerouter import default_owners, init_heads_from_routers, save_heads
from edge0_eval.errors import ConfigError
from edge0_eval.evaluation import fidelity as fid

PROMPT = "def add(a, b):\n    return a + b\n# The quick brown fox"
MODES = ("resident", "reactive", "prerouted")


def _adapters(converted, directory):
    """Random prerouter heads and a random LoRA (non-zero B) for a converted model."""
    engine = Engine.load(converted, EngineOptions(mode="reactive", no_lora=True))
    owners = default_owners(engine.moe_layers[0] + 1, len(engine.model.layers), engine.moe_layers)
    heads = init_heads_from_routers(engine, owners, width=32, seed=0)
    heads.fc2 = mx.random.normal(heads.fc2.shape, key=mx.random.key(1)) * 0.5
    heads_path = save_heads(directory / "prerouter.safetensors", heads)
    apply_lora(engine.model, r=4, init="random", seed=3, family=engine.family.name)
    lora_path = save_adapter(engine.model, directory / "lora.safetensors")
    engine.close()
    return heads_path, lora_path


@pytest.fixture(scope="module", params=["qwen", "bailing", "qwen2"])
def served(request, tmp_path_factory):
    converted = request.getfixturevalue(f"edge0_{request.param}")
    heads, lora = _adapters(converted, tmp_path_factory.mktemp("adapters"))
    return converted, heads, lora


@pytest.mark.parametrize("mode", MODES)
def test_scorer_equals_step_by_step_decode(served, mode):
    """Bit-identical on the CPU: the scorer runs the very prefill/step calls generate makes."""
    converted, heads, lora = served
    engine = Engine.load(converted, EngineOptions(
        mode=mode, slots_per_layer=None if mode == "resident" else 6,
        prerouter_path=str(heads) if mode == "prerouted" else None, lora_path=str(lora)))
    prompt = engine.tokenizer.encode(PROMPT)
    result = engine.generate(prompt, max_tokens=10, stop_token_ids=set())
    tokens = result.tokens
    assert len(tokens) == 10
    # generate's loop written out: prefill, then step each token it chose.
    engine.reset()
    decoded = [fid._logprobs(engine.prefill(prompt))]
    decoded += [fid._logprobs(engine.step(t)) for t in tokens[:-1]]
    assert [int(np.argmax(lp)) for lp in decoded] == tokens
    ids = [[t, *range(5)] for t in tokens]
    lp, argmax = fid.teacher_forced(fid.EngineRunner(engine), prompt, tokens, ids)
    assert argmax.tolist() == tokens
    expected = np.stack([d[np.asarray(row)] for d, row in zip(decoded, ids)])
    assert np.array_equal(lp, expected)
    if mode == "prerouted":
        assert engine.stats()["prerouted_steps"] > 0
    engine.close()
