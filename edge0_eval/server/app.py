"""The HTTP side (aiohttp): OpenAI's routes, JSON and server-sent events, errors as OpenAI's
error objects. It only parses, queues (`Worker.submit`) and relays the worker's events; the
engine never runs on the event loop.

  POST /v1/chat/completions, /v1/completions   stream or not; the answer's engine stats in
                                                the extension field `edge0` (the last chunk's
                                                when streaming)
  GET  /v1/models                               the one served model
  GET  /health                                  {"status": "ok", rows, waiting, counts}

Every failure is a JSON error object: a bad request 400 naming the field (`param`), an unknown
model 404, a missing key 401, a too-large body 413, an engine fault 500 (when a stream has
begun: an `error` event, and no `[DONE]`), a stopped engine thread 503. A client that
disconnects cancels its row.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid

from aiohttp import web

from edge0_eval.server.requests import RequestError, RequestSpec, parse_request
from edge0_eval.server.worker import Finished, Job, Worker, stopped_error

log = logging.getLogger("edge0_eval.server")
MAX_BODY = 64 * 2**20  # a long prompt as text is a few MB at most
WORKER = web.AppKey("worker", Worker)
# A JSON string (escapes included) or a bracket: enough to follow nesting depth. An unterminated
# string runs to the end: one pass (a scan restarted at each of its quotes was quadratic).
JSON_NESTING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"?|[\[\]{}]')
SETTINGS = web.AppKey("settings", dict)


def _error(exc: RequestError) -> web.Response:
    return web.json_response(exc.body(), status=exc.status)


@web.middleware
async def errors(request: web.Request, handler):
    """Whatever goes wrong becomes an OpenAI error object, never a dropped connection."""
    try:
        return await handler(request)
    except RequestError as exc:
        return _error(exc)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        kind = "invalid_request_error" if exc.status < 500 else "server_error"
        return _error(
            RequestError(
                f"{request.method} {request.path}: {exc.reason}",
                status=exc.status,
                kind=kind,
            )
        )
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - answered, and logged with its traceback
        log.exception("unexpected error")
        return _error(
            RequestError(
                f"internal error: {type(exc).__name__}: {exc}",
                status=500,
                kind="server_error",
            )
        )


def _authorized(request: web.Request) -> None:
    key = request.app[SETTINGS]["api_key"]
    if key and request.headers.get("Authorization") != f"Bearer {key}":
        raise RequestError(
            "a valid API key is required (Authorization: Bearer KEY)",
            status=401,
            code="invalid_api_key",
        )


async def health(request: web.Request) -> web.Response:
    worker = request.app[WORKER]
    status = "ok" if worker.is_alive() else "stopped"
    return web.json_response(
        {"status": status, "model": request.app[SETTINGS]["served"], **worker.load()},
        status=200 if status == "ok" else 503,
    )


async def models(request: web.Request) -> web.Response:
    _authorized(request)
    settings = request.app[SETTINGS]
    return web.json_response(
        {
            "object": "list",
            "data": [
                {
                    "id": settings["served"],
                    "object": "model",
                    "created": settings["created"],
                    "owned_by": "edge0-eval",
                }
            ],
        }
    )


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "chat")


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "completion")


async def _generate(request: web.Request, kind: str) -> web.StreamResponse:
    _authorized(request)
    worker, settings = request.app[WORKER], request.app[SETTINGS]
    if not worker.is_alive():  # nothing would ever answer the request
        raise stopped_error()
    raw = await request.read()
    try:
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise RequestError(f"the request body is not valid JSON ({exc})") from None
        spec = parse_request(
            body,
            kind,
            served=settings["served"],
            vocab=settings["vocab"],
            default_max_tokens=settings["max_tokens"],
            default_seed=settings["seed"],
            max_model_len=worker.max_model_len,
        )
    except RecursionError:  # reading it, or writing a value into an error message
        field = _deepest_field(raw)
        raise RequestError(
            f"{field or 'the request body'} nests JSON arrays or objects too "
            f"deeply (Python reads up to about 1000 levels); send flat values",
            field,
        ) from None
    loop, events = asyncio.get_running_loop(), asyncio.Queue()

    def post(event: tuple) -> None:  # called on the worker thread
        try:
            loop.call_soon_threadsafe(events.put_nowait, event)
        except RuntimeError:  # the loop has closed: nobody is listening
            pass

    job = Job(spec, post)
    answer = Answer(spec, settings["served"])
    worker.submit(job)
    ended = False
    try:
        event = await events.get()
        if event[0] == "error":
            ended = True
            raise event[1]
        if not spec.stream:
            while event[0] != "done":
                event = await events.get()
                if event[0] == "error":
                    ended = True
                    raise event[1]
            ended = True
            return web.json_response(answer.whole(event[1]))
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        try:
            ended = await _stream(response, answer, events)
        except ConnectionResetError:  # the client left mid-stream
            pass
        return response
    finally:
        if not ended:  # the client left (or the handler failed)
            worker.cancel(job)


def _deepest_field(raw: bytes) -> str | None:
    """The top-level field of a JSON object whose value nests deepest (None if not found)."""
    depth = deepest = 0
    last = key = field = None  # JSON strings, as written
    for match in JSON_NESTING.finditer(raw.decode("utf-8", "replace")):
        token = match.group()
        if token[0] == '"':
            last = token if depth == 1 else last
        elif token in "[{":
            depth += 1
            key = (
                last if depth == 2 else key
            )  # a value's opener: the key just before it
            if depth > deepest:
                deepest, field = depth, key
        else:
            depth -= 1
    try:
        return json.loads(field) if field else None
    except ValueError:
        return None


async def _stream(
    response: web.StreamResponse, answer: "Answer", events: asyncio.Queue
) -> bool:
    """Relay the worker's events as server-sent events; True once the answer has ended."""
    await _send(response, answer.chunk("", [], first=True))
    while True:
        event = await events.get()
        if event[0] == "delta":
            await _send(response, answer.chunk(event[1], event[2]))
            continue
        if event[0] == "done":
            for chunk in answer.last(event[1]):
                await _send(response, chunk)
            await response.write(b"data: [DONE]\n\n")
        else:  # an error event, and no [DONE]: not complete
            await _send(response, event[1].body())
        await response.write_eof()
        return True


async def _send(response: web.StreamResponse, data: dict) -> None:
    await response.write(f"data: {json.dumps(data)}\n\n".encode())


class Answer:
    """One request's response bodies, whole or as chunks."""

    def __init__(self, spec: RequestSpec, model: str):
        self.spec, self.model = spec, model
        self.chat = spec.kind == "chat"
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.offset = 0  # completions' text_offset

    def _base(self, obj: str) -> dict:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
        }

    def _logprobs(self, entries: list, text_start: int = 0):
        if self.spec.logprobs is None:
            return None
        if self.chat:
            return {"content": entries}
        offsets, at = [], text_start
        for e in entries:
            offsets.append(at)
            at += len(e["token"])
        return {
            "tokens": [e["token"] for e in entries],
            "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [
                {t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries
            ],
            "text_offset": offsets,
        }

    def _usage(self, done: Finished) -> dict:
        n, m = done.prompt_tokens, len(done.tokens)
        return {"prompt_tokens": n, "completion_tokens": m, "total_tokens": n + m}

    def whole(self, done: Finished) -> dict:
        choice = {
            "index": 0,
            "logprobs": self._logprobs(done.logprobs),
            "finish_reason": done.finish_reason,
        }
        if self.chat:
            choice["message"] = {"role": "assistant", "content": done.text}
        else:
            choice["text"] = done.text
        return {
            **self._base("chat.completion" if self.chat else "text_completion"),
            "choices": [choice],
            "usage": self._usage(done),
            "edge0": done.stats,
        }

    def chunk(
        self, text: str, entries: list, first: bool = False, finish: str | None = None
    ) -> dict:
        choice = {
            "index": 0,
            "logprobs": self._logprobs(entries, self.offset) if entries else None,
            "finish_reason": finish,
        }
        if self.chat:
            choice["delta"] = (
                {"role": "assistant", "content": text}
                if first
                else {"content": text}
                if text or not finish
                else {}
            )
            obj = "chat.completion.chunk"
        else:
            choice["text"] = text
            obj = "text_completion"
        self.offset += len(text)
        return {**self._base(obj), "choices": [choice]}

    def last(self, done: Finished) -> list[dict]:
        chunks = [
            {**self.chunk("", [], finish=done.finish_reason), "edge0": done.stats}
        ]
        if self.spec.include_usage:
            chunks.append(
                {
                    **self._base(
                        "chat.completion.chunk" if self.chat else "text_completion"
                    ),
                    "choices": [],
                    "usage": self._usage(done),
                }
            )
        return chunks


async def start(
    app: web.Application, host: str, port: int
) -> tuple[web.AppRunner, int]:
    """Listen on host:port (0: any free port); (the runner, to clean up, and the port)."""
    # handler_cancellation: a client that disconnects cancels its handler, hence its row.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except OSError:
        await runner.cleanup()
        raise
    return runner, runner.addresses[0][1]


def make_app(
    worker: Worker,
    *,
    served: str,
    vocab: int,
    max_tokens: int,
    seed: int,
    api_key: str | None = None,
) -> web.Application:
    app = web.Application(middlewares=[errors], client_max_size=MAX_BODY)
    app[WORKER] = worker
    app[SETTINGS] = dict(
        served=served,
        vocab=vocab,
        max_tokens=max_tokens,
        seed=seed,
        api_key=api_key,
        created=int(time.time()),
    )
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    return app
