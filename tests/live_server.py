"""An `edge0-eval serve` server in the test process (worker thread + event loop thread) or as a
real subprocess, on a loopback port."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from edge0_eval.engine.engine import Engine
from edge0_eval.server.app import make_app, start
from edge0_eval.server.worker import Worker


class LiveServer:
    """The server's app and worker on a free loopback port, in this process."""

    def __init__(
        self,
        model,
        options,
        *,
        rows_at_once: int = 4,
        name: str = "tiny",
        max_tokens: int | None = 16,
        api_key: str | None = None,
        allowed_origins: list[str] = (),
        max_model_len: int | None = None,
        defaults: dict | None = None,
    ):
        self.worker = Worker(
            lambda: Engine.load(model, options),
            rows_at_once=rows_at_once,
            identity={"weights": "test"},
            name=name,
            max_model_len=max_model_len,
            max_tokens=max_tokens,
        )
        self.worker.start_engine()
        config = self.worker.engine.family.text_config(self.worker.engine.config)
        self.app = make_app(
            self.worker,
            served=name,
            vocab=int(config["vocab_size"]),
            api_key=api_key,
            allowed_origins=allowed_origins,
            defaults=defaults,
        )
        self.loop = asyncio.new_event_loop()
        started = threading.Event()

        def serve():
            asyncio.set_event_loop(self.loop)
            self.runner, self.port = self.loop.run_until_complete(
                start(self.app, "127.0.0.1", 0)
            )
            started.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=serve, daemon=True)
        self.thread.start()
        started.wait(30)
        self.base = f"http://127.0.0.1:{self.port}/v1"

    def health(self) -> dict:
        with urllib.request.urlopen(
            f"http://127.0.0.1:{self.port}/health", timeout=10
        ) as r:
            return json.loads(r.read())

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
        self.worker.close()
        self.worker.join(30)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_serve(
    model, *args: str, port: int | None = None, log: Path | None = None
) -> tuple[subprocess.Popen, int]:
    """`edge0-eval serve MODEL ARGS --port P` as a subprocess (not yet answering)."""
    port = port or free_port()
    out = open(log, "w") if log else subprocess.DEVNULL
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "edge0_eval",
            "serve",
            str(model),
            *args,
            "--port",
            str(port),
        ],
        stdout=out,
        stderr=subprocess.STDOUT,
    )
    return proc, port


def start_serve(
    model,
    *args: str,
    port: int | None = None,
    log: Path | None = None,
    timeout: float = 120,
) -> tuple[subprocess.Popen, int]:
    """launch_serve, once /health answers."""
    proc, port = launch_serve(model, *args, port=port, log=log)
    wait_healthy(port, proc, timeout)
    return proc, port


def wait_healthy(
    port: int, proc: subprocess.Popen | None, timeout: float, path: str = "/health"
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(
                f"the server on port {port} exited with {proc.returncode}"
            )
        try:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{port}{path}", timeout=5
            ) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"no server answered on port {port} within {timeout} s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)
