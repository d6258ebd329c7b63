"""Edge0APIModel (OpenCompass's OpenAISDK with the in-process arms' settings) against servers in
this process: its predictions and sample seeds are the in-process Edge0Model's, it spreads a
call over its hosts and leaves a dead one, and a refused request is one clear error."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from live_server import LiveServer, free_port

from edge0_eval.engine.options import EngineOptions
from edge0_eval.errors import ConfigError
from model_wrappers.models.edge0_api_model import Edge0APIModel, api_problems
from model_wrappers.models.edge0_model import Edge0Model

NAME = "edge0-student"
GENERATION = dict(
    generation_kwargs=dict(temperature=0.8, top_p=0.9, seed=3),
    chat_template_kwargs=dict(enable_thinking=False),
    max_seq_len=2048,
)
PROMPTS = [
    [{"role": "HUMAN", "prompt": "What is 2 + 2?"}],
    "Write a haiku about disks.",
    [{"role": "SYSTEM", "prompt": "Be brief."}, {"role": "HUMAN", "prompt": "hi"}],
]


@pytest.fixture(scope="module")
def hosts(edge0_qwen):
    servers = [
        LiveServer(edge0_qwen, EngineOptions(mode="reactive"), name=NAME)
        for _ in range(2)
    ]
    yield servers
    for s in servers:
        s.close()


def test_predictions_and_seeds_equal_the_in_process_arm(edge0_qwen, hosts):
    dead = f"http://127.0.0.1:{free_port()}/v1"
    api = Edge0APIModel(
        path=NAME,
        openai_api_base=[dead] + [h.base for h in hosts],
        tokenizer_path=str(edge0_qwen),
        retry_wait=60,
        **GENERATION,
    )
    local = Edge0Model(
        path=str(edge0_qwen), mode="reactive", no_lora=True, **GENERATION
    )
    samples = [0, 0, 1]
    want = local.generate(PROMPTS, 20, sample_indices=samples)
    got = api.generate(PROMPTS * 2, 20, sample_indices=samples * 2)
    assert got == want * 2
    stats, mine = api.pop_sample_stats(), local.pop_sample_stats()
    assert [s["seed"] for s in stats] == [s["seed"] for s in mine] * 2
    assert [s["finish_reason"] for s in stats] == [s["finish_reason"] for s in mine] * 2
    served = {s["api_base"] for s in stats}
    assert dead not in served and served == {
        h.base for h in hosts
    }  # both live hosts used
    assert api.hosts.down_until[dead] > 0  # the dead one left


def test_a_refused_request_and_a_dead_host_are_clear_errors(edge0_qwen, hosts):
    wrong = Edge0APIModel(
        path="another-model",
        openai_api_base=hosts[0].base,
        tokenizer_path=str(edge0_qwen),
        **GENERATION,
    )
    with pytest.raises(
        ConfigError, match="refused the request \\(404\\).*another-model"
    ):
        wrong.generate(PROMPTS[:1], 4)
    dead = Edge0APIModel(
        path=NAME,
        openai_api_base=f"http://127.0.0.1:{free_port()}/v1",
        tokenizer_path=str(edge0_qwen),
        retry=2,
        retry_wait=0.1,
        **GENERATION,
    )
    with pytest.raises(
        RuntimeError, match="no host answered after 2 attempts.*opencompass -r"
    ):
        dead.generate(PROMPTS[:1], 4)
    problems = api_problems(
        "arm",
        dict(
            path="another-model",
            tokenizer_path="/nonexistent",
            openai_api_base=[hosts[0].base],
        ),
    )
    assert any("tokenizer_path" in p for p in problems)
    assert any(f"serves ['{NAME}'], not 'another-model'" in p for p in problems)
    with pytest.raises(ConfigError, match="openai_api_base"):
        Edge0APIModel(
            path=NAME, openai_api_base="localhost:8000", tokenizer_path=str(edge0_qwen)
        )


def test_a_refused_request_leaves_the_host_up(edge0_qwen, hosts):
    """A 4xx is the request's fault: the host that answered it is not put on cooldown."""
    base = hosts[0].base
    api = Edge0APIModel(
        path="another-model",
        openai_api_base=base,
        tokenizer_path=str(edge0_qwen),
        retry_wait=60,
        **GENERATION,
    )
    with pytest.raises(ConfigError, match="refused the request \\(404\\)"):
        api.generate(PROMPTS[:1], 4)
    assert api.hosts.down_until[base] == 0.0 and api.hosts.busy[base] == 0


def test_a_busy_host_is_retried_not_blamed_on_the_request(edge0_qwen):
    """429 (and 408, 409) say the host is busy, as the openai client reads them: the request
    is retried (it was a ConfigError that ended the call on the first 429)."""
    calls = []

    class Host(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            calls.append(self.path)
            code, body = (
                (429, {"error": {"message": "too many requests"}})
                if len(calls) == 1
                else (
                    200,
                    {
                        "id": "x",
                        "object": "chat.completion",
                        "created": 0,
                        "model": NAME,
                        "choices": [
                            {
                                "index": 0,
                                "finish_reason": "stop",
                                "logprobs": None,
                                "message": {"role": "assistant", "content": "4"},
                            }
                        ],
                        "usage": {
                            "prompt_tokens": 1,
                            "completion_tokens": 1,
                            "total_tokens": 2,
                        },
                    },
                )
            )
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Host)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        api = Edge0APIModel(
            path=NAME,
            openai_api_base=f"http://127.0.0.1:{server.server_port}/v1",
            tokenizer_path=str(edge0_qwen),
            retry=3,
            retry_wait=0.1,
        )
        assert api.generate(["What is 2 + 2?"], 4) == ["4"]
        assert len(calls) == 2
    finally:
        server.shutdown()


def test_max_out_len_beyond_the_context_is_answered_as_in_process(edge0_qwen):
    """max_out_len at or beyond the host's max_model_len was a 400 that ended the call
    (max_tokens leaves no room for a prompt) where the in-process arm answers: the arm now
    asks an edge0-eval host for the rest of its row, and an answer that ends within it is
    the in-process one."""
    host = LiveServer(
        edge0_qwen, EngineOptions(mode="reactive"), name=NAME, max_model_len=64
    )
    greedy = dict(GENERATION, generation_kwargs=dict(temperature=0.0, seed=3))
    try:
        api = Edge0APIModel(
            path=NAME,
            openai_api_base=host.base,
            tokenizer_path=str(edge0_qwen),
            **greedy,
        )
        local = Edge0Model(
            path=str(edge0_qwen), mode="reactive", no_lora=True, **greedy
        )
        for prompt in ("disk batch", "route stream", "batch disk", "disk route"):
            (want,) = local.generate([prompt], 100)
            (stats,) = local.pop_sample_stats()
            room = 64 - stats["prompt_tokens"]
            if stats["finish_reason"] == "eos" and stats["tokens"] < room:
                break
        else:
            pytest.skip("no greedy answer of the tiny model ends within the row")
        assert api.generate([prompt], 100) == [want]
        (served,) = api.pop_sample_stats()
        assert served["finish_reason"] == "eos" and served["tokens"] == stats["tokens"]
        assert api.contexts == {host.base: 64}
    finally:
        host.close()


def _host(body: dict, listing: bool = True) -> ThreadingHTTPServer:
    """A fake OpenAI host that answers every POST with `body`; its GET /models lists no
    model, or (listing False) fails after its headers, as mlx_lm.server's does when it
    cannot scan its cache: a 200 with an empty body."""

    class Host(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            data = json.dumps({"object": "list", "data": []}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            if not listing:
                self.send_header("Connection", "close")
                self.end_headers()
                return
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Host)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_an_edge0_host_answer_is_taken_as_served_and_another_is_read(edge0_qwen):
    """An edge0-eval serve answer (it has `edge0`) is the row's own: its text, finish and
    tokens, never replayed through the stop rule (the text came from the ids before). Any
    other server's token ids are read through the arm's stop rule."""
    from mlx_lm.utils import load_tokenizer

    tok = load_tokenizer(edge0_qwen)
    ids = tok.encode("alpha STOP beta", add_special_tokens=False)
    entries = [{"id": i, "token": tok.decode([i]), "logprob": -1.0} for i in ids]
    answer = {
        "id": "x",
        "object": "chat.completion",
        "created": 0,
        "model": NAME,
        "choices": [
            {
                "index": 0,
                "finish_reason": "stop",
                "logprobs": {"content": entries},
                "message": {"role": "assistant", "content": "as served"},
            }
        ],
        "usage": {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4},
    }
    stats = {"finish_reason": "stop_word", "tokens": 2, "seed": 9, "sample": 0}
    for body, want, listing in (
        (dict(answer, edge0=stats), "as served", True),
        (answer, "alpha", True),  # another server: its ids through the stop rule
        (answer, "alpha", False),  # one whose /models cannot be read
    ):
        server = _host(body, listing)
        try:
            api = Edge0APIModel(
                path=NAME,
                openai_api_base=f"http://127.0.0.1:{server.server_port}/v1",
                tokenizer_path=str(edge0_qwen),
                stop_words=[" STOP"],
            )
            assert api.generate(["hi"], 32) == [want]
            (got,) = api.pop_sample_stats()
            if "edge0" in body:
                assert got["tokens"] == 2 and got["finish_reason"] == "stop_word"
            else:
                assert (
                    got["finish_reason"] == "stop_word" and got["stop_word"] == " STOP"
                )
        finally:
            server.shutdown()
