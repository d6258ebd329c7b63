"""How far a token travels: the project files one decode token, one OpenCompass prediction and
one served chat completion pass through, measured by running them (a profiler on every thread
records each call's file).

mlx-lm's token path is generate_step -> model file -> switch_layers -> sample_utils; ours adds
the reads and the prediction heads, and is held at six files: batch.py (the loop and the row's
sampler and stop rule) -> step.py (the layers) -> families/qwen3_5_moe.py (the family's MoE
block and layer arguments) -> routing.py (the routing rule, and the prerouter's heads) ->
experts.py (the slots) -> store.py (the reads). A change that sends
each token through another module fails here; each check first proves it sees such a detour.
"""

from __future__ import annotations

import sys
import threading
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from live_server import LiveServer
from perturbed_heads import perturbed_heads

import edge0_eval
from edge0_eval.engine import batch as batch_module
from edge0_eval.engine.engine import Engine
from edge0_eval.engine.options import EngineOptions
from model_wrappers.models.edge0_model import Edge0Model

ROOT = Path(edge0_eval.__file__).resolve().parents[1]
PROJECT = (ROOT / "edge0_eval", ROOT / "model_wrappers")
PROMPT = "def add(a, b):\n    return a + b\n# The quick brown fox"
DECODE_FILES = {
    "edge0_eval/engine/batch.py",
    "edge0_eval/engine/step.py",
    "edge0_eval/engine/families/qwen3_5_moe.py",
    "edge0_eval/engine/routing.py",
    "edge0_eval/engine/experts.py",
    "edge0_eval/engine/store.py",
}


class Files:
    """The project files called into while `recording` is on, on any thread started after
    `install` (the engine's I/O threads included)."""

    def __init__(self):
        self.recording = False
        self.files: set[str] = set()

    def _profile(self, frame, event, arg):
        if not self.recording or event != "call":
            return
        path = Path(frame.f_code.co_filename)
        if any(path.is_relative_to(p) for p in PROJECT):
            self.files.add(path.relative_to(ROOT).as_posix())

    @contextmanager
    def install(self):
        sys.setprofile(self._profile)
        threading.setprofile(self._profile)
        try:
            yield self
        finally:
            sys.setprofile(None)
            threading.setprofile(None)


@pytest.fixture(scope="module")
def heads(edge0_qwen, tmp_path_factory):
    path, _ = perturbed_heads(edge0_qwen, tmp_path_factory.mktemp("heads"))
    return path


def _decode_files(engine: Engine, monkeypatch, detour=None) -> set[str]:
    """The files of the third decode step of a greedy generate (after prefill and the first
    steps, so every lazy first use is behind it)."""
    files, seen = Files(), [0]
    step = batch_module.BatchDecoder._step

    def recorded(decoder):
        seen[0] += 1
        files.recording = seen[0] == 3
        try:
            if files.recording and detour is not None:
                detour(decoder)
            return step(decoder)
        finally:
            files.recording = False

    monkeypatch.setattr(batch_module.BatchDecoder, "_step", recorded)
    prompt = engine.tokenizer.encode(PROMPT)
    with files.install():
        result = engine.generate(prompt, 6, stop_words=["never in this text"])
    assert seen[0] >= 3 and result.finish == "length"
    return files.files


@pytest.mark.parametrize("mode", ["prerouted", "reactive"])
def test_a_decode_token_passes_through_six_files(edge0_qwen, heads, mode, monkeypatch):
    options = EngineOptions(
        mode=mode, prerouter_path=str(heads) if mode == "prerouted" else None
    )
    engine = Engine.load(edge0_qwen, options)
    try:
        # The check sees a detour: the engine's own snapshot (engine.py) called in the step.
        detoured = _decode_files(engine, monkeypatch, lambda d: d.engine.snapshot())
        assert "edge0_eval/engine/engine.py" in detoured
        files = _decode_files(engine, monkeypatch)
    finally:
        engine.close()
    assert files == DECODE_FILES, sorted(files ^ DECODE_FILES)


def test_an_opencompass_prediction_passes_through_ten_files(edge0_qwen, heads):
    model = Edge0Model(
        path=str(edge0_qwen),
        mode="prerouted",
        prerouter_path=str(heads),
        no_lora=True,
        max_seq_len=256,
    )
    files = Files()
    with files.install():
        files.recording = True
        # The check sees a detour: a call into another module during the prediction.
        assert model.engine.index.slot_bytes > 0
        assert "edge0_eval/formats/layout.py" in files.files
        files.files.clear()
        (answer,) = model.generate([PROMPT], max_out_len=4)
        files.recording = False
    assert isinstance(answer, str)
    outside = files.files - DECODE_FILES
    assert outside == {
        "model_wrappers/models/chat.py",
        "model_wrappers/models/edge0_model.py",
        "edge0_eval/engine/inputs.py",
        "edge0_eval/engine/engine.py",
    }, sorted(outside)  # with the six: ten files


def test_a_served_chat_completion_passes_through_ten_files(edge0_qwen, heads):
    """The HTTP app, its event loop, the engine's thread and its I/O threads: a request from
    its arrival to its answer."""
    files = Files()
    with files.install():  # before the server's threads start: they are recorded too
        server = LiveServer(
            edge0_qwen,
            EngineOptions(mode="prerouted", prerouter_path=str(heads)),
            name="tiny",
        )
        try:
            body = {
                "model": "tiny",
                "messages": [{"role": "user", "content": PROMPT}],
                "max_tokens": 4,
                "chat_template_kwargs": {"enable_thinking": False},
            }

            def ask():
                return httpx.post(
                    f"{server.base}/chat/completions", json=body, timeout=60
                )

            assert ask().status_code == 200  # every lazy first use behind it
            files.recording = True
            # The check sees a detour: the engine's own figures (engine.py) asked for.
            assert server.worker.engine.stats()["mode"] == "prerouted"
            assert "edge0_eval/engine/engine.py" in files.files
            files.files.clear()
            answer = ask()
            files.recording = False
        finally:
            server.close()
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] >= 1
    want = DECODE_FILES | {
        "edge0_eval/server/app.py",
        "edge0_eval/server/requests.py",
        "edge0_eval/server/worker.py",
        "edge0_eval/engine/inputs.py",
    }
    assert files.files == want, sorted(files.files ^ want)  # ten files
