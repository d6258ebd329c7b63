"""What real clients send `edge0-eval serve`, answered as vLLM answers it.

SDKs and agent frameworks send fields the server does not read (`store`, `metadata`,
`service_tier`...): ignored with one logged warning. Perplexity clients and
lm-evaluation-harness ask for the prompt's log-probs (`echo` + `logprobs`, `max_tokens` 0)
for lists of prompts: the log-probs are the engine's own teacher-forced ones. A request
without sampling fields draws with the model's generation_config.json (as vLLM).
"""

from __future__ import annotations

import json
import logging
import threading
import time

import httpx
import numpy as np
import pytest
from live_server import LiveServer
from perturbed_heads import heads_of_kind

from edge0_eval import ConfigError, Engine, EngineOptions
from edge0_eval.engine.inputs import row_seed
from edge0_eval.evaluation.fidelity.scoring import EngineRunner, forced_logprobs
from edge0_eval.serve import _defaults
from edge0_eval.server.requests import generation_defaults

NAME = "tiny"
# Qwen3's generation_config.json sampling keys
GENERATION = {"temperature": 0.6, "top_p": 0.95, "top_k": 20}


@pytest.fixture(scope="module")
def served(edge0_qwen):
    solo = Engine.load(edge0_qwen, EngineOptions(mode="reactive"))
    vocab = int(solo.family.text_config(solo.config)["vocab_size"])
    server = LiveServer(
        edge0_qwen,
        EngineOptions(mode="reactive"),
        name=NAME,
        rows_at_once=4,
        max_tokens=8,
        api_key="k1",
        defaults=generation_defaults(GENERATION, vocab, "generation_config.json"),
    )
    yield server, solo
    server.close()
    solo.close()


def _post(server, path: str, body: dict, auth: str = "Bearer k1") -> httpx.Response:
    return httpx.post(
        f"{server.base}/{path}",
        json=body,
        headers={"Authorization": auth},
        timeout=60,
    )


HARMLESS = [  # (route, fields): each answered, each named in one warning
    ("completions", {"store": False, "metadata": {"run": "a"}}),
    ("chat/completions", {"parallel_tool_calls": False, "service_tier": "auto"}),
    ("chat/completions", {"response_format": {"type": "text"}, "tool_choice": "none"}),
    (
        "chat/completions",
        {"stream": True, "stream_options": {"continuous_usage_stats": True}},
    ),
]


def test_harmless_fields_are_ignored_with_a_warning(served, caplog):
    server, _ = served
    caplog.set_level(logging.WARNING, logger="edge0_eval.server")
    for route, fields in HARMLESS:
        body = {"max_tokens": 2, "temperature": 0, **fields}  # no model: the served one
        if route == "completions":
            body["prompt"] = "disk"
        else:
            body["messages"] = [{"role": "user", "content": "hi"}]
        caplog.clear()
        r = _post(server, route, body, auth="bearer k1")  # any case, as RFC 7235
        assert r.status_code == 200, r.text
        named = [k for k in fields if k not in ("stream", "stream_options")]
        named += ["stream_options.continuous_usage_stats"] * ("stream" in fields)
        warnings = [m for m in caplog.messages if "ignored" in m]
        assert len(warnings) == 1 and all(k in warnings[0] for k in named), warnings
    r = _post(server, "completions", {"prompt": "x", "max_tokens": 1}, auth="Basic k1")
    assert r.status_code == 401


def test_usage_is_null_in_every_chunk_but_the_last(served):
    server, _ = served
    body = dict(prompt="disk", max_tokens=3, temperature=0, stream=True)
    body["stream_options"] = {"include_usage": True}
    events = [e[6:] for e in _post(server, "completions", body).text.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["usage"]["completion_tokens"] == 3


def _prompt_ids(engine, text: str) -> list[int]:
    return list(engine.tokenizer.encode(text))


def test_echo_logprobs_are_the_engine_teacher_forced_scores(served):
    """echo + logprobs + max_tokens 0, for a list of prompts (text and token ids): each
    prompt token's log-prob and top k equal (float32, CPU) the engine's own teacher-forced
    scores of the same tokens; the first token's are null, as OpenAI and vLLM give them."""
    server, engine = served
    texts = ["disk expert slot stream", "route the token to a layer"]
    prompts = [texts[0], _prompt_ids(engine, texts[1])]
    body = dict(prompt=prompts, echo=True, logprobs=3, max_tokens=0)
    r = _post(server, "completions", body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert [c["index"] for c in out["choices"]] == [0, 1]
    for choice, text in zip(out["choices"], texts):
        ids = _prompt_ids(engine, text)
        lp = choice["logprobs"]
        assert choice["text"] == engine.tokenizer.decode(ids) == text
        assert choice["finish_reason"] == "length"
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        forced = list(forced_logprobs(EngineRunner(engine), ids[:1], ids[1:]))
        assert len(lp["token_logprobs"]) == len(ids) == len(forced) + 1
        for token, got, top, want in zip(
            ids[1:], lp["token_logprobs"][1:], lp["top_logprobs"][1:], forced
        ):
            assert got == float(want[token])
            best = np.sort(want)[::-1][:3]
            # a dict by token text: ids that decode alike (partial UTF-8) share a key
            assert set(top.values()) <= {float(v) for v in best}
            assert max(top.values()) == float(best[0])
    assert out["usage"]["completion_tokens"] == 0
    assert out["usage"]["prompt_tokens"] == sum(
        len(_prompt_ids(engine, t)) for t in texts
    )


def test_a_list_of_prompts_with_n_gives_each_prompt_n_choices(served):
    """3 prompts x n = 2: 6 choices, choice p * n + i prompt p's sample i, each its row
    run alone; usage counts each prompt once (as OpenAI and vLLM)."""
    server, engine = served
    texts = ["disk", "expert slot", "stream token route"]
    body = dict(prompt=texts, n=2, max_tokens=6, temperature=1.0, seed=11)
    out = _post(server, "completions", body).json()
    assert [c["index"] for c in out["choices"]] == list(range(6))
    prompt_tokens = generated = 0
    for p, text in enumerate(texts):
        ids = _prompt_ids(engine, text)
        prompt_tokens += len(ids)
        for i in range(2):
            choice = out["choices"][p * 2 + i]
            alone = engine.generate(
                ids, 6, temperature=1.0, seed=row_seed(11, ids, i), **GENERATION_REST
            )
            assert choice["text"] == alone.text and choice["edge0"]["sample"] == i
            generated += len(alone.tokens)
    assert out["usage"]["prompt_tokens"] == prompt_tokens
    assert out["usage"]["completion_tokens"] == generated
    # streamed, the same choices arrive piece by piece, each joined to its whole text
    stream = _post(server, "completions", dict(body, stream=True, logprobs=1)).text
    events = [e[6:] for e in stream.split("\n\n") if e and e != "data: [DONE]"]
    joined = [""] * 6
    for event in events:
        for c in json.loads(event)["choices"]:
            joined[c["index"]] += c["text"]
    assert joined == [c["text"] for c in out["choices"]]


# the defaults a request that gives temperature still takes from GENERATION
GENERATION_REST = {"top_p": 0.95, "top_k": 20}


def test_no_sampling_fields_draw_with_the_generation_config(served):
    """Without temperature a request was greedy; it now draws with generation_config.json's
    settings, as vLLM: two draws without a seed differ, one with a seed is the row drawn
    alone at those settings, and n > 1 needs no temperature."""
    server, engine = served
    body = dict(messages=[{"role": "user", "content": "Tell me about disks."}])
    body["max_tokens"] = 8
    texts = {
        _post(server, "chat/completions", body).json()["choices"][0]["message"][
            "content"
        ]
        for _ in range(4)
    }
    assert len(texts) >= 2
    ids = _prompt_ids(engine, "disk")
    out = _post(server, "completions", dict(prompt="disk", max_tokens=8, seed=3)).json()
    alone = engine.generate(ids, 8, seed=row_seed(3, ids, 0), **GENERATION)
    assert out["choices"][0]["text"] == alone.text
    two = _post(server, "completions", dict(prompt="disk", max_tokens=2, n=2))
    assert two.status_code == 200 and len(two.json()["choices"]) == 2
    models = httpx.get(
        f"{server.base}/models", headers={"Authorization": "Bearer k1"}, timeout=10
    ).json()
    assert models["data"][0]["sampling_defaults"] == GENERATION


def test_the_defaults_are_read_as_vllm_reads_generation_config(tmp_path):
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"eos_token_id": 2, "do_sample": True, **GENERATION})
    )
    assert _defaults(str(tmp_path), "auto", 1000) == GENERATION
    assert _defaults(str(tmp_path), "vllm", 1000) == {"temperature": 1.0}
    assert _defaults(str(tmp_path / "none"), "auto", 1000) == {"temperature": 1.0}
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 7}))
    with pytest.raises(ConfigError, match="generation_config.json.*top_p.*vllm"):
        _defaults(str(tmp_path), "auto", 1000)


def test_prompt_scoring_between_decode_steps_leaves_the_rows_as_alone(
    edge0_qwen, tmp_path
):
    """A prompt is scored on the engine thread between two decode steps of the rows already
    running. Prerouted with few slots, the scoring's reads would evict what the prerouter
    staged for the next step: the decoder drops that plan (BatchDecoder.between) and the
    running row stays its solo self (without it, it did not), while the echoes equal the
    engine's own scores."""
    solo = Engine.load(edge0_qwen, EngineOptions(mode="reactive"))
    heads = heads_of_kind(solo, tmp_path / "heads.safetensors", "context")
    solo.close()
    options = EngineOptions(
        mode="prerouted", prerouter_path=str(heads), slots_per_layer=4
    )
    server = LiveServer(edge0_qwen, options, name=NAME, rows_at_once=1, max_tokens=None)
    solo = Engine.load(edge0_qwen, options)
    try:
        long_ids = _prompt_ids(solo, "disk expert slot")
        alone = solo.generate(long_ids, 120, seed=row_seed(0, long_ids))
        ids = _prompt_ids(solo, "disk expert slot stream token route layer batch")
        forced = forced_logprobs(EngineRunner(solo), ids[:1], ids[1:])
        want = [float(lp[t]) for lp, t in zip(forced, ids[1:])]
        answer = {}
        body = dict(prompt=long_ids, max_tokens=120, temperature=0, seed=0)
        thread = threading.Thread(
            target=lambda: answer.update(
                _post(server, "completions", body).json()["choices"][0]
            )
        )
        thread.start()
        while not server.health()["rows"]:
            time.sleep(0.005)
        echo = dict(prompt=ids, echo=True, logprobs=1, max_tokens=0)
        for _ in range(4):
            got = _post(server, "completions", echo).json()["choices"][0]
            assert got["logprobs"]["token_logprobs"][1:] == want
        thread.join(120)
        assert answer["text"] == alone.text
    finally:
        server.close()
        solo.close()
