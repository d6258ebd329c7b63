"""The HTTP side (aiohttp): OpenAI's routes, JSON and server-sent events, errors as OpenAI's
error objects. It only parses, queues (`Worker.submit`) and relays the worker's events; the
engine never runs on the event loop.

  POST /v1/chat/completions, /v1/completions   stream or not, n choices; each answer's
                                                engine stats in the extension field `edge0`
                                                (the response's: its first choice's; with
                                                n > 1 each choice's own too; streaming: the
                                                chunk that finishes a choice)
  GET  /v1/models                               the one served model, with max_model_len
  GET  /health                                  {"status": "ok", requests (taken, not yet
                                                answered), rows, waiting, counts};
                                                503 "stopping" once shutdown has begun

Every failure is a JSON error object: a bad request 400 naming the field (`param`), an unknown
model 404, a missing key 401, a too-large body 413, an engine fault 500 (when a stream has
begun: an `error` event, and no `[DONE]`), a stopped engine thread or a server shutting down
503. A client that disconnects cancels its rows. CORS: off unless `allowed_origins` names the
origins (or "*") whose browsers may call the API.
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
# Set when shutdown begins (serve.py): /health says so and no new request is taken, while the
# requests already running finish.
STOPPING = web.AppKey("stopping", asyncio.Event)
# A JSON string (escapes included) or a bracket: enough to follow nesting depth. An unterminated
# string runs to the end: one pass (a scan restarted at each of its quotes was quadratic).
JSON_NESTING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"?|[\[\]{}]')
SETTINGS = web.AppKey("settings", dict)


class Busy:
    """The requests being answered: a shutdown waits until none is (`idle`)."""

    def __init__(self):
        self.count, self.idle = 0, asyncio.Event()
        self.idle.set()

    def enter(self) -> None:
        self.count += 1
        self.idle.clear()

    def leave(self) -> None:
        self.count -= 1
        if not self.count:
            self.idle.set()


BUSY = web.AppKey("busy", Busy)


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


CORS_METHODS = "GET, POST, OPTIONS"


def _cors_headers(request: web.Request) -> dict:
    """The CORS headers of the response to `request`: none unless its Origin is allowed."""
    allowed = request.app[SETTINGS]["allowed_origins"]
    origin = request.headers.get("Origin")
    if origin is None or not ("*" in allowed or origin in allowed):
        return {}
    if "*" in allowed:
        return {"Access-Control-Allow-Origin": "*"}
    return {"Access-Control-Allow-Origin": origin, "Vary": "Origin"}


@web.middleware
async def cors(request: web.Request, handler):
    """CORS for the origins `allowed_origins` names ("*": any), errors included; a preflight
    (OPTIONS) from one is answered here. Off when none is named: no CORS header, and OPTIONS
    is a 405. (A stream sends its headers itself: _generate.)"""
    headers = _cors_headers(request)
    if not headers:
        return await handler(request)
    if (
        request.method == "OPTIONS"
        and "Access-Control-Request-Method" in request.headers
    ):
        asked = request.headers.get("Access-Control-Request-Headers")
        headers.update(
            {
                "Access-Control-Allow-Methods": CORS_METHODS,
                "Access-Control-Allow-Headers": asked or "Authorization, Content-Type",
                "Access-Control-Max-Age": "600",
            }
        )
        return web.Response(status=204, headers=headers)
    response = await handler(request)
    if not response.prepared:
        response.headers.update(headers)
    return response


def _authorized(request: web.Request) -> None:
    key = request.app[SETTINGS]["api_key"]
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    if key and (scheme.lower() != "bearer" or given.strip() != key):
        raise RequestError(
            "a valid API key is required (Authorization: Bearer KEY)",
            status=401,
            code="invalid_api_key",
        )


async def health(request: web.Request) -> web.Response:
    worker = request.app[WORKER]
    if request.app[STOPPING].is_set():
        status = "stopping"
    else:
        status = "ok" if worker.is_alive() else "stopped"
    return web.json_response(
        {
            "status": status,
            "model": request.app[SETTINGS]["served"],
            "requests": request.app[BUSY].count,  # taken and not yet answered
            **worker.load(),
        },
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
                    "max_model_len": request.app[WORKER].max_model_len,
                    # what a request without sampling fields draws with (an extension)
                    "sampling_defaults": settings["defaults"],
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
    if not request.app[WORKER].is_alive():  # nothing would ever answer the request
        raise stopped_error()
    if request.app[STOPPING].is_set():
        raise RequestError(
            "this server is shutting down; send the request to another host, or again "
            "once it has restarted",
            status=503,
            kind="server_error",
            code="shutting_down",
        )
    busy = request.app[BUSY]
    busy.enter()  # from here a shutdown waits for this answer
    try:
        return await _answer(request, await _spec(request, kind))
    finally:
        busy.leave()


async def _spec(request: web.Request, kind: str) -> RequestSpec:
    """The request's body, read and checked; ignored fields logged."""
    worker, settings = request.app[WORKER], request.app[SETTINGS]
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
            max_model_len=worker.max_model_len,
            defaults=settings["defaults"],
        )
    except RecursionError:  # reading it, or writing a value into an error message
        field = _deepest_field(raw)
        raise RequestError(
            f"{field or 'the request body'} nests JSON arrays or objects too "
            f"deeply (Python reads up to about 1000 levels); send flat values",
            field,
        ) from None
    if spec.ignored:  # as vLLM: read past, and said once
        log.warning("fields ignored in a request: %s", ", ".join(spec.ignored))
    return spec


async def _answer(request: web.Request, spec: RequestSpec) -> web.StreamResponse:
    """Queue the request's job and relay its events: the whole answer, or a stream."""
    worker, settings = request.app[WORKER], request.app[SETTINGS]
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
            done = []
            while len(done) < spec.choices:
                event = await events.get()
                if event[0] == "error":
                    ended = True
                    raise event[1]
                if event[0] == "done":
                    done.append(event[1])
            ended = True
            return web.json_response(answer.whole(done))
        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                **_cors_headers(request),
            }
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
            # a value's opener: the key just before it
            key = last if depth == 2 else key
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
    for index in range(answer.spec.choices):
        await _send(response, answer.chunk(index, "", [], first=True))
    done = []
    while True:
        event = await events.get()
        if event[0] == "delta":
            await _send(response, answer.chunk(*event[1:]))
            continue
        if event[0] == "done":
            done.append(event[1])
            await _send(response, answer.last(event[1]))
            if len(done) < answer.spec.choices:
                continue
            if answer.spec.include_usage:
                await _send(response, answer.usage_chunk(done))
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
        self.offsets = [0] * spec.choices  # completions' text_offset, per choice

    def _base(self, obj: str) -> dict:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
        }

    @property
    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

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
                None
                if e["top_logprobs"] is None
                # ids that decode alike share a key: the likeliest's logprob (reversed)
                else {t["token"]: t["logprob"] for t in reversed(e["top_logprobs"])}
                for e in entries
            ],
            "text_offset": offsets,
        }

    def _usage(self, done: list[Finished]) -> dict:
        """As vLLM counts: each prompt once, every token generated for every choice (a final
        stop id included)."""
        n = sum(d.prompt_tokens for d in done if d.index % self.spec.n == 0)
        m = sum(d.generated for d in done)
        return {"prompt_tokens": n, "completion_tokens": m, "total_tokens": n + m}

    def whole(self, done: list[Finished]) -> dict:
        done = sorted(done, key=lambda d: d.index)
        choices = []
        for d in done:
            choice = {
                "index": d.index,
                "logprobs": self._logprobs(d.logprobs),
                "finish_reason": d.finish_reason,
            }
            if self.chat:
                choice["message"] = {"role": "assistant", "content": d.text}
            else:
                choice["text"] = d.text
            if len(done) > 1:
                choice["edge0"] = d.stats
            choices.append(choice)
        return {
            **self._base("chat.completion" if self.chat else "text_completion"),
            "choices": choices,
            "usage": self._usage(done),
            "edge0": done[0].stats,
        }

    def chunk(
        self,
        index: int,
        text: str,
        entries: list,
        first: bool = False,
        finish: str | None = None,
    ) -> dict:
        choice = {
            "index": index,
            "logprobs": (
                self._logprobs(entries, self.offsets[index]) if entries else None
            ),
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
        else:
            choice["text"] = text
        self.offsets[index] += len(text)
        chunk = {**self._base(self._chunk_object), "choices": [choice]}
        # OpenAI: with include_usage, every chunk but the last has "usage": null
        return chunk | ({"usage": None} if self.spec.include_usage else {})

    def last(self, done: Finished) -> dict:
        """The chunk that finishes a choice, with its stats."""
        return {
            **self.chunk(done.index, "", [], finish=done.finish_reason),
            "edge0": done.stats,
        }

    def usage_chunk(self, done: list[Finished]) -> dict:
        return {
            **self._base(self._chunk_object),
            "choices": [],
            "usage": self._usage(done),
        }


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
    api_key: str | None = None,
    allowed_origins: list[str] = (),
    defaults: dict | None = None,
) -> web.Application:
    """allowed_origins: the origins browsers may call from (CORS; "*": any; none: off).
    defaults: the sampling fields of a request that gives none (requests.generation_defaults;
    None: greedy)."""
    # cors outside errors: an error object carries the CORS headers too (a browser reads it).
    app = web.Application(middlewares=[cors, errors], client_max_size=MAX_BODY)
    app[WORKER] = worker
    app[STOPPING] = asyncio.Event()
    app[BUSY] = Busy()
    app[SETTINGS] = dict(
        served=served,
        vocab=vocab,
        api_key=api_key,
        allowed_origins=list(allowed_origins),
        created=int(time.time()),
        defaults=dict(defaults or {}),
    )
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    return app
