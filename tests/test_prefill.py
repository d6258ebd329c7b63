"""Prefill: the LM head runs on the last position only, and the last two tokens run as their own
piece (mlx-lm's generate_step shape) where that keeps the bits of a one-piece forward."""

from __future__ import annotations

import mlx.core as mx
import pytest

from edge0_eval.engine.engine import Engine
from edge0_eval.engine.options import EngineOptions

TOKENS = [3, 17, 5, 99, 42, 8, 23, 61, 7]


def _step(engine, tokens, cache, all_logits=False):
    return engine.step(
        mx.array(tokens)[None], cache, plan_next=False, all_logits=all_logits
    )[0]


@pytest.mark.parametrize("family", ["qwen", "bailing", "qwen2"])
def test_last_only_logits_equal_the_last_row_of_the_full_forward(family, request):
    engine = Engine.load(
        request.getfixturevalue(f"edge0_{family}"), EngineOptions(mode="resident")
    )
    try:
        full_cache, last_cache = engine.step.new_cache(), engine.step.new_cache()
        full = _step(engine, TOKENS, full_cache, all_logits=True)
        last = _step(engine, TOKENS, last_cache)
        assert full.shape[1] == len(TOKENS) and last.shape == (1, full.shape[-1])
        assert mx.array_equal(last[0], full[0, -1]).item()
        # ... and the cache it leaves is the same: the next step sees the same sequence.
        assert mx.array_equal(
            _step(engine, [11], last_cache), _step(engine, [11], full_cache)
        ).item()
    finally:
        engine.close()


@pytest.mark.parametrize("chunk", [4, 512])
def test_prefill_asks_only_for_the_last_position(edge0_qwen, chunk):
    engine = Engine.load(
        edge0_qwen, EngineOptions(mode="resident", prefill_chunk=chunk)
    )
    head, shapes = engine.step.logits, []

    def spy(h):  # on this instance: the positions each piece's LM head ran on
        shapes.append(h.shape[1])
        return head(h)

    try:
        engine.step.logits = spy
        logits, _ = engine.step.prefill(TOKENS, engine.step.new_cache())
        # pieces 0..3, 4..6, 7..8 or 0..6, 7..8: the last two tokens run alone (split_prefill)
        assert shapes == [1] * (2 if chunk == 512 else 3)
        assert logits.shape == (_step(engine, [1], engine.step.new_cache()).shape[-1],)
    finally:
        engine.close()


@pytest.mark.parametrize("family", ["qwen", "bailing", "qwen2", "qwen64"])
def test_prefill_logits_equal_a_one_piece_forward(family, request):
    """Family.split_prefill holds what it claims: where the prefill cuts the prompt, the
    logits keep the bits of the whole prompt in one forward (bailing is never cut short)."""
    engine = Engine.load(
        request.getfixturevalue(f"edge0_{family}"), EngineOptions(mode="resident")
    )
    try:
        prompt = engine.tokenizer.encode(
            "The quick brown fox jumps over the lazy dog. " * 3
        )
        whole = _step(engine, prompt, engine.step.new_cache())[0]
        prefilled, _ = engine.step.prefill(prompt, engine.step.new_cache())
        assert mx.array_equal(prefilled, whole).item()
    finally:
        engine.close()
