"""Expert-file faults that happen while a decode runs, in every mode that reads experts.

The fault is injected from inside the store's read path after a few reads, so it lands
mid-decode deterministically (staged prefetches and batched unions included), never
between two generate calls only.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
from bad_inputs import copy_model
from perturbed_heads import perturbed_heads

from edge0_eval.engine.engine import Engine
from edge0_eval.engine.options import EngineOptions
from edge0_eval.engine.store import SETTLE_NS, ExpertStore
from edge0_eval.errors import CheckpointError
from edge0_eval.formats.layout import EXPERTS_NAME

PROMPTS = [[5, 6, 7, 8, 9], [9, 10, 11], [3, 1, 4, 1, 5, 9]]


def _truncate(path):
    os.truncate(path, 0)


def _overwrite(path):
    size = path.stat().st_size
    with open(path, "r+b") as f:  # in place: same inode, same size
        f.write(b"\x5a" * size)


def _inject_after(store, n_reads: int, fault, path) -> threading.Event:
    """Run `fault(path)` once, just before the store's n-th read from now."""
    done, lock, count = threading.Event(), threading.Lock(), [0]
    original = store.read

    def read(layer, expert):
        with lock:
            count[0] += 1
            if count[0] == n_reads and not done.is_set():
                fault(path)
                done.set()
        return original(layer, expert)

    store.read = read
    return done


@pytest.fixture(scope="module")
def heads(edge0_qwen, tmp_path_factory):
    path, _ = perturbed_heads(edge0_qwen, tmp_path_factory.mktemp("heads"))
    return path


@pytest.mark.parametrize(
    "fault", [_truncate, _overwrite], ids=["truncated", "overwritten"]
)
@pytest.mark.parametrize(
    "mode, batch",
    [("reactive", 1), ("prerouted", 1), ("reactive", 3), ("prerouted", 3)],
)
def test_fault_mid_decode_stops_with_clear_error(
    edge0_qwen, heads, tmp_path, mode, batch, fault
):
    model = copy_model(edge0_qwen, tmp_path / "m")
    options = dict(mode=mode, slots_per_layer=4)
    if mode == "prerouted":
        options["prerouter_path"] = str(heads)
    engine = Engine.load(model, EngineOptions(**options))
    try:
        # A clean decode first: its bundles are verified (and, settled, trusted) before the fault.
        os.utime(model / EXPERTS_NAME, ns=(time.time_ns() - 10 * SETTLE_NS,) * 2)
        engine.generate(PROMPTS[0], max_tokens=4, stop_token_ids=set())
        injected = _inject_after(engine.store, 6, fault, model / EXPERTS_NAME)
        with pytest.raises(CheckpointError) as err:
            if batch == 1:
                engine.generate(PROMPTS[1], max_tokens=64, stop_token_ids=set())
            else:
                engine.generate_batch(
                    PROMPTS[:batch], max_tokens=64, stop_token_ids=set()
                )
        assert injected.is_set()
        assert str(model / EXPERTS_NAME) in str(err.value)
        assert ("ended early" if fault is _truncate else "checksum mismatch") in str(
            err.value
        )
    finally:
        engine.close()


def test_verdicts_kept_only_once_the_file_is_settled(edge0_qwen, tmp_path):
    """A file modified moments ago may still be mid-write: each read of it is checksummed."""
    model = copy_model(edge0_qwen, tmp_path / "m")
    path = model / EXPERTS_NAME
    os.utime(path)  # just written
    store = ExpertStore(model)
    try:
        layer = store.index.moe_layers[0]
        for _ in range(3):
            store.read(layer, 0)
        assert store.stats.crc_bundles == 3
        os.utime(path, ns=(time.time_ns() - 10 * SETTLE_NS,) * 2)  # long quiet
        store.reset_stats()
        for _ in range(3):
            store.read(layer, 0)
        assert store.stats.crc_bundles == 1 and store.stats.reads == 3
    finally:
        store.close()
