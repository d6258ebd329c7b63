"""Scratch harness of reports/perf/2026-12-05-fewer-ops.md, as that page ran it.

It imports the engine's internals of its day: run it in a checkout of commit c1be05e
(the commit that put it in the report), not against the current package.
"""

# pin.py: the pinned arm (Linux): the stepping thread alone on CPU 0, the others on CPU 1
import os
import threading


def _set(cpus_of):
    me = threading.get_native_id()
    for t in map(int, os.listdir("/proc/self/task")):
        try:
            os.sched_setaffinity(t, cpus_of(t == me))
        except OSError:
            pass


def apply():
    _set(lambda me: {0} if me else {1})


def revert():
    _set(lambda me: {0, 1})
