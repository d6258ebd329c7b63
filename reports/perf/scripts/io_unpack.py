"""Scratch harness of reports/perf/2026-12-05-read-into-arrays.md, as that page ran it.

It imports the engine's internals of its day: run it in a checkout of commit 6f2f380
(the commit that put it in the report), not against the current package.

python io_unpack.py S35_8: the old unpacking (read into a thread buffer, numpy views,
mx.array copies) against the engine's sink, interleaved in one process (warm page cache).
"""

import sys
import threading
import time

import mlx.core as mx
import numpy as np

from edge0_eval.engine.engine import Engine
from edge0_eval.engine.options import EngineOptions
from edge0_eval.engine.store import results
from edge0_eval.formats.layout import bundle_views

e = Engine.load(
    sys.argv[1], EngineOptions(mode="reactive", slots_per_layer=32, no_lora=True)
)
sw = e.blocks[e.moe_layers[1]].switch_mlp
io, store, rng, local = sw._io, e.store, np.random.default_rng(0), threading.local()
views = [bundle_views(io.layout)[n] for n in io.layout.names]


def old(m):  # the unpacking before aed7bfb
    if not hasattr(local, "buf"):
        local.buf = np.empty((8, io.layout.bundle_stride), np.uint8)
    rows = local.buf[:m]
    return [[r] for r in rows], lambda: [
        mx.array(v.astype(np.float32) if w else v)
        for (a, b, d, s), (_, w, *_) in zip(views, io.tensors)
        for v in [rows[:, a:b].view(d).reshape(m, *s)]
    ]


def load(
    sink, tasks, size
):  # `tasks` read tasks of `size` bundles of layer 1, queued at once
    ex = rng.choice(256, tasks * size, replace=False).tolist()
    return store.submit_many(io.layer, ex, sink=sink, chunks=[size] * tasks)


def cpu():
    return time.process_time() - time.thread_time()  # the other threads' CPU


def python(sec=1.0):  # the main thread's pure-Python work in `sec`
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < sec:
        n += sum(range(1000))
    return n


arms, fig = {"old": old, "new": sw._sink}, {}
for rnd in range(10):  # I/O CPU a bundle, wall of 28 bundles in 7 tasks of 4
    for name, sink in sorted(arms.items(), reverse=rnd % 2 == 1):
        c0, t0 = cpu(), time.perf_counter()
        for _ in range(5):
            results(load(sink, 7, 4))
        fig.setdefault(name, []).append(
            ((cpu() - c0) / 140e-3, (time.perf_counter() - t0) / 5e-3)
        )
for name, v in fig.items():
    print(
        name,
        "I/O CPU ms a bundle %.2f, ms per 28 bundles %.1f" % tuple(np.median(v, 0)),
    )
idle = python()
for (
    name,
    sink,
) in arms.items():  # the main thread's Python while bundles load without pause
    stop = threading.Event()
    t = threading.Thread(
        target=lambda: [results(load(sink, 7, 4)) for _ in iter(stop.is_set, True)]
    )
    t.start()
    n = python()
    stop.set()
    t.join()
    print(name, "main-thread Python throughput %.2f of idle" % (n / idle))
x0, build = mx.ones((1, 2048)), {}
for rnd in range(
    40
):  # 6,000 ops built (not evaluated) while a solo step's 28 bundles land
    for name, sink in sorted(
        list(arms.items()) + [("none", None)], reverse=rnd % 2 == 1
    ):
        tasks, t0, x = load(sink, 28, 1) if sink else [], time.perf_counter(), x0
        for _ in range(3000):
            x = x * 1.0001 + 0.5
        build.setdefault(name, []).append(1e3 * (time.perf_counter() - t0))
        results(tasks)
d = np.subtract(build["new"], build["old"])
print(
    {k: round(float(np.median(v)), 2) for k, v in build.items()},
    "paired new-old %.2f, lower in %d/40" % (np.median(d), (d < 0).sum()),
)
e.close()
