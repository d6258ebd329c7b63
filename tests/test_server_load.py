"""A load test of one `edge0-eval serve` process (prerouted, up to 8 rows decoded together):
32 concurrent clients with mixed prompt and answer lengths, greedy and sampled, whole and
streamed, 6 that leave mid-stream and 6 malformed requests. Every answer must be its own row run
alone in-process, token for token (none lost or crossed), every malformed request a 4xx naming
its field, and the server must go on serving. Latency and aggregate tok/s are printed (the
figures are the tiny model's on a shared CPU: a smoke reading, not a benchmark)."""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from itertools import islice

import httpx
import pytest
from live_server import start_serve, stop
from perturbed_heads import perturbed_heads

from edge0_eval.engine.engine import Engine
from edge0_eval.engine.inputs import chat_ids, row_seed
from edge0_eval.engine.options import EngineOptions

NAME = "load"
TEMPLATE = {"enable_thinking": False}
WORDS = (
    "disk expert slot stream token route layer batch prompt answer cache read "
    "write model head"
).split()
LENGTHS = (4, 8, 16, 24, 32, 48)
MALFORMED = [
    ({"temperature": -0.5}, "temperature"),
    ({"top_k": "ten"}, "top_k"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"messages": [{"role": "bot"}]}, "messages[0].role"),
    ({"stop": [""]}, "stop"),
    ({"frequency_context_size": 3}, "frequency_context_size"),
]


def _messages(i: int) -> list[dict]:
    words = " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(3 + (i * 5) % 40))
    return [{"role": "user", "content": f"Request {i}: {words}?"}]


def _normal(i: int) -> dict:
    body = dict(
        model=NAME,
        messages=_messages(i),
        max_tokens=LENGTHS[i % len(LENGTHS)],
        logprobs=True,
        chat_template_kwargs=TEMPLATE,
        stream=i % 3 == 0,
        temperature=0,  # greedy (a request without one draws at the model's defaults)
    )
    if i % 2:
        body.update(temperature=0.8, top_p=0.95, seed=100 + i)
    return body


async def _ask(client: httpx.AsyncClient, base: str, body: dict, leave: bool = False):
    """(status, token ids or error, seconds)."""
    start = time.perf_counter()
    if not body.get("stream"):
        r = await client.post(f"{base}/chat/completions", json=body)
        data = r.json()
        if r.status_code != 200:
            return r.status_code, data["error"], time.perf_counter() - start
        ids = [e["id"] for e in data["choices"][0]["logprobs"]["content"]]
        return 200, ids, time.perf_counter() - start
    ids = []
    async with client.stream("POST", f"{base}/chat/completions", json=body) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                ids += [
                    e["id"] for e in (choice.get("logprobs") or {}).get("content", [])
                ]
            if leave and ids:
                return "left", ids, time.perf_counter() - start  # closes the connection
    return r.status_code, ids, time.perf_counter() - start


async def _burst(base: str, bodies: list[tuple[str, dict]]):
    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        start = time.perf_counter()
        results = await asyncio.gather(
            *(_ask(client, base, b, leave=(kind == "leave")) for kind, b in bodies)
        )
        return results, time.perf_counter() - start


@pytest.fixture(scope="module")
def heads(edge0_qwen, tmp_path_factory):
    return perturbed_heads(edge0_qwen, tmp_path_factory.mktemp("heads"))[0]


def test_32_concurrent_clients(edge0_qwen, heads, tmp_path):
    options = EngineOptions(mode="prerouted", prerouter_path=str(heads))
    proc, port = start_serve(
        edge0_qwen,
        "--mode",
        "prerouted",
        "--prerouter",
        str(heads),
        "--max-batch",
        "8",
        "--served-model-name",
        NAME,
        log=tmp_path / "serve.log",
    )
    base = f"http://127.0.0.1:{port}/v1"
    try:
        engine = Engine.load(edge0_qwen, options)
        eos = set(engine.tokenizer.eos_token_ids)

        def solo(body: dict, max_tokens: int | None = None) -> list[int]:
            ids = chat_ids(engine.tokenizer, body["messages"], TEMPLATE)
            sampling = {k: body[k] for k in ("temperature", "top_p") if k in body}
            out = engine.generate(
                ids,
                max_tokens or body["max_tokens"],
                seed=row_seed(body.get("seed", 0), ids),
                **sampling,
            ).tokens
            return [t for t in out if t not in eos]

        normal = [_normal(i) for i in range(20)]
        # Leavers: prompts whose rows run on for 64 tokens, so each leaves mid-decode (the
        # first six such; candidates are run alone only until six are found).
        candidates = (
            dict(_normal(i), max_tokens=64, stream=True) for i in range(40, 80)
        )
        leavers = list(islice((b for b in candidates if len(solo(b)) == 64), 6))
        assert len(leavers) == 6
        bad = [
            {**dict(model=NAME, messages=_messages(0)), **extra}
            for extra, _ in MALFORMED
        ]
        bodies = (
            [("normal", b) for b in normal]
            + [("leave", b) for b in leavers]
            + [("bad", b) for b in bad]
        )
        order = list(range(len(bodies)))
        order = order[::3] + order[1::3] + order[2::3]  # kinds interleaved
        bodies = [bodies[k] for k in order]
        assert len(bodies) == 32
        results, wall = asyncio.run(_burst(base, bodies))
        got = dict(zip(order, results))

        for k, body in enumerate(normal):
            status, ids, _ = got[k]
            assert status == 200 and ids == solo(body), f"request {k}"
        for k, (extra, field) in enumerate(MALFORMED):
            status, error, _ = got[len(normal) + len(leavers) + k]
            assert 400 <= status < 500 and error["param"] == field, (extra, error)
        for k in range(len(leavers)):
            status, ids, _ = got[len(normal) + k]
            assert status == "left" and ids == solo(leavers[k])[: len(ids)]

        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).json()
            if health["rows"] == 0 and health["cancelled"] == len(leavers):
                break
            time.sleep(0.1)
        assert health["status"] == "ok" and health["rows"] == health["waiting"] == 0
        assert health["cancelled"] == len(leavers) and health["served"] == len(normal)
        after = asyncio.run(_burst(base, [("normal", normal[1])]))[0][0]
        assert after[:2] == (200, solo(normal[1]))  # still serving

        latencies = [got[k][2] for k in range(len(normal))]
        tokens = sum(len(got[k][1]) for k in range(len(normal) + len(leavers)))
        print(
            f"\n32 clients: {len(normal)} answered, {len(leavers)} left mid-stream, "
            f"{len(bad)} malformed (4xx); latency p50 {statistics.median(latencies):.2f} s, "
            f"max {max(latencies):.2f} s; {tokens} tokens in {wall:.2f} s = "
            f"{tokens / wall:.1f} tok/s aggregate (tiny model, shared CPU)"
        )
        engine.close()
    finally:
        stop(proc)
