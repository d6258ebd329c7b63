"""A bundle read scattered over buffers (`ExpertStore.read_into`, how the engine reads straight
into the arrays that keep a bundle's tensors) gives the bytes one read gives, however short
the system's reads come back, and its checksum still sees a corrupt byte; engines that read
bundles leave no thread behind."""

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from edge0_eval.engine.store import ExpertStore
from edge0_eval.errors import CheckpointError
from edge0_eval.formats.layout import EXPERTS_NAME


def _pieces(stride: int) -> list[np.ndarray]:
    """Uneven buffers covering a bundle: a byte, odd sizes, a page, the rest."""
    sizes = [1, 63, 4096, 5]
    return [np.empty(n, np.uint8) for n in sizes + [stride - sum(sizes)]]


def test_a_bundle_read_in_pieces_is_the_bundle_when_reads_come_short(
    edge0_qwen, monkeypatch
):
    store = ExpertStore(edge0_qwen)
    try:
        layer = store.index.moe_layers[-1]
        stride = store.index.layout(layer).bundle_stride
        whole = store.read(layer, 3)
        calls, preadv = [], os.preadv

        def short(fd, buffers, offset):
            """At most 1000 bytes a call, ending inside a buffer."""
            calls.append(offset)
            left, out = 1000, []
            for b in buffers:
                view = memoryview(b).cast("B")
                out.append(view[: min(left, view.nbytes)])
                left -= out[-1].nbytes
                if not left:
                    break
            return preadv(fd, out, offset)

        monkeypatch.setattr(os, "preadv", short)
        pieces = _pieces(stride)
        store.read_into(layer, 3, pieces)
        assert len(calls) >= stride // 1000  # the reads did come short
        assert np.array_equal(np.concatenate(pieces), whole)
    finally:
        store.close()


def test_pieces_that_do_not_cover_the_bundle_are_refused(edge0_qwen):
    store = ExpertStore(edge0_qwen)
    try:
        layer = store.index.moe_layers[0]
        stride = store.index.layout(layer).bundle_stride
        with pytest.raises(ValueError, match=f"a bundle of {stride}"):
            store.read_into(layer, 0, _pieces(stride)[:-1])
    finally:
        store.close()


def test_a_corrupt_byte_fails_the_checksum_of_a_read_in_pieces(edge0_qwen, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(edge0_qwen, model)
    probe = ExpertStore(model)
    layer = probe.index.moe_layers[0]
    stride = probe.index.layout(layer).bundle_stride
    at = probe.index.bundle_offset(layer, 2) + stride - 10  # in the last piece
    probe.close()
    with open(model / EXPERTS_NAME, "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0xFF]))
    store = ExpertStore(model)
    try:
        store.read_into(layer, 1, _pieces(stride))  # its neighbour is intact
        with pytest.raises(CheckpointError, match="checksum mismatch.*expert 2"):
            store.read_into(layer, 2, _pieces(stride))
    finally:
        store.close()


# Five engines loaded, decoding and closed one after another in a process of their own (no
# test runner's or other test's threads beside them); LEAK starts one thread an engine that
# never ends, the fault the count must see.
_THREADS = """
import os, sys, threading, time
from edge0_eval import Engine, EngineOptions

def run(leak):
    engine = Engine.load(
        sys.argv[1], EngineOptions(mode="reactive", no_lora=True, slots_per_layer=4)
    )
    try:
        prompt = engine.tokenizer.encode("one two three")
        engine.generate(prompt, max_tokens=3, stop_token_ids=set())
        assert engine.store.stats.reads > 0
        if leak:
            threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()
    finally:
        engine.close()

def tasks():
    # A joined thread's OS thread can outlive join() by a moment: read until it settles.
    seen = set(os.listdir("/proc/self/task"))
    for _ in range(40):
        time.sleep(0.05)
        now = set(os.listdir("/proc/self/task"))
        if now == seen:
            break
        seen = now
    return seen

run(False)  # anything made once per process
before = tasks()
for _ in range(5):
    run(sys.argv[2] == "leak")
print(len(tasks() - before))  # threads that are new and still there
"""


def _threads_left(model, leak: bool) -> int:
    out = subprocess.run(
        [sys.executable, "-c", _THREADS, str(model), "leak" if leak else "none"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(sys.platform != "linux", reason="counts threads in /proc")
def test_engines_that_read_bundles_leave_no_thread_behind(edge0_qwen):
    """Each engine's I/O threads allocate the arrays they read into; five engines leave no
    thread the process did not have after the first (one allocation stream may be made once
    for the process), and a thread left behind by each engine is seen. Threads are told
    apart by id, so one that ends meanwhile does not hide a new one."""
    assert _threads_left(edge0_qwen, leak=True) >= 5
    assert _threads_left(edge0_qwen, leak=False) <= 0
