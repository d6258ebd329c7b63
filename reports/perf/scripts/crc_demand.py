"""Harness of reports/perf/2026-12-08-crc.md's figures without decode: crc32 alone on one bundle,
and a layer-0 demand read of 4 random experts by each checksum arm (warm page cache, real disk).

Imports the engine's internals of 3b4bf80 and later (the store's `crc32`, the switch's
`_chunks`, `_sink` and `_write_slots`). `pip install isal` for its row of the first table.
argv: model heads
"""

import os
import random
import statistics
import sys
import threading
import time
import timeit
import zlib

import mlx.core as mx

import edge0_eval.engine.experts as experts
import edge0_eval.engine.store as store
from edge0_eval import Engine, EngineOptions
from edge0_eval.formats.layout import crc32

functions = {"zlib": zlib.crc32, "zlib-ng": crc32}
try:
    from isal import isal_zlib

    functions["isal"] = isal_zlib.crc32
except ImportError:
    pass


def counted(seconds=0.5) -> int:
    """Loops of pure Python this thread runs in `seconds`: its share of the GIL."""
    n, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        n += 1
    return n


def pace_beside(f) -> float:
    """This thread's pace while another checksums 64 MiB buffers, against its pace alone."""
    data, stop, alone = os.urandom(64 << 20), threading.Event(), counted()
    worker = threading.Thread(target=lambda: [f(data) for _ in iter(stop.is_set, True)])
    worker.start()
    beside = counted()
    stop.set()
    worker.join()
    return beside / alone


bundle = os.urandom(int(1.69 * 2**20))
for name, f in functions.items():
    assert f(bundle) == zlib.crc32(bundle)
    best = min(timeit.repeat(lambda: f(bundle), number=50, repeat=5)) / 50
    print(
        f"{name}: {1000 * best:.3f} ms a bundle, {len(bundle) / best / 1e9:.1f} GB/s; "
        f"a Python thread beside it: {pace_beside(f):.2f} of its pace alone"
    )

engine = Engine.load(
    sys.argv[1],
    EngineOptions(
        mode="prerouted",
        experts_per_token=4,
        slots_per_layer=8,
        prerouter_path=sys.argv[2],
    ),
)
switch, s = engine.blocks[0].switch_mlp, engine.store
with open(s.path, "rb") as f:  # warm: the whole expert file in the page cache
    while f.read(64 << 20):
        pass
rng = random.Random(0)
for arm in ("zlib", "zlib-ng", "off") * 2:
    s.verify_crc = arm != "off"
    store.crc32 = functions.get(arm, crc32)
    took = []
    for i in range(60):
        s._verified[:] = False
        _, loads = switch._io.slots.assign(rng.sample(range(256), 4))
        loads, sizes = switch._chunks(loads)
        started = time.perf_counter()
        parts = s.read_many([(0, e) for e, _ in loads], switch._sink, sizes)
        if i >= 10:
            took.append(1000 * (time.perf_counter() - started))
        switch._write_slots(loads, zip(parts, experts._rows(loads, sizes)))
        mx.eval(switch.glu.parameters())
    print(f"{arm}: read_many of 4 bundles, median {statistics.median(took):.2f} ms")
engine.close()
