"""`edge0-eval serve`: OpenAI's routes on the continuous-batching engine, in this process.

Every answer is compared with the same prompt run alone in-process (`Engine.generate` at the
row's seed, `row_seed(seed, prompt ids, sample)`), token for token: through the HTTP layer,
whole or streamed, greedy or sampled, a request is the in-process row.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time

import httpx
import openai
import pytest
from bad_inputs import copy_model
from failing_step import FailingStep
from live_server import LiveServer, free_port

from edge0_eval.cli import main
from edge0_eval.engine.batch import (
    IncrementalText,
    StopRule,
    stop_token_ids,
    trim_at_stop,
)
from edge0_eval.engine.engine import Engine
from edge0_eval.engine.inputs import chat_ids, row_seed
from edge0_eval.engine.options import EngineOptions
from edge0_eval.formats.layout import EXPERTS_NAME
from edge0_eval.server import worker as worker_module
from edge0_eval.server.worker import TextStream, finish_reason

NAME = "tiny"
MESSAGES = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Write a haiku about disks, please."},
    ],
    [{"role": "user", "content": "def fib(n):"}],
]
TEMPLATE = {"enable_thinking": False}


@pytest.fixture(scope="module")
def served(edge0_qwen):
    server = LiveServer(edge0_qwen, EngineOptions(mode="reactive"), name=NAME)
    solo = Engine.load(edge0_qwen, EngineOptions(mode="reactive"))
    yield server, solo
    server.close()
    solo.close()


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=server.base, api_key="none", max_retries=0, timeout=60
    )


def _solo(engine, ids, max_tokens, seed=0, sample=0, **sampling):
    """The row alone: tokens up to (not including) EOS, as the server outputs them."""
    tokens = engine.generate(
        ids, max_tokens, seed=row_seed(seed, ids, sample), **sampling
    ).tokens
    return [t for t in tokens if t not in engine.tokenizer.eos_token_ids]


@pytest.mark.parametrize(
    "sampling",
    [{}, dict(temperature=0.9, top_p=0.9, top_k=20, seed=7)],
    ids=["greedy", "sampled"],
)
def test_chat_answers_equal_the_solo_row_whole_and_streamed(served, sampling):
    server, engine = served
    client = _client(server)
    seed = sampling.pop("seed", 0)
    for sample, messages in enumerate(MESSAGES):
        ids = chat_ids(engine.tokenizer, messages, TEMPLATE)
        want = _solo(engine, ids, 20, seed, sample, **sampling)
        kw = dict(model=NAME, messages=messages, max_tokens=20, seed=seed, **sampling)
        extra = dict(
            chat_template_kwargs=TEMPLATE,
            edge0_sample=sample,
            **{k: kw.pop(k) for k in ("top_k",) if k in kw},
        )
        whole = client.chat.completions.create(
            **kw, logprobs=True, top_logprobs=3, extra_body=extra
        )
        entries = whole.choices[0].logprobs.content
        assert [e.id for e in entries] == want
        assert whole.choices[0].message.content == engine.tokenizer.decode(want)
        assert whole.usage.completion_tokens == len(want)
        assert whole.usage.prompt_tokens == len(ids)
        assert whole.choices[0].finish_reason == (
            "length" if len(want) == 20 else "stop"
        )
        for e in entries:
            top = [t.logprob for t in e.top_logprobs]
            assert len(top) == 3 and top == sorted(top, reverse=True) and e.logprob <= 0
            if not sampling:
                assert e.logprob == pytest.approx(top[0])  # greedy: the most likely
        stats = whole.edge0
        assert (
            stats["seed"] == row_seed(seed, ids, sample) and stats["sample"] == sample
        )
        assert stats["tokens"] == len(want) and stats["cache"] == "not evicted"
        assert stats["pool"]["bytes_read"] >= 0 and "blocked_load_s" in stats["engine"]
        assert stats["model_identity"] == {"weights": "test"}
        chunks = list(
            client.chat.completions.create(
                **kw,
                stream=True,
                stream_options={"include_usage": True},
                extra_body=extra,
            )
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == whole.choices[0].message.content
        assert chunks[-1].usage.completion_tokens == len(want)
        last = next(c for c in chunks if c.choices and c.choices[0].finish_reason)
        assert last.edge0["tokens"] == len(want)


def test_text_completions_take_text_or_token_ids(served):
    server, engine = served
    client = _client(server)
    ids = engine.tokenizer.encode("Once upon a time")
    want = _solo(engine, ids, 12)
    for prompt in ("Once upon a time", ids):
        out = client.completions.create(
            model=NAME, prompt=prompt, max_tokens=12, logprobs=2
        )
        assert out.choices[0].text == engine.tokenizer.decode(want)
        assert len(out.choices[0].logprobs.token_logprobs) == len(want)
        assert all(len(t) == 2 for t in out.choices[0].logprobs.top_logprobs)
    streamed = client.completions.create(
        model=NAME, prompt=ids, max_tokens=12, stream=True
    )
    assert "".join(
        c.choices[0].text for c in streamed if c.choices
    ) == engine.tokenizer.decode(want)


def test_a_stop_word_ends_the_row_and_is_cut(served):
    server, engine = served
    ids = chat_ids(engine.tokenizer, MESSAGES[0], TEMPLATE)
    text = engine.tokenizer.decode(_solo(engine, ids, 20))
    stop = text[6:9]  # a few characters from the middle
    out = _client(server).chat.completions.create(
        model=NAME,
        messages=MESSAGES[0],
        max_tokens=20,
        stop=[stop],
        extra_body=dict(chat_template_kwargs=TEMPLATE),
    )
    assert out.choices[0].message.content == text[: text.index(stop)]
    assert out.choices[0].finish_reason == "stop" and out.edge0["stop_word"] == stop


BAD = [  # (route, body, status, param)
    ("chat", {"model": 5, "messages": MESSAGES[0]}, 400, "model"),
    ("chat", {"model": "other", "messages": MESSAGES[0]}, 404, "model"),
    ("chat", {"model": NAME}, 400, "messages"),
    ("chat", {"model": NAME, "messages": []}, 400, "messages"),
    (
        "chat",
        {"model": NAME, "messages": [{"role": "robot", "content": "x"}]},
        400,
        "messages[0].role",
    ),
    (
        "chat",
        {"model": NAME, "messages": [{"role": "user", "content": 5}]},
        400,
        "messages[0].content",
    ),
    (
        "chat",
        {"model": NAME, "messages": [{"role": "user", "content": [{"type": "image"}]}]},
        400,
        "messages[0].content[0]",
    ),
    ("chat", {"temperature": -1}, 400, "temperature"),
    ("chat", {"temperature": "hot"}, 400, "temperature"),
    ("chat", {"top_p": 0}, 400, "top_p"),
    ("chat", {"top_k": 2.5}, 400, "top_k"),
    ("chat", {"min_p": 1.5}, 400, "min_p"),
    ("chat", {"repetition_penalty": 0}, 400, "repetition_penalty"),
    ("chat", {"presence_context_size": 5}, 400, "presence_context_size"),
    ("chat", {"max_tokens": -1}, 400, "max_tokens"),
    ("chat", {"max_completion_tokens": -3}, 400, "max_completion_tokens"),
    ("chat", {"stop": 5}, 400, "stop"),
    ("chat", {"seed": -2}, 400, "seed"),
    ("chat", {"n": 2}, 400, "n"),
    ("chat", {"stream": "yes"}, 400, "stream"),
    ("chat", {"stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("chat", {"logprobs": "yes"}, 400, "logprobs"),
    ("chat", {"logprobs": True, "top_logprobs": 50}, 400, "top_logprobs"),
    ("chat", {"top_logprobs": 2}, 400, "top_logprobs"),
    ("chat", {"chat_template_kwargs": ["thinking"]}, 400, "chat_template_kwargs"),
    ("chat", {"edge0_sample": -1}, 400, "edge0_sample"),
    ("chat", {"response_format": {"type": "json_object"}}, 400, "response_format"),
    ("chat", {"tool_choice": "required"}, 400, "tool_choice"),
    ("chat", {"logit_bias": {"5": 10}}, 400, "logit_bias"),
    ("chat", {"echo": True}, 400, "echo"),
    ("completion", {"model": NAME, "prompt": []}, 400, "prompt"),
    ("completion", {"model": NAME, "prompt": [10**9]}, 400, "prompt"),
    ("completion", {"model": NAME, "prompt": "x", "logprobs": 9}, 400, "logprobs"),
    ("completion", {"model": NAME, "prompt": ["x", 5]}, 400, "prompt"),
    ("completion", {"model": NAME, "prompt": "x", "suffix": "y"}, 400, "suffix"),
]


def test_bad_requests_get_an_error_naming_the_field_and_the_server_goes_on(served):
    server, _ = served
    for route, body, status, param in BAD:
        if route == "chat" and "messages" not in body and "model" not in body:
            body = {"model": NAME, "messages": MESSAGES[0], **body}
        path = "chat/completions" if route == "chat" else "completions"
        r = httpx.post(f"{server.base}/{path}", json=body, timeout=30)
        assert r.status_code == status, (body, r.text)
        error = r.json()["error"]
        assert (
            error["param"] == param
            and param.split("[")[0].split(".")[0] in error["message"]
        ), (body, error)
    for raw, status in ((b"{not json", 400), (b"[1, 2]", 400), (b"\xff\xfe", 400)):
        r = httpx.post(f"{server.base}/chat/completions", content=raw, timeout=30)
        assert r.status_code == status and "error" in r.json()
    assert httpx.get(f"{server.base}/nothing", timeout=30).json()["error"]["message"]
    r = httpx.post(f"{server.base}/models", timeout=30)
    assert r.status_code == 405 and "error" in r.json()
    with pytest.raises(openai.BadRequestError, match="top_p"):
        _client(server).chat.completions.create(
            model=NAME, messages=MESSAGES[0], top_p=7
        )
    ok = _client(server).chat.completions.create(
        model=NAME, messages=MESSAGES[0], max_tokens=3
    )
    assert ok.choices[0].finish_reason in ("length", "stop")
    assert server.health()["status"] == "ok"
    assert (
        httpx.get(f"{server.base}/models", timeout=30).json()["data"][0]["id"] == NAME
    )


def _random_text_ids(tok, rng: random.Random, n: int) -> list[int]:
    """The ids of n random pieces of text (words, code, a newline, accents and an emoji)."""
    pieces = [
        "The answer is 4. ",
        "x = 1 + 2 ",
        "def fib(n): ",
        "Hello, world! ",
        " end\n",
        "\u00e9 \u00fc \U0001f600 ",
    ]
    text = "".join(rng.choice(pieces) for _ in range(n))
    return tok.encode(text, add_special_tokens=False)


def _stream_and_answer(tok, ids, stop):
    """(streamed text, whole answer) of a row that takes `ids`, as the worker's _advance and
    _finish make them: the stop rule first, then the streamed text, then the rest."""
    rule = StopRule(tok, 10**6, stop_token_ids(tok, stop), stop)
    stream, streamed = (
        TextStream(stop, rule.reader),
        "",
    )  # the rule's reader, as the worker's
    for token in ids:
        if rule.add(token):
            break
        streamed += stream.update()
    final, _ = rule.text()
    return streamed, final


def test_a_row_without_stop_strings_reads_its_text_when_it_is_wanted(served):
    """Decoding a row's text is host work between decode steps: a rule with no stop string
    to look for takes tokens without decoding any; its text, read afterwards token by token,
    is the text read as the tokens came (incomplete characters included)."""
    tok = served[1].tokenizer
    rng = random.Random(1)
    for _ in range(40):
        ids = _random_text_ids(tok, rng, 4)
        as_they_come = IncrementalText(tok)
        for token in ids:
            as_they_come.add(token)
            as_they_come.read_new()
        rule = StopRule(tok, 10**6, set(), [])
        decodes = []
        decode = rule.reader.decode
        rule.reader.decode = lambda t: decodes.append(t) or decode(t)
        for token in ids:
            assert not rule.add(token)
        assert decodes == []
        assert rule.text() == (as_they_come.text + as_they_come.rest(), None)
        assert decodes


def test_streamed_text_never_runs_past_a_stop_word(served):
    """mlx-lm's streaming detokenizer (the stop rule's) shows a trailing space a token later
    than `decode` (the streamed text's): with stop 'is ', 'The answer is' + ' ' streamed
    'The answer i' before the rule stopped at 'The answer '. What is streamed must always be
    a prefix of the answer, whatever the tokens and stop words."""
    tok = served[1].tokenizer
    ids = [
        t
        for part in ("The answer is", " ", "4.")
        for t in tok.encode(part, add_special_tokens=False)
    ]
    assert _stream_and_answer(tok, ids, ["is "]) == ("The answer ", "The answer ")
    # A longer stop word completing in a later token but starting before the first one seen:
    # the stream holds back after a first stop word too ('The answer ' was sent while the
    # whole text's answer is 'The '; the rule now ends a row at the first, but the stream
    # must not rely on it).
    stop = ["is ", "answer is 4"]
    reader = IncrementalText(tok)
    stream, streamed = TextStream(stop, reader), ""
    for token in ids:
        reader.add(token)
        streamed += stream.update()
    assert trim_at_stop(tok.decode(ids), stop)[0] == "The " and "The ".startswith(
        streamed
    )
    rng = random.Random(0)
    for _ in range(200):
        ids = _random_text_ids(tok, rng, 5)
        text = tok.decode(ids)
        at = rng.randrange(len(text) - 4)
        stop = [text[at : at + rng.randint(1, 4)]]
        if rng.random() < 0.5:  # a second, longer one starting at or before it
            back = rng.randint(0, min(at, 6))
            stop.append(text[at - back : at + rng.randint(5, 12)])
        streamed, final = _stream_and_answer(tok, ids, stop)
        assert final.startswith(streamed), (stop, streamed, final)


def test_a_stop_word_opening_the_answer_with_a_space_ends_the_row(served):
    """mlx-lm's streaming detokenizer drops the first text's leading space, so a stop word
    ' is 4' at the very start was never seen: the row ran to max_tokens and said 'length'
    (its text was trimmed right). The rule reads the text as `decode` gives it."""
    tok = served[1].tokenizer
    ids = tok.encode(
        " is 4. And that is all there was to say about it.", add_special_tokens=False
    )
    for stop in ([" is 4"], ["is 4"]):
        rule = StopRule(tok, len(ids) + 1, stop_token_ids(tok, stop), stop)
        ended = [rule.add(t) for t in ids]
        assert rule.finish == "stop_word" and ended.index(True) < 5, (stop, rule.finish)
        assert finish_reason(rule) == "stop"
        assert (
            trim_at_stop(tok.decode(rule.tokens), stop)[0]
            == " is 4"[: 5 - len(stop[0])]
        )


def test_a_failed_decode_step_is_an_error_never_a_partial_answer(served, monkeypatch):
    """An expert read that fails inside a decode step (as engine/store.py raises it) fails the
    request: a 500 error object, or, streaming, an error event with no [DONE]; the next
    request is answered as alone."""
    server, engine = served
    fail = []  # decode steps to go until the fault

    def fails(where):
        if where.startswith("at batched decode step") and fail:
            fail[0] -= 1
            if fail[0] == 0:
                fail.clear()
                return OSError(5, "Input/output error", "experts.bin")

    served_engine = server.worker.engine
    monkeypatch.setattr(served_engine, "step", FailingStep(served_engine.step, fails))
    client = _client(server)
    kw = dict(
        model=NAME,
        messages=MESSAGES[1],
        max_tokens=20,
        extra_body=dict(chat_template_kwargs=TEMPLATE),
    )
    fail.append(1)  # before the first token is out: a 500
    with pytest.raises(openai.InternalServerError, match="Input/output error") as err:
        client.chat.completions.create(**kw)
    assert err.value.body["code"] == "engine_error"
    fail.append(4)  # mid-stream: an error event
    with httpx.stream(
        "POST",
        f"{server.base}/chat/completions",
        timeout=30,
        json=dict(kw.pop("extra_body"), **kw, stream=True),
    ) as r:
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert (
        r.status_code == 200 and len(events) > 2 and "Input/output error" in events[-1]
    )
    assert "[DONE]" not in "".join(events)
    assert not any(
        '"finish_reason": "length"' in e or '"finish_reason": "stop"' in e
        for e in events
    )
    ids = chat_ids(engine.tokenizer, MESSAGES[1], TEMPLATE)
    again = client.chat.completions.create(
        **kw, extra_body=dict(chat_template_kwargs=TEMPLATE), logprobs=True
    )
    assert [e.id for e in again.choices[0].logprobs.content] == _solo(engine, ids, 20)
    assert server.worker.load()["failed"] >= 2


def test_a_worker_that_dies_fails_every_waiting_request_and_refuses_new_ones(
    edge0_qwen, monkeypatch
):
    """A fault the worker cannot recover from (here: no memory for a new batch after a failed
    step) ends its thread. Every request it held, decoding or still queued, is failed (500, no
    hang); later ones are refused at once (503), and /health says so."""
    server = LiveServer(
        edge0_qwen, EngineOptions(mode="reactive"), name=NAME, rows_at_once=1
    )
    try:
        worker, release = server.worker, threading.Event()

        def step():  # holds the thread until the second request waits
            release.wait(30)
            raise OSError(5, "Input/output error", "experts.bin")

        def no_batch(*args, **kwargs):
            raise MemoryError("no memory for a new batch")

        monkeypatch.setattr(worker.decoder, "step", step)
        monkeypatch.setattr(worker_module, "BatchDecoder", no_batch)
        body = dict(model=NAME, messages=MESSAGES[0], max_tokens=8)
        answers = []

        def ask():
            r = httpx.post(f"{server.base}/chat/completions", json=body, timeout=30)
            answers.append((r.status_code, r.json()["error"]))

        first = threading.Thread(target=ask)
        first.start()
        deadline = time.monotonic() + 20
        while not worker.jobs and time.monotonic() < deadline:  # the first is decoding
            time.sleep(0.02)
        second = threading.Thread(target=ask)
        second.start()
        while (
            worker.inbox.qsize() == 0 and time.monotonic() < deadline
        ):  # the second queued
            time.sleep(0.02)
        release.set()
        first.join(40)
        second.join(40)
        assert len(answers) == 2 and all(status == 500 for status, _ in answers), (
            answers
        )
        assert any("MemoryError" in e["message"] for _, e in answers)
        worker.join(10)
        assert not worker.is_alive()
        start = time.monotonic()
        r = httpx.post(f"{server.base}/chat/completions", json=body, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_stopped"
        assert time.monotonic() - start < 5
        assert (
            httpx.get(f"http://127.0.0.1:{server.port}/health", timeout=10).status_code
            == 503
        )
    finally:
        release.set()
        server.close()


def test_serve_exits_when_the_batch_pool_cannot_be_made(
    edge0_qwen, monkeypatch, capsys
):
    """Entering the batch's expert pool fails (no memory for --max-batch x top-k slots): serve
    exits with status 2 and one line naming the fix, never a hang."""

    @contextlib.contextmanager
    def no_pool(self, rows_at_once):
        raise MemoryError(f"cannot allocate {rows_at_once} x top-k slots per layer")
        yield

    monkeypatch.setattr(Engine, "batch_pool", no_pool)
    status = []
    serve = threading.Thread(
        target=lambda: status.append(
            main(
                [
                    "serve",
                    str(edge0_qwen),
                    "--port",
                    str(free_port()),
                    "--max-batch",
                    "64",
                ]
            )
        ),
        daemon=True,
    )
    serve.start()
    serve.join(60)
    assert not serve.is_alive(), "serve hangs when the batch pool cannot be made"
    err = capsys.readouterr().err
    assert (
        status == [2] and "Traceback" not in err and len(err.strip().splitlines()) == 1
    )
    assert (
        "MemoryError: cannot allocate 64 x top-k slots" in err and "--max-batch" in err
    )


def test_a_corrupt_expert_file_is_an_error_naming_it(edge0_qwen, tmp_path):
    model = copy_model(edge0_qwen, tmp_path / "m")
    server = LiveServer(model, EngineOptions(mode="reactive"), name=NAME)
    try:
        path = model / EXPERTS_NAME
        with open(path, "r+b") as f:  # in place, under the running engine
            f.write(b"\x5a" * path.stat().st_size)
        r = httpx.post(
            f"{server.base}/chat/completions",
            timeout=30,
            json=dict(model=NAME, messages=MESSAGES[0], max_tokens=5),
        )
        assert r.status_code == 500
        message = r.json()["error"]["message"]
        assert (
            str(path) in message
            and "changed while the engine was reading it" in message
        )
        assert server.health()["status"] == "ok"
    finally:
        server.close()


def _refused(server, cases: list) -> None:
    """Each (route, body: a dict or raw bytes, param) is a 400 whose message names param."""
    for route, body, param in cases:
        path = "chat/completions" if route == "chat" else "completions"
        kw = dict(content=body) if isinstance(body, bytes) else dict(json=body)
        r = httpx.post(f"{server.base}/{path}", timeout=30, **kw)
        assert r.status_code == 400, (param, r.text)
        error = r.json()["error"]
        assert error["param"] == param and param in error["message"], error


def test_values_the_engine_cannot_take_are_400s_naming_the_field(served):
    """Values that pass the plain checks but would fail in MLX, in the tokenizer or in the
    JSON reader (each was a 500): a 400 naming the field."""
    server, engine = served
    vocab = int(engine.family.text_config(engine.config)["vocab_size"])
    chat = dict(model=NAME, messages=MESSAGES[0], max_tokens=4)
    _refused(
        server,
        [
            (
                "chat",
                b'{"model": "tiny", "messages": '
                + b"[" * 200000
                + b"]" * 200000
                + b"}",
                "messages",
            ),
            ("chat", {**chat, "temperature": 0.7, "top_k": vocab}, "top_k"),
            (
                "chat",
                {**chat, "repetition_penalty": 1.1, "repetition_context_size": 2**64},
                "repetition_context_size",
            ),
            (
                "chat",
                {**chat, "presence_penalty": 0.5, "presence_context_size": 2**31},
                "presence_context_size",
            ),
            (
                "chat",
                b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], '
                b'"max_tokens": 4, "stop": ["\\ud800x"]}',
                "stop",
            ),
        ],
    )
    # Too deep, then an unterminated run of escaped quotes: the scan for the field restarted
    # at each quote, quadratic (124 s for this 200 KB body, holding the GIL and the event
    # loop); one pass now takes milliseconds. Not a speed target: a bound 1000x off either.
    start = time.perf_counter()
    _refused(
        server,
        [("chat", b'{"messages": ' + b"[" * 5000 + b'"' + b'\\"' * 100000, "messages")],
    )
    assert time.perf_counter() - start < 10
    greedy = httpx.post(
        f"{server.base}/chat/completions",
        timeout=30,
        json={**chat, "temperature": 0, "top_k": vocab},
    )  # top_k unused
    assert greedy.status_code == 200
    assert server.health()["status"] == "ok"


def test_a_row_holds_at_most_the_model_context(served):
    """max_tokens, and the prompt with it, are bounded by the model's context (LiveServer's
    default --max-model-len): more is a 400 naming the field, not a row run past it."""
    server, engine = served
    context = int(engine.family.text_config(engine.config)["max_position_embeddings"])
    chat = dict(model=NAME, messages=MESSAGES[0])
    refused = server.worker.load()["refused"]
    _refused(
        server,
        [
            ("chat", {**chat, "max_tokens": 10**9}, "max_tokens"),
            (
                "chat",
                {**chat, "max_completion_tokens": context + 1},
                "max_completion_tokens",
            ),
            (
                "chat",
                {**chat, "max_tokens": context},
                "max_tokens",
            ),  # no room for a prompt
            ("chat", {**chat, "max_tokens": context - 2}, "messages"),
            (
                "completion",
                dict(
                    model=NAME,
                    prompt=engine.tokenizer.encode("Once upon a time"),
                    max_tokens=context - 1,
                ),
                "prompt",
            ),
        ],
    )
    assert server.worker.load()["refused"] == refused + 2  # the two over the context
    over = httpx.post(
        f"{server.base}/chat/completions",
        timeout=30,
        json={**chat, "max_tokens": context - 2},
    ).json()["error"]
    # OpenAI's code, clients test it
    assert over["code"] == "context_length_exceeded", over
    assert server.worker.max_model_len == context
    assert server.health()["status"] == "ok"


def test_a_client_that_leaves_cancels_its_row(served):
    server, _ = served
    before = server.worker.load()["cancelled"]
    with httpx.stream(
        "POST",
        f"{server.base}/chat/completions",
        timeout=30,
        json=dict(model=NAME, messages=MESSAGES[2], max_tokens=4000, stream=True),
    ) as r:
        next(line for line in r.iter_lines() if line.startswith("data: "))
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        load = server.worker.load()
        if load["cancelled"] > before and load["rows"] == 0:
            break
        time.sleep(0.05)
    load = server.worker.load()
    assert (
        load["cancelled"] == before + 1 and load["rows"] == 0 and load["waiting"] == 0
    )


def test_an_api_key_is_required_when_set(edge0_qwen):
    server = LiveServer(
        edge0_qwen, EngineOptions(mode="reactive"), name=NAME, api_key="k1"
    )
    try:
        body = dict(model=NAME, messages=MESSAGES[0], max_tokens=2)
        r = httpx.post(f"{server.base}/chat/completions", json=body, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = httpx.post(
            f"{server.base}/chat/completions",
            json=body,
            timeout=30,
            headers={"Authorization": "Bearer k1"},
        )
        assert r.status_code == 200
    finally:
        server.close()


def test_serve_cli_errors_are_one_line(edge0_qwen, tmp_path, capsys):
    assert main(["serve", str(tmp_path / "missing")]) == 2
    assert "config.json not found" in capsys.readouterr().err
    assert (
        main(["serve", str(edge0_qwen), "--max-model-len", "64", "--max-tokens", "64"])
        == 2
    )
    assert (
        "--max-tokens 64 leaves no room for a prompt in 64 tokens"
        in capsys.readouterr().err
    )
    assert main(["serve", str(edge0_qwen), "--max-model-len", "100000000"]) == 2
    assert "--max-model-len 100000000 is beyond" in capsys.readouterr().err
    # A request gives its seed or draws a fresh one: serve has none to take.
    assert main(["serve", str(edge0_qwen), "--seed", "3"]) == 2
    assert "serve takes no --seed" in capsys.readouterr().err
    assert main(["serve", str(edge0_qwen), "--allowed-origins", "app.example/x"]) == 2
    assert "--allowed-origins: 'app.example/x' is not an origin" in (
        capsys.readouterr().err
    )
    server = LiveServer(edge0_qwen, EngineOptions(mode="reactive"), name=NAME)
    try:
        assert main(["serve", str(edge0_qwen), "--port", str(server.port)]) == 2
        err = capsys.readouterr().err
        assert (
            f"cannot listen on 127.0.0.1:{server.port}" in err
            and "Traceback" not in err
        )
    finally:
        server.close()


def test_stock_opencompass_openaisdk_carries_the_seed(served):
    """OpenCompass's own OpenAISDK reaches the same row: the run's seed as the OpenAI `seed`
    (openai_extra_kwargs), the sampling options and chat template arguments in extra_body.
    It has no per-prompt sample index: it reproduces sample 0 of every question."""
    from opencompass.models import OpenAISDK

    server, engine = served
    model = OpenAISDK(
        path=NAME,
        openai_api_base=server.base,
        key="none",
        tokenizer_path=str(engine.directory),
        max_seq_len=4096,
        retry=1,
        openai_extra_kwargs=dict(seed=11, temperature=0.9, top_p=0.9),
        extra_body=dict(chat_template_kwargs=TEMPLATE, top_k=20),
    )
    out = model.generate([MESSAGES[1][1]["content"]], max_out_len=16)
    ids = chat_ids(engine.tokenizer, [MESSAGES[1][1]], TEMPLATE)
    want = _solo(engine, ids, 16, seed=11, temperature=0.9, top_p=0.9, top_k=20)
    assert out == [engine.tokenizer.decode(want)]
