"""Stop ids are resolved as mlx-lm resolves them (generation_config.json over config.json), so
the engine's student arm and the mlx-lm teacher arm stop on the same tokens."""

from __future__ import annotations

import mlx.core as mx
import pytest
from bad_inputs import copy_model, edit_json, expect_clear_error
from mlx_lm import load
from mlx_lm.generate import generate_step

from edge0_eval.engine.engine import Engine

PROMPT = [5, 6, 7, 8, 9]


def _no_config_eos(config: dict) -> None:
    config.pop("eos_token_id", None)
    if isinstance(config.get("text_config"), dict):
        config["text_config"].pop("eos_token_id", None)


def _mlx_lm_tokens(model_dir, max_tokens: int) -> list[int]:
    model, tokenizer = load(str(model_dir))
    out = []
    for token, _ in generate_step(mx.array(PROMPT), model, max_tokens=max_tokens):
        token = int(token)
        if token in tokenizer.eos_token_ids:
            break
        out.append(token)
    return out, tokenizer.eos_token_ids


def test_generation_config_stops_both_arms_alike(tiny_qwen_q4, edge0_qwen, tmp_path):
    engine = Engine.load(edge0_qwen)
    try:
        first = engine.generate(PROMPT, max_tokens=4, stop_token_ids=set()).tokens
    finally:
        engine.close()
    stop = first[2]  # a token the greedy continuation reaches: both must stop there
    teacher = copy_model(tiny_qwen_q4, tmp_path / "teacher")
    student = copy_model(edge0_qwen, tmp_path / "student")
    for model in (teacher, student):
        edit_json(model / "config.json", _no_config_eos)
        (model / "generation_config.json").write_text(f'{{"eos_token_id": [{stop}]}}')
    ref_tokens, ref_eos = _mlx_lm_tokens(teacher, 8)
    engine = Engine.load(student)
    try:
        assert set(engine.tokenizer.eos_token_ids) == set(ref_eos)
        tokens = engine.generate(PROMPT, max_tokens=8).tokens
    finally:
        engine.close()
    assert stop in ref_eos and ref_tokens == first[: first.index(stop)]
    # the stop id itself, or not
    assert tokens[:-1] == ref_tokens or tokens == ref_tokens
    assert len(tokens) <= first.index(stop) + 1


@pytest.mark.parametrize(
    "text", ['{"eos_token_id": "2"}', '{"eos_token_id": [true]}', "{"]
)
def test_bad_generation_config_refused(edge0_qwen, tmp_path, text):
    model = copy_model(edge0_qwen, tmp_path / "m")
    (model / "generation_config.json").write_text(text)
    expect_clear_error(lambda: Engine.load(model), "generation_config.json")
