"""`edge0-eval serve` as a stock client sees it: the `openai` package against a live server.

Random requests, chat and completions, greedy and sampled, 1-64 tokens, stop words that
overlap and that end the answer at its first token, with and without a seed: each asked whole
and streamed, and the stream must give the whole answer's text, finish reason and usage. A
request without a seed draws a fresh one (returned in `edge0.request_seed`), so the second
way is asked with that seed: the replay must be the answer. Then `n`, prompts rendered as sent
and vLLM's defaults. Run time on a 2-core machine: about a minute (the tiny model, short
answers, up to 8 rows decoded together).
"""

from __future__ import annotations

import json
import random
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from live_server import LiveServer

from edge0_eval.engine.engine import Engine
from edge0_eval.engine.inputs import chat_ids, row_seed
from edge0_eval.engine.options import EngineOptions
from edge0_eval.server.app import STOPPING

NAME = "tiny"
ROWS = 8
WORDS = "disk expert slot stream token route layer batch prompt answer cache".split()


@pytest.fixture(scope="module")
def served(edge0_qwen):
    server = LiveServer(
        edge0_qwen,
        EngineOptions(mode="reactive"),
        name=NAME,
        rows_at_once=ROWS,
        max_tokens=None,
    )
    solo = Engine.load(edge0_qwen, EngineOptions(mode="reactive"))
    yield server, solo
    server.close()
    solo.close()


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=server.base, api_key="none", max_retries=0, timeout=120
    )


def ask(client, kind: str, kw: dict, stream: bool) -> dict:
    """One request through the openai client: per choice its text, finish reason and stats,
    and the usage, whether streamed or whole."""
    create = (client.chat if kind == "chat" else client).completions.create
    if not stream:
        r = create(**kw)
        choices = sorted(r.choices, key=lambda c: c.index)
        texts = [c.message.content if kind == "chat" else c.text for c in choices]
        stats = [getattr(c, "edge0", None) for c in choices]
        if len(choices) == 1:
            stats = [r.edge0]
        return dict(
            texts=texts,
            finish=[c.finish_reason for c in choices],
            usage=(
                r.usage.prompt_tokens,
                r.usage.completion_tokens,
                r.usage.total_tokens,
            ),
            stats=stats,
        )
    n = kw.get("n", 1)
    texts, finish, stats, usage = [""] * n, [None] * n, [None] * n, None
    for chunk in create(**kw, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = (
                chunk.usage.prompt_tokens,
                chunk.usage.completion_tokens,
                chunk.usage.total_tokens,
            )
        for c in chunk.choices:
            texts[c.index] += (c.delta.content or "") if kind == "chat" else c.text
            if c.finish_reason is not None:
                assert finish[c.index] is None, "a choice finished twice"
                finish[c.index], stats[c.index] = c.finish_reason, chunk.edge0
    return dict(texts=texts, finish=finish, usage=usage, stats=stats)


def _stops(rng: random.Random, text: str) -> list[str]:
    """Stop words from an answer's text: at its first characters (the first token's), two
    that overlap, or anywhere; sometimes one that never occurs."""
    if not text or "\ufffd" in text[:8]:
        return [rng.choice(WORDS)]
    shape = rng.randrange(4)
    if shape == 0:  # the answer ends at its first token
        return [text[: rng.randint(1, min(3, len(text)))]]
    at = rng.randrange(len(text))
    one = text[at : at + rng.randint(1, 3)]
    if shape == 1 and len(text) > at + 2:  # two overlapping stop words
        two = text[max(0, at - rng.randint(0, 2)) : at + rng.randint(2, 5)]
        return [one, two]
    if shape == 2:
        return [one, "never-" + rng.choice(WORDS)]
    return [one]


def _case(rng: random.Random, i: int) -> tuple[str, dict]:
    kind = "chat" if i % 2 else "completion"
    kw = dict(model=NAME, max_tokens=int(64 ** rng.random()))  # 1..64, most short
    if kind == "chat":
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 6)))
        kw["messages"] = [{"role": "user", "content": f"Request {i}: {words}"}]
    else:
        kw["prompt"] = [rng.randrange(3, 490) for _ in range(rng.randint(1, 8))]
    if rng.random() < 0.6:
        kw.update(temperature=rng.choice([0.7, 1.0]), top_p=rng.choice([0.9, 1.0]))
    if rng.random() < 0.5:
        kw["seed"] = rng.randrange(2**31)
    return kind, kw


def _one(server, i: int) -> int:
    """A case: a probe for its text, then the request with stop words from it, whole and
    streamed (a request without a seed: the second way replays the first's); the two must
    agree. Returns the requests made."""
    rng = random.Random(i)
    client = _client(server)
    kind, kw = _case(rng, i)
    made = 0
    if rng.random() < 0.6:
        probe = ask(client, kind, dict(kw, seed=kw.get("seed", 1)), stream=False)
        kw["stop"] = _stops(rng, probe["texts"][0])
        made += 1
    first_streamed = rng.random() < 0.5
    first = ask(client, kind, kw, stream=first_streamed)
    replay = dict(kw, seed=first["stats"][0]["request_seed"])
    second = ask(client, kind, replay, stream=not first_streamed)
    made += 2
    where = (i, kw, first_streamed)
    assert "seed" not in kw or first["stats"][0]["request_seed"] == kw["seed"], where
    assert second["texts"] == first["texts"], where
    assert second["finish"] == first["finish"], where
    assert second["usage"] == first["usage"], where
    assert second["stats"][0]["seed"] == first["stats"][0]["seed"], where
    assert second["stats"][0]["tokens"] == first["stats"][0]["tokens"], where
    # usage counts every generated token: a final stop id too, never more than asked.
    tokens, finish = first["stats"][0]["tokens"], first["finish"][0]
    assert (
        first["usage"][1] in (tokens, tokens + 1)
        and first["usage"][1] <= kw["max_tokens"]
    ), where
    assert finish == "stop" or first["usage"][1] == kw["max_tokens"], where
    return made


def test_streamed_answers_are_the_whole_ones(served):
    """>= 300 random requests: the streamed text, finish reason and usage are the whole
    answer's, whatever the length, stop words or seed. Before rows owned one text reader, a
    row whose first step took two tokens streamed only the second (max_tokens 2 gave
    'mps' for '\\x17mps'), and a seeded stop word lost text (' m' for ' d m')."""
    server, _ = served
    start = time.perf_counter()
    with ThreadPoolExecutor(ROWS) as pool:
        made = sum(pool.map(lambda i: _one(server, i), range(130)))
    assert made >= 300
    print(f"\n{made} requests in {time.perf_counter() - start:.1f} s")
    assert server.health()["status"] == "ok"


def test_a_row_that_ends_at_its_second_token_streams_its_first(served):
    """The first step of a new row takes two tokens (its prefill's and a decode step's): a
    stream that posted only the step's last token lost the first token's text whenever the
    row ended there (completions max_tokens 2: ' rangean' whole, 'an' streamed)."""
    server, _ = served
    client = _client(server)
    for prompt in ([493, 228, 413, 220, 281, 128], [99, 252, 53, 480, 340], [7]):
        kw = dict(model=NAME, prompt=prompt, max_tokens=2, seed=3)
        whole = ask(client, "completion", kw, stream=False)
        assert ask(client, "completion", kw, stream=True)["texts"] == whole["texts"]
        text = whole["texts"][0]
        if "\ufffd" not in text and text[-1] not in text[:-1]:  # stop in the 2nd token
            stop = dict(kw, max_tokens=8, stop=[text[-1]])
            whole = ask(client, "completion", stop, stream=False)
            streamed = ask(client, "completion", stop, stream=True)
            assert streamed["texts"] == whole["texts"] == [text[:-1]]


def test_a_request_without_a_seed_draws_a_fresh_one(served):
    """Three identical sampled requests without a seed were one answer three times: a stock
    client could not draw k samples. Each now draws its own seed, reported for replay."""
    server, _ = served
    client = _client(server)
    kw = dict(
        model=NAME,
        messages=[{"role": "user", "content": "Tell me about disks."}],
        max_tokens=12,
        temperature=1.0,
    )
    answers = [ask(client, "chat", kw, stream=False) for _ in range(4)]
    assert len({a["texts"][0] for a in answers}) >= 3
    seeds = [a["stats"][0]["request_seed"] for a in answers]
    assert len(set(seeds)) == 4
    for a, seed in zip(answers, seeds):
        again = ask(client, "chat", dict(kw, seed=seed), stream=True)
        assert again["texts"] == a["texts"] and again["usage"] == a["usage"]
    # seed -1 is vLLM's "none": a fresh one too.
    minus = ask(client, "chat", dict(kw, seed=-1), stream=False)
    assert minus["stats"][0]["request_seed"] not in seeds


def test_n_choices_are_rows_each_as_run_alone(served):
    """n=4: four rows of the running batch, choice i sample edge0_sample + i, each equal to
    its row run alone at the seed it reports; streamed the same; usage counts them all.
    (n > 1 was refused.)"""
    server, engine = served
    client = _client(server)
    messages = [{"role": "user", "content": "Name four disks."}]
    ids = chat_ids(engine.tokenizer, messages, {})
    kw = dict(
        model=NAME, messages=messages, max_tokens=10, temperature=1.0, top_p=0.95, n=4
    )
    whole = ask(client, "chat", dict(kw, seed=5), stream=False)
    assert len(whole["texts"]) == 4 and len(set(whole["texts"])) >= 3
    generated = 0
    for i, (text, stats) in enumerate(zip(whole["texts"], whole["stats"])):
        assert stats["seed"] == row_seed(5, ids, i) and stats["sample"] == i
        assert stats["request_seed"] == 5
        alone = engine.generate(
            ids, 10, temperature=1.0, top_p=0.95, seed=stats["seed"]
        )
        assert text == alone.text and stats["tokens"] == len(alone.output)
        generated += len(alone.tokens)
    assert whole["usage"] == (len(ids), generated, len(ids) + generated)
    streamed = ask(client, "chat", dict(kw, seed=5), stream=True)
    assert streamed["texts"] == whole["texts"] and streamed["usage"] == whole["usage"]
    # edge0_sample moves the window: choices 1.. of sample 0 are choices 0.. of sample 1.
    shifted = ask(
        client, "chat", dict(kw, seed=5, n=2, extra_body={"edge0_sample": 1}), False
    )
    assert shifted["texts"] == whole["texts"][1:3]
    # Without a seed: four fresh draws, one request seed that replays them all.
    text = dict(model=NAME, prompt=ids, max_tokens=10, temperature=1.0, n=4)
    fresh = ask(client, "completion", text, stream=True)
    seed = fresh["stats"][0]["request_seed"]
    assert {s["request_seed"] for s in fresh["stats"]} == {seed}
    assert len(set(fresh["texts"])) >= 3
    replay = ask(client, "completion", dict(text, seed=seed), stream=False)
    assert replay["texts"] == fresh["texts"] and replay["usage"] == fresh["usage"]


def _expected(messages: list[dict]) -> list[dict]:
    """The messages as the chat template is given them: text parts joined, an assistant's
    null content empty; nothing merged or dropped."""
    out = []
    for m in messages:
        content = m["content"]
        if isinstance(content, list):
            content = "".join(p["text"] for p in content)
        out.append({"role": m["role"], "content": content or ""})
    return out


def test_prompts_are_the_messages_as_sent(served):
    """The chat template sees the messages as sent, for every mix of roles: consecutive turns
    of one role were merged and empty ones dropped (user "Alpha", user "Beta": 24 prompt
    tokens, the template 30), and developer turns and an assistant's null content refused."""
    server, engine = served
    tok = engine.tokenizer
    client = _client(server)
    rng = random.Random(7)
    mixes = [
        [("user", "Alpha"), ("user", "Beta")],
        [("system", ""), ("user", "Alpha")],
        [("user", "Alpha"), ("assistant", ""), ("user", "Beta")],
        [("developer", "Be brief."), ("user", "hi")],
        [("user", "hi"), ("assistant", None), ("user", "again")],
    ]
    roles = ("system", "developer", "user", "assistant")
    for _ in range(20):
        mixes.append(
            [
                (rng.choice(roles), rng.choice(["", "x", "two words", "a\nb"]))
                for _ in range(rng.randint(1, 5))
            ]
        )
    for j, mix in enumerate(mixes):
        messages = [{"role": r, "content": c} for r, c in mix]
        if j % 3 == 0 and messages[-1]["content"]:
            text = messages[-1]["content"]  # as text parts
            messages[-1]["content"] = [
                {"type": "text", "text": text[:1]},
                {"type": "text", "text": text[1:]},
            ]
        want = tok.apply_chat_template(_expected(messages), add_generation_prompt=True)
        out = client.chat.completions.create(
            model=NAME, messages=messages, max_tokens=2, logprobs=True
        )
        assert out.usage.prompt_tokens == len(want), (mix, out.usage)
        alone = engine.generate(list(want), 2)
        assert [e.id for e in out.choices[0].logprobs.content] == alone.output, mix


def _eos_row(engine) -> tuple[list[int], int]:
    """A completions prompt and k: its greedy answer is EOS at token k (k - 1 of text)."""
    eos = set(engine.tokenizer.eos_token_ids)
    for p in range(3, 490):
        tokens = engine.generate([p, 5], 24).tokens
        if tokens[-1] in eos and len(tokens) > 1:
            return [p, 5], len(tokens)
    pytest.skip("no greedy answer of the tiny model ends with EOS within 24 tokens")


def _stop_at_last_token(engine) -> tuple[list[dict], int, str]:
    """Messages, k and a stop word that the greedy answer's k-th token completes (its text,
    whole characters, not in the text before)."""
    tok = engine.tokenizer
    for word in WORDS:
        messages = [{"role": "user", "content": word}]
        free = engine.generate(chat_ids(tok, messages, {}), 8, stop_token_ids=set())
        for k in range(2, 9):
            piece = tok.decode(free.tokens[k - 1 : k])
            if (
                piece.strip()
                and "\ufffd" not in piece
                and piece not in tok.decode(free.tokens[: k - 1])
                and not tok.decode(free.tokens[:k]).endswith("\ufffd")
            ):
                return messages, k, piece
    pytest.skip("no greedy answer of the tiny model has a clean k-th token")


def test_a_row_that_stops_on_its_last_allowed_token_says_stop(served):
    """A stop word completed by the last allowed token, or EOS as that token, is 'stop', and
    usage counts every generated token, the EOS too (vLLM's): it left the EOS out."""
    server, engine = served
    client = _client(server)
    messages, k, stop = _stop_at_last_token(engine)
    for stream in (False, True):
        out = ask(
            client,
            "chat",
            dict(model=NAME, messages=messages, max_tokens=k, stop=[stop]),
            stream,
        )
        assert out["finish"] == ["stop"] and out["usage"][1] == k
    prompt, k = _eos_row(engine)
    for stream in (False, True):
        out = ask(
            client, "completion", dict(model=NAME, prompt=prompt, max_tokens=k), stream
        )
        assert out["finish"] == ["stop"] and out["usage"][1] == k
        assert out["stats"][0]["tokens"] == k - 1  # the answer's: the EOS is not text


@pytest.fixture(scope="module")
def short(edge0_qwen):
    """A server whose rows hold 40 tokens, with CORS for one origin."""
    server = LiveServer(
        edge0_qwen,
        EngineOptions(mode="reactive"),
        name=NAME,
        max_tokens=None,
        max_model_len=40,
        allowed_origins=["http://app.example"],
    )
    yield server
    server.close()


MESSAGES = [{"role": "user", "content": " ".join(WORDS[:8])}]


def test_no_max_tokens_is_the_rest_of_the_row(short):
    """As vLLM: a request without max_tokens may fill its row (it was 512 new tokens, and a
    prompt that left fewer was a 400 naming a max_tokens the client never sent); /v1/models
    says how long a row is."""
    client = _client(short)
    ids = chat_ids(short.worker.tokenizer, MESSAGES, {})
    out = ask(client, "chat", dict(model=NAME, messages=MESSAGES), False)
    assert out["usage"][0] == len(ids) and len(ids) < 40
    assert out["finish"] == ["stop"] or out["usage"][1] == 40 - len(ids)
    full = [{"role": "user", "content": " ".join(WORDS * 4)}]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=NAME, messages=full)
    assert err.value.body["param"] == "messages"
    assert err.value.body["code"] == "context_length_exceeded"
    assert "max_tokens" not in err.value.body["message"]  # the client sent none
    (model,) = client.models.list().data
    assert model.max_model_len == 40


def test_ranges_are_checked_as_vllm_checks_them(short):
    """temperature in [0, 2] and presence/frequency penalties in [-2, 2] (any finite value
    was taken); top_k -1 is off; n > 1 needs sampling; assistant content may be null, no
    other role's."""
    for field, value in (
        ("temperature", 2.5),
        ("presence_penalty", 3),
        ("frequency_penalty", -2.5),
        ("n", 0),
        ("n", 2),  # greedy: every choice the same (vLLM refuses it)
    ):
        body = dict(model=NAME, messages=MESSAGES, max_tokens=2, **{field: value})
        r = httpx.post(f"{short.base}/chat/completions", json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, body
    for body, param in (
        (dict(messages=[{"role": "tool", "content": "x"}]), "messages[0].role"),
        (dict(messages=[{"role": "user", "content": None}]), "messages[0].content"),
    ):
        body = {"model": NAME, "max_tokens": 2, **body}
        r = httpx.post(f"{short.base}/chat/completions", json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = httpx.post(
        f"{short.base}/completions",
        json=dict(model=NAME, prompt="x", max_tokens=2, temperature=1, n=2, best_of=3),
        timeout=30,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "best_of"
    ok = httpx.post(
        f"{short.base}/chat/completions",
        json=dict(model=NAME, messages=MESSAGES, max_tokens=2, top_k=-1),
        timeout=30,
    )
    assert ok.status_code == 200


def test_cors_for_the_allowed_origins(short):
    """--allowed-origins: a preflight from an allowed origin is answered, and every response
    to it carries the header (errors and streams too); other origins get none. (There was no
    CORS: OPTIONS was a 405.)"""
    pre = httpx.options(
        f"{short.base}/chat/completions",
        headers={
            "Origin": "http://app.example",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        },
    )
    assert pre.status_code == 204
    assert pre.headers["Access-Control-Allow-Origin"] == "http://app.example"
    assert "POST" in pre.headers["Access-Control-Allow-Methods"]
    assert pre.headers["Access-Control-Allow-Headers"] == "authorization, content-type"
    for stream in (False, True):
        with httpx.stream(
            "POST",
            f"{short.base}/chat/completions",
            headers={"Origin": "http://app.example"},
            json=dict(model=NAME, messages=MESSAGES, max_tokens=2, stream=stream),
            timeout=30,
        ) as r:
            r.read()
        assert r.headers["Access-Control-Allow-Origin"] == "http://app.example"
    bad = httpx.post(
        f"{short.base}/chat/completions",
        headers={"Origin": "http://app.example"},
        json={"model": NAME},
    )
    assert bad.status_code == 400 and bad.headers["Access-Control-Allow-Origin"]
    other = httpx.get(f"{short.base}/models", headers={"Origin": "http://evil.example"})
    assert "Access-Control-Allow-Origin" not in other.headers


def test_cors_is_off_by_default(served):
    server, _ = served
    pre = httpx.options(
        f"{server.base}/chat/completions",
        headers={
            "Origin": "http://app.example",
            "Access-Control-Request-Method": "POST",
        },
    )
    assert pre.status_code == 405 and "Access-Control-Allow-Origin" not in pre.headers
    r = httpx.get(f"{server.base}/models", headers={"Origin": "http://app.example"})
    assert r.status_code == 200 and "Access-Control-Allow-Origin" not in r.headers
    assert json.loads(r.text)["data"][0]["max_model_len"] == 4096


def test_health_says_stopping_once_shutdown_begins(edge0_qwen):
    """From the shutdown signal on (serve sets STOPPING before closing its listener), /health
    is a 503 "stopping" and new requests are refused, while the running ones finish: a
    balancer stops sending work at once."""
    server = LiveServer(edge0_qwen, EngineOptions(mode="reactive"), name=NAME)
    try:
        server.loop.call_soon_threadsafe(server.app[STOPPING].set)
        health = httpx.get(f"http://127.0.0.1:{server.port}/health", timeout=10)
        assert health.status_code == 503 and health.json()["status"] == "stopping"
        r = httpx.post(
            f"{server.base}/chat/completions",
            json=dict(model=NAME, messages=MESSAGES, max_tokens=2),
            timeout=30,
        )
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
    finally:
        server.close()
