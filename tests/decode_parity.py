"""Shared checks of prerouted decode against other paths: batched rows against solo runs, and the
served training path's discovery against engine decode (next-token heads)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from served_pass import CONTINUATION_IDS, PROMPT_IDS, lora_engine_decode

from edge0_eval.engine.engine import Engine
from edge0_eval.engine.options import EngineOptions

PROMPTS = (
    "def add(a, b):\n    return a + b\n# The quick brown fox",
    "import os\nprint(",
    "x = [1, 2, 3]\nfor",
    "# hello",
)


def assert_batch_rows_equal_solo(
    converted, heads_path, max_tokens: int = 9, **options
) -> None:
    """A prerouted engine on `heads_path` (and `options`), 4 prompts, 3 rows at once (the
    fourth joins mid-batch): greedy tokens equal solo runs, and no planned expert is ever
    missing."""
    engine = Engine.load(
        converted,
        EngineOptions(
            mode="prerouted", prerouter_path=str(heads_path), no_lora=True, **options
        ),
    )
    try:
        prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
        solo = [
            engine.generate(p, max_tokens=max_tokens, stop_token_ids=set()).tokens
            for p in prompts
        ]
        rows = engine.generate_batch(
            prompts, max_tokens=max_tokens, batch_size=3, stop_token_ids=set()
        )
        for i, r in enumerate(rows):
            assert r.tokens == solo[i], i
        assert engine.stats()["dropped_experts"] == 0
    finally:
        engine.close()


def assert_discovery_equals_decode(engine, moe: list[int]):
    """ServedPath.discover on prompt + continuation == prefill + prerouted forced decode (logits
    and every planned layer's executed set). Returns (served_path, discovery, tokens)."""
    from edge0_eval.training.served import ServedPath

    prompt = PROMPT_IDS
    served, executed = lora_engine_decode(engine, moe)
    tokens = np.array([prompt + CONTINUATION_IDS])
    served_path = ServedPath(engine)
    disc = served_path.discover(
        tokens, np.ones_like(tokens, bool), np.array([len(prompt)]), keep_logits=True
    )
    assert mx.allclose(disc.logits[0, len(prompt) - 1 :], served, atol=1e-4).item()
    for s, want in enumerate(executed):
        for n in disc.planned_layers:
            assert sorted(disc.inds[n][0, len(prompt) + s].tolist()) == want[n], (n, s)
    return served_path, disc, tokens


def served_path_engine(converted, make_heads, path, start_layer: int | None):
    """A prerouted engine (16 slots per layer, no LoRA) on heads from
    `make_heads(converted, path, start_layer=S)` (S: 0, or None for the first MoE layer + 1);
    returns (engine, moe layers)."""
    probe = Engine.load(converted, EngineOptions(mode="reactive", no_lora=True))
    start = 0 if start_layer == 0 else probe.moe_layers[0] + 1
    moe = list(probe.moe_layers)
    probe.close()
    heads_path = make_heads(converted, path, start_layer=start)[0]
    engine = Engine.load(
        converted,
        EngineOptions(
            mode="prerouted",
            prerouter_path=str(heads_path),
            no_lora=True,
            slots_per_layer=16,
        ),
    )
    return engine, moe
