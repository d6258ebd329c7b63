"""Expert store: positioned reads of expert bundles from `experts.bin` on a small I/O pool, each
read followed by a check that the file is still the one opened (`FileGuard`).

Why positioned reads (`os.preadv`) rather than mmap: a read copies the bundle once into a buffer
we own, so the page cache can be evicted (`posix_fadvise DONTNEED`) for honest cold runs and the
bytes are counted exactly; `edge0-eval bench` measures both against each other.

A file the engine keeps reading while it serves must stay the file it opened.

The expert file is read for as long as an engine lives (this store), and the index's
checksums, loaded once, describe it as it was opened. A write into it in place (the same inode:
a convert run again into the folder, a copy over it, a restore) changes what later reads return,
and a bundle whose checksum passed before the write would be trusted afterwards, or never
checked with --no-verify-crc. `FileGuard` takes the open file's stamp (size, mtime, ctime) when
the store opens it and compares it after every read, one `fstat` of the open descriptor (cost:
`edge0-eval bench --compare-file-guard`). A write moves mtime when it starts, so a read that saw
any written byte is followed by a check that sees the new stamp; ctime also moves when a writer
sets mtime back, and when the file is deleted or another is renamed over its path (the folder
then holds another model than the one served). Any change stops the engine with one error naming
the file; a permission change stops it too, a false alarm that costs a restart, never a score.

Adapters, heads, draft vocabularies and resident weights need no guard: each is read whole and
evaluated when the engine loads (formats/adapters.py, heads_file.py, draft_file.py,
Engine.load), and never again.
"""

from __future__ import annotations

import heapq
import itertools
import math
import os
import threading
import time
from concurrent.futures import CancelledError
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from edge0_eval.errors import CheckpointError, ConfigError
from edge0_eval.formats.layout import INDEX_NAME, ExpertIndex, crc32


# -- the file guard ----------------------------------------------------------------------
class FileGuard:
    """The stamp of an open file, taken when it was opened, checked after each read."""

    def __init__(self, fd: int, path: str | Path, fix: str):
        self._fd, self.path, self.fix = fd, Path(path), fix
        self.stamp = self._now()

    def _now(self) -> tuple[int, int, int]:
        st = os.fstat(self._fd)
        return (st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    @property
    def age_ns(self) -> int:
        """Nanoseconds since the file was last written, as stamped when it was opened."""
        return time.time_ns() - self.stamp[1]

    def check(self) -> None:
        """Raise CheckpointError if the file changed since it was opened."""
        now = self._now()
        if now != self.stamp:
            raise CheckpointError(
                f"{self.path} changed while the engine was reading it "
                f"({self._what(now)}): what it holds now is not what the index "
                f"describes, so the run stops and records nothing; {self.fix}"
            )

    def _what(self, now: tuple[int, int, int]) -> str:
        (size0, mtime0, _), (size, mtime, _) = self.stamp, now
        if size != size0:
            return f"size {size0} -> {size} bytes"
        if mtime != mtime0:
            return f"written in place, mtime moved {(mtime - mtime0) / 1e9:+.3f} s"
        return (
            "ctime moved: deleted or replaced by another file, its mtime set back "
            "after a write, or its permissions changed"
        )


# -- reads -------------------------------------------------------------------------------
# Queue priorities: DEMAND (a layer is blocked on the read) first, then prefetches by the position
# of their layer in the forward (PREFETCH + position): the earliest-needed read goes first even
# when it is queued last (a draft hedge's sets, then the routed sets' misses; a wrap head's first
# MoE layer, planned with the others).
DEMAND, PREFETCH = 0, 1
_STOP = math.inf
# A file modified this recently may still be mid-write: a write updates mtime when it starts, so
# a bundle read (and found correct) during it can be overwritten afterwards without the stamp
# changing again. Verdicts are kept only for files quiet for this long.
SETTLE_NS = 2_000_000_000


_QUEUED, _RUNNING, _DONE, _CANCELLED = range(4)


class _Group(threading.Condition):
    """The condition of tasks queued together, and how many of them are not done yet. It
    wakes its waiters when the last one is done, or at each task while someone waits for
    tasks one by one (`watchers`): a thread waiting for a whole layer's reads is woken once,
    not once per read (each wake-up costs the waiting thread CPU time)."""

    def __init__(self, size: int):
        super().__init__()
        self.size = self.remaining = size
        self.watchers = 0

    def task_done(self) -> None:
        """One task is done (finished or cancelled); called holding the condition."""
        self.remaining -= 1
        if self.remaining == 0 or self.watchers:
            self.notify_all()

    def watch(self, predicate, timeout: float | None = None) -> bool:
        """`wait_for(predicate)`, woken at every task meanwhile (for a predicate on some of
        the tasks); called holding the condition."""
        self.watchers += 1
        try:
            return self.wait_for(predicate, timeout)
        finally:
            self.watchers -= 1


class QueuedTask:
    """A queued task's handle: as much of a Future as the engine uses (cancel, cancelled,
    running, done, result), lighter. The tasks queued together share one condition, so
    queueing a layer's reads costs a small object per read, not a Future's lock and
    condition each."""

    __slots__ = ("_group", "_state", "_value", "_error")

    def __init__(self, group: _Group):
        self._group, self._state, self._value, self._error = group, _QUEUED, None, None

    def cancel(self) -> bool:
        """Cancel the task if no I/O thread has taken it; True when it is cancelled."""
        with self._group:
            if self._state == _QUEUED:
                self._state = _CANCELLED
                self._group.task_done()
            return self._state == _CANCELLED

    def cancelled(self) -> bool:
        return self._state == _CANCELLED

    def running(self) -> bool:
        return self._state == _RUNNING

    def done(self) -> bool:
        return self._state in (_DONE, _CANCELLED)

    def result(self, timeout: float | None = None):
        """The task's result (its exception raised); waits for it to finish."""
        with self._group:
            if not self._group.watch(lambda: self._state >= _DONE, timeout):
                raise TimeoutError("the read did not finish in time")
        if self._state == _CANCELLED:
            raise CancelledError()
        if self._error is not None:
            raise self._error
        return self._value

    def _start(self) -> bool:
        with self._group:
            if self._state != _QUEUED:
                return False
            self._state = _RUNNING
            return True

    def _finish(self, value, error: BaseException | None) -> None:
        with self._group:
            self._value, self._error, self._state = value, error, _DONE
            self._group.task_done()


def results(tasks: list[QueuedTask]) -> list:
    """`[t.result() for t in tasks]`, waiting once per group of tasks queued together
    (`submit_many`) rather than taking each task's lock in turn: a layer's staged reads
    are usually done when the layer needs them, and then this is one pass over them.
    Waiting for a whole group is woken once, by its last task."""
    for t in tasks:
        if t._state < _DONE:  # unfinished: wait for its group's tasks among `tasks`
            group = t._group
            mine = [u for u in tasks if u._group is group]
            with group:
                if len(mine) == group.size:
                    group.wait_for(lambda: group.remaining == 0)
                else:
                    group.watch(lambda: all(u._state >= _DONE for u in mine))
    out = []
    for t in tasks:
        # _finish sets the value before the state, so a finished task's value is there.
        if t._state == _CANCELLED:
            raise CancelledError()
        if t._error is not None:
            raise t._error
        out.append(t._value)
    return out


class _PriorityPool:
    """A few I/O threads serving a priority queue (FIFO within a priority).

    A stdlib ThreadPoolExecutor is FIFO: a layer blocked on its own reads would wait behind every
    prefetch queued for later layers, which is exactly the wait prefetching exists to remove.
    A layer's reads are queued at once (`submit_many`): one lock and one wake-up for them all,
    so the thread staging them is not handed over to the I/O threads read by read.
    """

    def __init__(self, workers: int):
        self._heap: list = []
        self._ready = threading.Condition()
        self._order = itertools.count()
        self._threads = [
            threading.Thread(target=self._work, name=f"edge0-io-{i}", daemon=True)
            for i in range(workers)
        ]
        for t in self._threads:
            t.start()

    def submit_many(self, tasks: list[tuple]) -> list[QueuedTask]:
        """Queue (priority, fn, args) tasks at once; their handles in that order."""
        group = _Group(len(tasks))
        handles = [QueuedTask(group) for _ in tasks]
        with self._ready:
            for handle, (priority, fn, args) in zip(handles, tasks):
                heapq.heappush(
                    self._heap, (priority, next(self._order), handle, fn, args)
                )
            self._ready.notify(len(tasks))
        return handles

    def _work(self) -> None:
        while True:
            with self._ready:
                while not self._heap:
                    self._ready.wait()
                _, _, handle, fn, args = heapq.heappop(self._heap)
            if handle is None:
                return
            if not handle._start():
                continue  # cancelled while queued
            try:
                value, error = fn(*args), None
            except BaseException as exc:
                value, error = None, exc
            handle._finish(value, error)

    def shutdown(self) -> None:
        with self._ready:
            for _ in self._threads:
                heapq.heappush(self._heap, (_STOP, next(self._order), None, None, None))
            self._ready.notify_all()
        for t in self._threads:
            t.join()


@dataclass
class StoreStats:
    reads: int = 0
    bytes_read: int = 0
    read_seconds: float = 0.0  # time spent inside read calls (summed over I/O threads)
    throttle_seconds: float = 0.0  # time added by the storage emulation
    crc_bundles: int = 0  # bundles checksummed (each once per store)
    crc_seconds: float = 0.0  # time spent in those checksums (summed over I/O threads)

    def as_dict(self) -> dict:
        return asdict(self)


class _Throttle:
    """Caps aggregate read bandwidth to emulate slower storage (a shared, serial device)."""

    def __init__(self, mbps: float):
        if not (isinstance(mbps, (int, float)) and math.isfinite(mbps) and mbps > 0):
            raise ConfigError(
                f"io_throttle_mbps {mbps!r}: the storage emulation needs a "
                f"positive, finite MB/s (--io-throttle-mbps)"
            )
        self.bytes_per_s = mbps * 1e6
        self._lock = threading.Lock()
        self._free_at = 0.0

    def wait_for(self, nbytes: int, read_started: float) -> float:
        with self._lock:
            start = max(read_started, self._free_at)
            self._free_at = start + nbytes / self.bytes_per_s
            done_at = self._free_at
        delay = done_at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
            return delay
        return 0.0


class ExpertStore:
    """Reads (layer, expert) bundles. Thread-safe; returns numpy uint8 buffers of the layer's
    `bundle_stride`."""

    def __init__(
        self,
        directory: str | Path,
        index: ExpertIndex | None = None,
        *,
        io_workers: int = 4,
        io_throttle_mbps: float | None = None,
        verify_crc: bool = True,
    ):
        if not (isinstance(io_workers, int) and io_workers >= 1):
            raise ConfigError(
                f"io_workers {io_workers!r}: at least one I/O thread is needed "
                f"(--io-workers)"
            )
        throttle = _Throttle(io_throttle_mbps) if io_throttle_mbps is not None else None
        self._fd = -1
        self.directory = Path(directory)
        self.index = index or ExpertIndex.load(self.directory)
        self.path = self.directory / self.index.file
        if verify_crc and not self.index.crc32:
            raise CheckpointError(
                f"{self.directory / INDEX_NAME} records no crc32 checksums, so corrupt expert "
                f"data could not be detected; re-run `edge0-eval convert`, or opt out with "
                f"--no-verify-crc (EngineOptions(verify_crc=False))"
            )
        try:
            self._fd = os.open(self.path, os.O_RDONLY)
        except OSError as exc:
            raise CheckpointError(f"cannot open {self.path}: {exc.strerror}") from None
        self.verify_crc = verify_crc
        # Every read is followed by a check that the file is still the one opened (FileGuard);
        # `bench --compare-file-guard` turns it off in its comparison arm, to state its cost.
        self._guard = FileGuard(
            self._fd,
            self.path,
            "stop whatever writes to it and start again (re-run `edge0-eval convert` "
            "if the file was damaged)",
        )
        self.file_guard = True
        # Each bundle is checked the first time this store reads it, then trusted while the file
        # is settled (SETTLE_NS): the guard stops every read once it has changed.
        self._verified = np.zeros(
            (len(self.index.moe_layers), self.index.num_experts), bool
        )
        self.throttle_mbps = io_throttle_mbps
        self._throttle = throttle
        self._queue = _PriorityPool(io_workers)
        self.io_workers = io_workers
        self._lock = threading.Lock()
        self.stats = StoreStats()
        # Per MoE layer: (position, first bundle's byte offset, bundle stride), read once from
        # the index so that a read does no lookups through it.
        self._extents = {
            layer: (pos, self.index.bundle_offset(layer, 0), layout.bundle_stride)
            for pos, layer in enumerate(self.index.moe_layers)
            for layout in [self.index.layout(layer)]
        }

    # -- reads ------------------------------------------------------------------------------
    def _extent(self, layer: int) -> tuple[int, int, int]:
        try:
            return self._extents[layer]
        except KeyError:
            raise KeyError(
                f"layer {layer} has no routed experts in this index"
            ) from None

    def read(self, layer: int, expert: int) -> np.ndarray:
        """Blocking positioned read of one bundle (checked) into a new uint8 buffer."""
        buf = np.empty(self._extent(layer)[2], dtype=np.uint8)
        self.read_into(layer, expert, [buf])
        return buf

    def read_into(self, layer: int, expert: int, pieces: list) -> None:
        """Blocking positioned read of one bundle (checked) scattered over `pieces`: writable
        contiguous buffers, in order, whose sizes add up to the layer's `bundle_stride`
        (one `preadv`: a bundle's tensors can land in the arrays that keep them)."""
        _, first, stride = self._extent(layer)
        if not 0 <= expert < self.index.num_experts:
            raise IndexError(
                f"expert {expert} out of range 0..{self.index.num_experts - 1}"
            )
        offset = first + expert * stride
        views = [memoryview(p).cast("B") for p in pieces]
        if sum(v.nbytes for v in views) != stride:
            raise ValueError(
                f"buffers of {sum(v.nbytes for v in views)} bytes for a bundle of {stride}"
            )
        started = time.perf_counter()
        left, done = list(views), 0
        while done < stride:
            try:
                n = os.preadv(self._fd, left, offset + done)
            except OSError as exc:
                raise CheckpointError(
                    f"read error in {self.path} at layer {layer} expert {expert}: {exc}"
                ) from None
            if n == 0:
                if self.file_guard:
                    self._guard.check()  # truncated under us: say so
                raise CheckpointError(
                    f"{self.path} ended early at layer {layer} expert {expert} "
                    f"(offset {offset + done}); the file is truncated, re-run convert"
                )
            done += n
            while n and n >= left[0].nbytes:  # a short read: go on where it stopped
                n -= left.pop(0).nbytes
            if n:
                left[0] = left[0][n:]
        if self.file_guard:
            self._guard.check()
        elapsed = time.perf_counter() - started
        delay = self._throttle.wait_for(stride, started) if self._throttle else 0.0
        if self.verify_crc:
            self._verify(layer, expert, views)
        with self._lock:
            self.stats.reads += 1
            self.stats.bytes_read += stride
            self.stats.read_seconds += elapsed
            self.stats.throttle_seconds += delay

    def _verify(self, layer: int, expert: int, views: list[memoryview]) -> None:
        pos = self._extents[layer][0]
        if self._verified[pos, expert]:
            return
        started = time.perf_counter()
        crc = 0
        for view in views:
            crc = crc32(view, crc)
        with self._lock:
            self.stats.crc_bundles += 1
            self.stats.crc_seconds += time.perf_counter() - started
        if crc != self.index.crc32[pos][expert]:
            raise CheckpointError(
                f"{self.path}: checksum mismatch for layer {layer} expert {expert}; the file is "
                f"corrupt, was overwritten, or does not belong to {INDEX_NAME}; re-run "
                f"`edge0-eval convert`"
            )
        if self._guard.age_ns > SETTLE_NS:
            self._verified[pos, expert] = True

    def submit(
        self, layer: int, expert: int, priority: int | None = None, sink=None
    ) -> QueuedTask:
        """Queue a read; DEMAND reads (a layer is blocked on them) overtake queued prefetches,
        and prefetches (priority None) are served in the order their layers run.

        `sink(m)`, when given, runs on the I/O thread and says where a task's m bundles land:
        it returns (per bundle the buffers it is read into, as `read_into` takes them, and a
        function whose result is the task's, called once they are all read): callers read
        straight into the arrays that keep the bundles and do whatever else a bundle needs
        there, off the thread that builds the graph (engine/experts.py `_sink`).
        Without a sink the task's result is the bundles' bytes (uint8 [m, bundle_stride]).
        """
        return self.submit_many(layer, [expert], priority, sink)[0]

    def submit_many(
        self,
        layer: int,
        experts: list[int],
        priority: int | None = None,
        sink=None,
        chunks: list[int] | None = None,
    ) -> list[QueuedTask]:
        """`submit` for several experts of one layer, queued at once (one wake-up). chunks:
        how many of `experts`, in order, each task reads, one after another (None: one
        each); one handle per task."""
        if priority is None:
            priority = PREFETCH + self._extent(layer)[0]
        tasks, start = [], 0
        for n in chunks or [1] * len(experts):
            part = experts[start : start + n]
            tasks.append((priority, self._read_rows, (layer, part, sink)))
            start += n
        if start != len(experts):
            raise ValueError(f"chunks {chunks} do not cover {len(experts)} experts")
        return self._queue.submit_many(tasks)

    def _read_rows(self, layer: int, experts: list[int], sink):
        if sink is None:
            rows = np.empty((len(experts), self._extent(layer)[2]), np.uint8)
            targets, finish = [[row] for row in rows], lambda: rows
        else:
            targets, finish = sink(len(experts))
        for pieces, expert in zip(targets, experts):
            self.read_into(layer, expert, pieces)
        return finish()

    def read_many(
        self, pairs: list[tuple[int, int]], sink=None, chunks: list[int] | None = None
    ) -> list:
        """Read several bundles concurrently (queue depth = io_workers) ahead of prefetches;
        chunks: as `submit_many`'s, over `pairs` (a chunk holds one layer's bundles)."""
        chunks = chunks or [1] * len(pairs)
        futures, start = [], 0
        for layer, group in itertools.groupby(pairs, key=lambda pair: pair[0]):
            experts = [e for _, e in group]
            sizes, end = [], start + len(experts)
            while start < end:
                sizes.append(chunks[len(futures) + len(sizes)])
                start += sizes[-1]
            if start != end:
                raise ValueError(f"a chunk of {chunks} holds more than layer {layer}")
            futures += self.submit_many(layer, experts, DEMAND, sink, sizes)
        return results(futures)

    # -- cache control ----------------------------------------------------------------------
    def evict_page_cache(self) -> bool:
        """Drop the expert file from the OS page cache so the next reads are cold."""
        if not hasattr(os, "posix_fadvise"):
            return False  # macOS: no fadvise; callers report the cache state as unknown
        os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return True

    def reset_stats(self) -> None:
        with self._lock:
            self.stats = StoreStats()

    def close(self) -> None:
        if getattr(self, "_queue", None) is not None:
            self._queue.shutdown()
            self._queue = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self):
        try:
            if (
                getattr(self, "_fd", -1) >= 0
                or getattr(self, "_queue", None) is not None
            ):
                self.close()
        except Exception:
            pass
