"""One row, one stop rule: a row ends inside the decoder at the token that completes its stop
string, whichever way it is asked (in-process OpenCompass arm, served, `generate`), and every
way reports the same finish reason and token count for it."""

from __future__ import annotations

import json

import httpx
import pytest
from live_server import LiveServer

from edge0_eval.cli import main
from edge0_eval.engine.engine import Engine
from edge0_eval.engine.inputs import chat_ids, to_messages
from edge0_eval.engine.options import EngineOptions
from model_wrappers.models.edge0_model import Edge0Model

PROMPT = "Tell me a long story about a dragon and a castle by the sea."
MAX = 24


@pytest.fixture(scope="module")
def row(edge0_qwen):
    """The prompt's free greedy run and a stop string that its text first holds at a token
    well inside it (two tokens' text, so no single stop id can end the row instead)."""
    engine = Engine.load(edge0_qwen, EngineOptions(mode="reactive", no_lora=True))
    tok = engine.tokenizer
    ids = chat_ids(tok, to_messages(PROMPT), {})
    free = engine.generate(ids, MAX, stop_token_ids=set()).tokens
    engine.close()
    for j in range(4, MAX - 4):
        word = tok.decode(free[j - 1 : j + 1])
        if (
            word.strip()
            and len(tok.encode(word, add_special_tokens=False)) > 1
            and word not in tok.decode(free[:j])
            and not set(free[: j + 1]) & set(tok.eos_token_ids)
        ):
            return ids, free, word, j
    pytest.skip("the tiny model's greedy text repeats itself too early")


def test_in_process_student_stops_at_a_stop_string(edge0_qwen, row):
    """Nothing after the stop string is decoded: tokens decoded == tokens kept. Before the
    row owned its stop rule, the student ran to max_out_len and trimmed afterwards."""
    ids, free, word, j = row
    model = Edge0Model(
        path=str(edge0_qwen), mode="reactive", no_lora=True, no_prerouter=True
    )
    (text,) = model.generate([PROMPT], max_out_len=MAX, stopping_criteria=[word])
    (stats,) = model.pop_sample_stats()
    assert stats["finish_reason"] == "stop_word" and stats["stop_word"] == word
    assert stats["tokens"] == j + 1  # the token completing the stop string is its last
    assert stats["engine"]["generated_tokens"] == stats["tokens"]
    assert stats["engine"]["decode_steps"] == stats["tokens"] - 1
    assert word not in text and model.tokenizer.decode(free[: j + 1]).startswith(text)


def test_the_three_ways_give_the_same_row(edge0_qwen, row, tmp_path):
    """In-process, served and `generate`: the same finish reason and token count."""
    ids, free, word, j = row
    model = Edge0Model(
        path=str(edge0_qwen), mode="reactive", no_lora=True, no_prerouter=True
    )
    model.generate([PROMPT], max_out_len=MAX, stopping_criteria=[word])
    (inproc,) = model.pop_sample_stats()

    server = LiveServer(
        edge0_qwen, EngineOptions(mode="reactive", no_lora=True), max_tokens=MAX
    )
    try:
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": MAX,
            "temperature": 0,
            "stop": [word],
        }
        r = httpx.post(f"{server.base}/chat/completions", json=body, timeout=120)
        served = r.json()
    finally:
        server.close()
    out = tmp_path / "row.json"
    argv = ["generate", str(edge0_qwen), "--prompt", PROMPT, "--max-tokens", str(MAX)]
    argv += ["--stop", word, "--mode", "reactive", "--no-lora", "--json", str(out)]
    assert main(argv) == 0
    cli = json.loads(out.read_text())

    assert served["choices"][0]["finish_reason"] == "stop"
    assert served["edge0"]["finish_reason"] == inproc["finish_reason"] == "stop_word"
    assert cli["finish"] == "stop_word"
    assert (
        len(cli["output"])
        == served["edge0"]["tokens"]
        == inproc["tokens"]
        == cli["stats"]["generated_tokens"]
        == j + 1
    )
    assert cli["output"] == free[: j + 1]
    assert served["choices"][0]["message"]["content"] == cli["text"]
