"""Prefill: the LM head runs on the last position only, with the same bits as the full head."""

from __future__ import annotations

import mlx.core as mx
import pytest

from edge0_eval.engine.engine import Engine
from edge0_eval.engine.options import EngineOptions

TOKENS = [3, 17, 5, 99, 42, 8, 23, 61, 7]


@pytest.mark.parametrize("family", ["qwen", "bailing", "qwen2"])
def test_last_only_logits_equal_the_last_row_of_the_full_forward(family, request):
    engine = Engine.load(request.getfixturevalue(f"edge0_{family}"),
                         EngineOptions(mode="resident"))
    try:
        full = engine.forward(mx.array(TOKENS)[None])
        engine.reset()
        last = engine.forward(mx.array(TOKENS)[None], last_only=True)
        assert full.shape[1] == len(TOKENS) and last.shape == (1, 1, full.shape[-1])
        assert mx.array_equal(last[0, 0], full[0, -1]).item()
        # ... and the cache it leaves is the same: the next step sees the same sequence.
        engine.reset()
        engine.forward(mx.array(TOKENS)[None])
        after_full = engine.forward(mx.array([[11]]))
        engine.reset()
        engine.forward(mx.array(TOKENS)[None], last_only=True)
        assert mx.array_equal(engine.forward(mx.array([[11]])), after_full).item()
    finally:
        engine.close()


@pytest.mark.parametrize("chunk", [4, 512])
def test_prefill_asks_only_for_the_last_position(edge0_qwen, chunk):
    engine = Engine.load(edge0_qwen, EngineOptions(mode="resident", prefill_chunk=chunk))
    forward, shapes = engine.forward, []

    def spy(*args, **kwargs):           # on this instance: the logits each chunk produced
        logits = forward(*args, **kwargs)
        shapes.append(logits.shape[1])
        return logits

    try:
        engine.forward = spy
        logits = engine.prefill(TOKENS)
        # chunks 0..3, 4..6, 7..8 (the last keeps two tokens) or the whole prompt
        assert shapes == [1] * (1 if chunk == 512 else 3)
        assert logits.shape == (engine.forward(mx.array([[1]])).shape[-1],)
    finally:
        engine.close()
