"""`edge0-eval serve MODEL [engine options]`: an OpenAI-compatible server on the engine's
continuous batching.

    edge0-eval serve student --mode prerouted --port 8001          # loopback only by default
    curl localhost:8001/v1/chat/completions -d '{"model": "student", "messages": [...]}'

The engine loads once and runs on one thread that owns the batch (worker.py); the HTTP side
(app.py, aiohttp) parses and validates requests (requests.py) and relays answers. A request's
seed is the run's seed: its row draws from `row_seed(seed, prompt ids, edge0_sample)`, so an
answer equals the in-process `Edge0Model` arm's for the same prompt, settings and seed, alone
or batched with any other requests (model_wrappers/models/edge0_api_model.py is the OpenCompass
side); a request without one draws a fresh seed, so the server takes no `--seed`.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import os
import re
import signal
import sys
from pathlib import Path

from edge0_eval.arguments import value_types as ct
from edge0_eval.arguments.engine_flags import add_engine_arguments, options_from_args
from edge0_eval.errors import ConfigError, Edge0Error
from edge0_eval.server.requests import DEFAULT_MAX_MODEL_LEN

LOOPBACK = ("localhost",)
ORIGIN = re.compile(r"https?://[^/\s]+")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="converted model directory (edge0-eval convert)")
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default: loopback only; anything else "
        "should come with --api-key)",
    )
    parser.add_argument("--port", type=ct.positive_int, default=8000)
    parser.add_argument(
        "--served-model-name",
        default=None,
        help="the name requests give as `model` (default: MODEL's folder name)",
    )
    parser.add_argument(
        "--max-batch",
        type=ct.positive_int,
        default=8,
        help="requests decoded together; more wait their turn (default 8; the "
        "expert buffer holds min(experts, B x top-k) slots per layer)",
    )
    parser.add_argument(
        "--max-tokens",
        type=ct.positive_int,
        default=None,
        help="the most new tokens of a request that gives no max_tokens (default: "
        "the rest of the row, --max-model-len less the prompt, as vLLM)",
    )
    parser.add_argument(
        "--max-model-len",
        type=ct.positive_int,
        default=None,
        help="the most tokens one request may hold, prompt and max_tokens "
        "together; more is refused with a 400 (default: the model's "
        f"context, config.json's max_position_embeddings; "
        f"{DEFAULT_MAX_MODEL_LEN} if it gives none)",
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("EDGE0_API_KEY"),
        help="require `Authorization: Bearer KEY` (default: $EDGE0_API_KEY, else none)",
    )
    parser.add_argument(
        "--allowed-origins",
        type=ct.name_list,
        default=None,
        metavar="ORIGINS",
        help="CORS: the origins (comma-separated, e.g. http://localhost:3000, or *) "
        "whose web pages may call this server (default: none, CORS off)",
    )
    parser.add_argument(
        "--generation-config",
        choices=("auto", "vllm"),
        default="auto",
        help="sampling defaults of a request that gives none: auto, MODEL's "
        "generation_config.json (temperature, top_p, top_k, min_p, "
        "repetition_penalty) over OpenAI's temperature 1.0; vllm, OpenAI's alone "
        "(as vLLM's flag; default auto)",
    )
    add_engine_arguments(parser)
    # A request gives its own seed or draws a fresh one: the engine's --seed means nothing
    # here, and is refused rather than ignored (run).
    parser.set_defaults(seed=None)


def _loopback(host: str) -> bool:
    if host in LOOPBACK:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _origins(text: str | None) -> list[str]:
    """--allowed-origins as a list; each "*" or an origin as a browser sends it
    (scheme://host[:port], no path): another spelling would never match."""
    origins = [o.strip() for o in text.split(",")] if text else []
    for origin in origins:
        if origin != "*" and not ORIGIN.fullmatch(origin):
            raise ConfigError(
                f"--allowed-origins: {origin!r} is not an origin; give "
                f"scheme://host[:port] (e.g. http://localhost:3000, no path or "
                f"trailing /) or *"
            )
    return origins


def run(args: argparse.Namespace) -> int:
    # The server's imports (MLX, aiohttp) only when it runs: `edge0-eval --help` stays fast.
    from edge0_eval import Engine, EngineOptions
    from edge0_eval.evaluation.identity import model_identity
    from edge0_eval.server.app import make_app
    from edge0_eval.server.worker import Worker, model_context

    if args.port > 65535:
        raise ConfigError(f"--port must be in 1..65535, not {args.port}")
    if args.seed is not None:
        raise ConfigError(
            "serve takes no --seed: a request gives its own `seed` (the run's seed, as "
            "in a model config), or the server draws a fresh one and returns it in the "
            "answer's edge0.request_seed; drop --seed"
        )
    origins = _origins(args.allowed_origins)
    options = options_from_args(args, seed=EngineOptions().seed)
    name = args.served_model_name or Path(args.model).resolve().name
    worker = Worker(
        lambda: Engine.load(args.model, options),
        rows_at_once=args.max_batch,
        identity=model_identity(args.model, options),
        name=name,
        max_model_len=args.max_model_len,
        max_tokens=args.max_tokens,
    )
    try:
        worker.start_engine()
    except Edge0Error:
        raise
    except Exception as exc:  # e.g. no memory for the batch's expert slots: one line
        raise ConfigError(
            f"the engine could not start serving {args.model} "
            f"({type(exc).__name__}: {exc}); if memory ran out, try a smaller "
            f"--max-batch (now {args.max_batch})"
        ) from None
    try:  # the engine runs: a refusal from here stops it first
        _check_lengths(worker, args, model_context(worker.engine))
        engine = worker.engine
        vocab = int(engine.family.text_config(engine.config)["vocab_size"])
        defaults = _defaults(args.model, args.generation_config, vocab)
    except Edge0Error:
        worker.close()
        worker.join(timeout=30)
        raise
    app = make_app(
        worker,
        served=name,
        vocab=vocab,
        api_key=args.api_key,
        allowed_origins=origins,
        defaults=defaults,
    )
    if not _loopback(args.host) and not args.api_key:
        print(
            f"edge0-eval serve: warning: listening on {args.host} without --api-key: anyone "
            f"who can reach this port can use the model",
            file=sys.stderr,
        )
    line = (
        f"up to {args.max_batch} requests decoded together; a request without "
        f"sampling fields draws with "
        f"{', '.join(f'{k} {v}' for k, v in defaults.items())} "
        f"(--generation-config {args.generation_config})"
    )
    try:
        asyncio.run(_serve(app, args.host, args.port, name, line))
    finally:
        worker.close()
        worker.join(timeout=30)
    return 0


def _check_lengths(worker, args: argparse.Namespace, context: int | None) -> None:
    """--max-model-len within the model's context, --max-tokens within --max-model-len."""
    if context is not None and worker.max_model_len > context:
        # As vLLM: positions past the trained context are out of distribution for the model.
        raise ConfigError(
            f"--max-model-len {worker.max_model_len} is beyond {args.model}'s "
            f"context of {context} tokens (max_position_embeddings in its "
            f"config.json); give at most {context}"
        )
    if args.max_tokens is not None and args.max_tokens >= worker.max_model_len:
        raise ConfigError(
            f"--max-tokens {args.max_tokens} leaves no room for a prompt in "
            f"{worker.max_model_len} tokens (--max-model-len, default the model's "
            f"context); give a smaller --max-tokens"
        )


def _defaults(model: str, source: str, vocab: int) -> dict:
    """The sampling defaults (--generation-config): MODEL's generation_config.json (auto)
    over OpenAI's, as vLLM takes them."""
    from edge0_eval.formats.json_files import read_json_file
    from edge0_eval.server.requests import generation_defaults

    path = Path(model) / "generation_config.json"
    generation = None
    if source == "auto" and path.is_file():
        fix = (
            "copy it again from the source checkpoint, or give --generation-config vllm"
        )
        generation = read_json_file(path, "generation_config.json", fix)
    return generation_defaults(generation, vocab, str(path))


async def _serve(app, host: str, port: int, name: str, line: str) -> None:
    from edge0_eval.server.app import BUSY, STOPPING, start

    try:
        runner, port = await start(app, host, port)
    except OSError as exc:
        raise ConfigError(
            f"cannot listen on {host}:{port} ({exc.strerror or exc}); is another "
            f"server on that port? choose another with --port"
        ) from None
    stop = asyncio.Event()

    def signalled() -> None:
        if stop.is_set():  # a second signal: now, the answers in flight unfinished
            print("edge0-eval serve: stopped at once (a second signal)", flush=True)
            os._exit(1)
        stop.set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, signalled)
    print(f"edge0-eval serve: {name} at http://{host}:{port}/v1 ({line})", flush=True)
    await stop.wait()
    # From here /health says "stopping" and new requests get a 503 `shutting_down`, still
    # answered (a client sees why, not a refused connection), while the running ones finish.
    app[STOPPING].set()
    print(
        f"edge0-eval serve: stopping once the {app[BUSY].count} request(s) in flight "
        f"are answered (a second signal stops at once)",
        flush=True,
    )
    await app[BUSY].idle.wait()
    await runner.cleanup()
