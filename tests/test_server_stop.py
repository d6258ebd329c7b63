"""`edge0-eval serve` stops cleanly: SIGTERM drains the requests in flight (each answered
whole), answers new ones 503 `shutting_down` while it does, and exits 0; a second signal stops
at once.

A request is held in flight without racing the clock: the test sends its headers and half its
body, so the server has taken it (a shutdown waits for it) and cannot answer before the test
sends the rest, after the signal and after a later request has been refused. Then the held
request decodes while the server drains. Twenty stops in subprocesses, four at a time: a
round is about 3 s of CPU, most of it the server's imports.
"""

from __future__ import annotations

import json
import signal
import socket
from concurrent.futures import ThreadPoolExecutor

import httpx
from live_server import launch_serve, wait_healthy

STOPS = 20
AT_ONCE = 4  # rounds side by side
BODY = json.dumps(
    {"prompt": "disk expert slot", "max_tokens": 8, "temperature": 0}
).encode()


def _hold(port: int) -> socket.socket:
    """A completions request with half its body sent: in flight until the rest comes."""
    conn = socket.create_connection(("127.0.0.1", port), timeout=60)
    conn.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
        b"Content-Type: application/json\r\nConnection: close\r\n"
        + f"Content-Length: {len(BODY)}\r\n\r\n".encode()
        + BODY[: len(BODY) // 2]
    )
    for _ in range(600):  # until the server has taken it
        if httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).json()["requests"]:
            return conn
    raise AssertionError("the server never took the held request")


def _stopping(port: int) -> None:
    """Until /health says the shutdown has begun (the signal is handled)."""
    for _ in range(600):
        r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=10)
        if r.status_code == 503:
            assert r.json()["status"] == "stopping"
            return
    raise AssertionError("the server never said stopping")


def _answer(conn: socket.socket) -> dict:
    """The rest of the held body; the whole answer read back."""
    conn.sendall(BODY[len(BODY) // 2 :])
    data = b""
    while chunk := conn.recv(65536):
        data += chunk
    conn.close()
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), data[:300]
    return json.loads(body)


def _stop_once(model, tmp_path, i: int) -> None:
    proc, port = launch_serve(model, "--mode", "reactive", log=tmp_path / f"{i}.log")
    try:
        wait_healthy(port, proc, 120)
        conn = _hold(port)
        proc.send_signal(signal.SIGTERM)
        _stopping(port)
        late = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={"prompt": "x", "max_tokens": 1},
            timeout=30,
        )
        assert late.status_code == 503, late.text
        assert late.json()["error"]["code"] == "shutting_down"
        answer = _answer(conn)
        assert answer["choices"][0]["finish_reason"] in ("length", "stop")
        assert answer["usage"]["completion_tokens"] >= 1
        assert proc.wait(60) == 0, (tmp_path / f"{i}.log").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    log = (tmp_path / f"{i}.log").read_text()
    assert "terminate called" not in log and "Traceback" not in log, log


def test_sigterm_drains_the_requests_in_flight_and_exits_0(edge0_qwen, tmp_path):
    # Each round waits on the server's answers, never on the clock: rounds side by side are
    # the same rounds, sooner (a server's start is most of one).
    with ThreadPoolExecutor(max_workers=AT_ONCE) as pool:
        list(pool.map(lambda i: _stop_once(edge0_qwen, tmp_path, i), range(STOPS)))


def test_a_second_signal_stops_at_once(edge0_qwen, tmp_path):
    proc, port = launch_serve(edge0_qwen, "--mode", "reactive", log=tmp_path / "log")
    try:
        wait_healthy(port, proc, 120)
        conn = _hold(port)
        proc.send_signal(signal.SIGTERM)
        _stopping(port)
        proc.send_signal(signal.SIGTERM)  # the held request never completes
        assert proc.wait(30) == 1
        conn.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    assert "stopped at once" in (tmp_path / "log").read_text()
