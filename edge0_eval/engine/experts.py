"""Streaming routed experts: `StreamingSwitchGLU` runs mlx-lm's own `SwitchGLU` over a small
buffer of slots filled from the expert file, instead of all experts. The families' MoE blocks
that use it are in engine/step.py.

Routing modes:
  resident   every expert preloaded (slots == experts): the A/B baseline, no host sync
  reactive   the true router picks; missing experts are read on demand, blocking
  prerouted  the engine supplies the expert set (predicted one token ahead) and its weights

Slot bookkeeping (`LayerSlots`): which expert sits in which slot of a layer, LRU eviction, hit
counts. It only decides; the MLX slot buffers live in the switch. Keeping that policy free of
MLX makes it easy to test and to reuse for prefetch (a stager asks the same questions).
"""

from __future__ import annotations

import functools
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchGLU

from edge0_eval.engine.counters import Counters
from edge0_eval.engine.store import ExpertStore, results
from edge0_eval.formats.layout import PROJECTIONS, ExpertIndex, bundle_views

# The most bundles one read task takes: none of them is written to a slot before the last
# is read.
RUN_BUNDLES = 8
_SLOT_AXIS = (0,)


@functools.lru_cache(maxsize=None)
def _slot_start(slot: int) -> mx.array:
    """A slot's start index as a slice update takes it (int32 [1]), made once per slot."""
    return mx.array([slot], dtype=mx.int32)


class _HostArrays:
    """Evaluated arrays for the I/O threads to read bundles into (`StreamingSwitchGLU._sink`),
    made on one CPU stream that any thread may use, one evaluation at a time. On its own
    default stream every I/O thread that evaluated once would leave an MLX scheduler thread
    behind for the life of the process (four an engine)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._stream = None  # made on first use: most commands never read a bundle

    def zeros(self, specs: list[tuple[tuple, mx.Dtype]]) -> list[mx.array]:
        with self._lock:
            if self._stream is None:
                self._stream = mx.new_thread_unsafe_stream(mx.cpu)
            arrays = [mx.zeros(s, dtype=d, stream=self._stream) for s, d in specs]
            mx.eval(arrays)  # releases the GIL
        return arrays


_HOST_ARRAYS = _HostArrays()


def evaluate(counters: Counters, *arrays, wait=mx.eval) -> None:
    """`wait(*arrays)` (mx.eval, mx.async_eval), its time counted as the engine's evaluation
    wait. Here, below every module of a decode step that waits (the batch, the step, the
    prerouter, the switch), so that a step's waits run no module outside its own path."""
    started, cpu = time.perf_counter(), time.thread_time()
    wait(*arrays)
    counters.eval_wait_seconds += time.perf_counter() - started
    counters.eval_wait_cpu_seconds += time.thread_time() - cpu


# -- slot bookkeeping --------------------------------------------------------------------
@dataclass
class PoolStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0


class LayerSlots:
    """A fixed number of slots for one layer; least recently used experts leave first."""

    def __init__(self, n_slots: int):
        if n_slots < 1:
            raise ValueError("a layer needs at least one slot")
        self.n_slots = n_slots
        # expert -> slot, LRU first
        self._slot_of: OrderedDict[int, int] = OrderedDict()
        self._free = list(range(n_slots - 1, -1, -1))
        self.stats = PoolStats()

    def slot_of(self, expert: int) -> int | None:
        return self._slot_of.get(expert)

    @property
    def resident_experts(self) -> list[int]:
        return list(self._slot_of)

    def assign(
        self, experts: list[int]
    ) -> tuple[dict[int, int], list[tuple[int, int]]]:
        """Make every expert in `experts` (distinct, at most n_slots) resident.

        Returns (expert -> slot for all of them, [(expert, slot) that must be loaded]). Experts
        already resident keep their slot (sticky), so only changed slots are written.
        """
        if len(experts) > self.n_slots:
            raise ValueError(
                f"{len(experts)} experts requested but the layer has "
                f"{self.n_slots} slots"
            )
        # Called per layer per step (a batch's union: ~30 experts): locals, and the
        # counts added once.
        slot_of, free, stats = self._slot_of, self._free, self.stats
        mapping, loads, missed = {}, [], []
        for e in experts:
            slot = slot_of.get(e)
            if slot is None:
                missed.append(e)
            else:
                slot_of.move_to_end(e)
                mapping[e] = slot
        stats.hits += len(experts) - len(missed)
        if not missed:
            return mapping, loads
        wanted, evictions = set(experts), 0
        for e in missed:
            if free:
                slot = free.pop()
            else:
                for victim in slot_of:  # least recently used first
                    if victim not in wanted:
                        break
                slot = slot_of.pop(victim)
                evictions += 1
            slot_of[e] = slot
            mapping[e] = slot
            loads.append((e, slot))
        stats.misses += len(loads)
        stats.evictions += evictions
        return mapping, loads

    def move(self, slot_of: dict[int, int]) -> None:
        """Re-seat resident experts among their own slots (a permutation; LRU order kept)."""
        if sorted(self._slot_of[e] for e in slot_of) != sorted(slot_of.values()):
            raise ValueError("move must permute the slots the experts already hold")
        for e, slot in slot_of.items():
            self._slot_of[e] = slot

    def resize(self, n_slots: int) -> list[int]:
        """Hold `n_slots` slots (batched decode holds a layer's union while it runs).

        Growing adds free slots at the end; shrinking forgets the experts in the slots that go.
        Other residents keep their slots, so the slot buffers only gain or lose rows at the
        end. Returns the experts forgotten.
        """
        if n_slots < 1:
            raise ValueError("a layer needs at least one slot")
        gone = [e for e, slot in self._slot_of.items() if slot >= n_slots]
        for e in gone:
            del self._slot_of[e]
        self._free = [s for s in self._free if s < n_slots]
        if n_slots > self.n_slots:
            self._free = list(range(n_slots - 1, self.n_slots - 1, -1)) + self._free
        self.n_slots = n_slots
        return gone

    def forget(self, expert: int) -> None:
        """Drop an expert whose load failed, so its slot is not trusted."""
        slot = self._slot_of.pop(expert, None)
        if slot is not None:
            self._free.append(slot)


def slots_for_budget(budget_mib: float, slot_bytes: int) -> int:
    """Slots per layer that fit `budget_mib` of expert buffers across all MoE layers, where a
    slot in every layer costs `slot_bytes` (layers' bundles may differ in size)."""
    return int(budget_mib * 2**20 // slot_bytes)


def _slot_linear(layout, proj: str, n_slots: int, scale_dtype) -> QuantizedSwitchLinear:
    """mlx-lm's quantized switch linear holding `n_slots` empty expert slots."""
    quant = layout.quant[proj]
    q = QuantizedSwitchLinear.__new__(QuantizedSwitchLinear)
    nn.Module.__init__(q)
    # The layer's own geometry: mlx-lm's __call__ passes these to gather_qmm.
    q.group_size, q.bits, q.mode, q.global_scale = (
        quant.group_size,
        quant.bits,
        quant.mode,
        None,
    )
    for part in quant.parts:
        t = layout.tensor(f"{proj}.{part}")
        dtype = getattr(mx, t.dtype)  # the layout's dtype names are MLX's
        if part in ("scales", "biases") and quant.mode == "affine":
            if scale_dtype is not None:
                # The compute dtype: on the CPU gather_qmm with float16 scales runs
                # several times slower than with float32 ones.
                dtype = scale_dtype
        setattr(q, part, mx.zeros((n_slots, *t.shape), dtype=dtype))
    q.freeze()
    return q


def _bundle_tensors(layout, glu) -> list[tuple]:
    """Per bundle tensor, once, in the layout's order: (name, widen on the I/O thread
    (float16 to float32 slots), its module, its part, stored as bfloat16 (numpy has
    none: raw uint16 viewed in MLX), the cast the slot still needs (None: none))."""
    tensors = []
    for name in layout.names:
        proj, part = name.split(".")
        linear = getattr(glu, proj)
        slot_dtype, dtype = linear[part].dtype, layout.tensor(name).dtype
        widen = dtype == "float16" and slot_dtype == mx.float32
        arrives = mx.float32 if widen else getattr(mx, dtype)  # after any view
        cast = None if arrives == slot_dtype else slot_dtype
        tensors.append((name, widen, linear, part, dtype == "bfloat16", cast))
    return tensors


def _read_plan(layout, tensors: list[tuple]) -> tuple[list, list]:
    """How a bundle is read (`_sink`): its byte ranges in file order, each one tensor's
    (its index in `tensors`) or padding (None); and each tensor's shape, the dtype it is
    read as (numpy's) and the dtype of the array that keeps it (MLX's)."""
    views = bundle_views(layout)
    pieces, arrays, at = [], [], 0
    for start, end, t in sorted(
        (views[name][0], views[name][1], t) for t, name in enumerate(layout.names)
    ):
        if start > at:
            pieces.append((None, start - at))
        pieces.append((t, end - start))
        at = end
    if layout.bundle_stride > at:
        pieces.append((None, layout.bundle_stride - at))
    for name, (_, widen, *_) in zip(layout.names, tensors):
        _, _, read_as, shape = views[name]
        keep = mx.float32 if widen else getattr(mx, np.dtype(read_as).name)
        arrays.append((shape, read_as, keep))
    return pieces, arrays


# -- the streaming switch ------------------------------------------------------------------
class StreamingSwitchGLU(nn.Module):
    """mlx-lm's SwitchGLU over `n_slots` quantized slot buffers, filled from the expert store."""

    def __init__(
        self,
        layer: int,
        index: ExpertIndex,
        store: ExpertStore,
        n_slots: int,
        counters: Counters,
        scale_dtype=None,
    ):
        super().__init__()
        layout = index.layout(layer)
        hidden_dims, input_dims = layout.dims("gate_proj")
        self.glu = SwitchGLU(input_dims, hidden_dims, 1)
        for proj in PROJECTIONS:
            setattr(self.glu, proj, _slot_linear(layout, proj, n_slots, scale_dtype))
        self._io = SimpleNamespace(
            layer=layer,
            index=index,
            layout=layout,
            store=store,
            counters=counters,
            slots=LayerSlots(n_slots),
            num_experts=index.num_experts,
            resident=False,
            pending=None,
        )
        self._io.tensors = _bundle_tensors(layout, self.glu)
        self._io.pieces, self._io.arrays = _read_plan(layout, self._io.tensors)
        # expert id -> slot: decided on the host, where loads are, and published whole on
        # the device as one new array when it changes (`_publish`), so prerouted decode
        # never syncs to map ids; a scatter into the device table cost more host time.
        self._io.table = np.zeros((index.num_experts,), np.int32)
        self._io.lut = mx.array(self._io.table)
        mx.eval(self.glu.parameters())

    @property
    def slots(self) -> LayerSlots:
        return self._io.slots

    @property
    def num_experts(self) -> int:
        return self._io.num_experts

    def resize(self, n_slots: int) -> None:
        """Hold `n_slots` experts (batched decode: a layer's union of B rows, then back).

        Occupied slots below `n_slots` keep their index and contents, so the slot table stays
        valid for them; experts in slots that go are forgotten (read again when next needed).
        Nothing may be staged or planned on this layer meanwhile.
        """
        io = self._io
        old_n = io.slots.n_slots
        if n_slots == old_n or io.resident:
            return
        self._drop_pending()
        io.slots.resize(n_slots)
        for _, _, linear, part, *_ in io.tensors:
            old = linear[part]
            if n_slots > old_n:
                new = mx.concatenate(
                    [old, mx.zeros((n_slots - old_n, *old.shape[1:]), dtype=old.dtype)]
                )
            else:
                # a copy: the slice would keep it all
                new = mx.contiguous(old[:n_slots])
            setattr(linear, part, new)
        mx.eval(self.glu.parameters())

    # -- loading ----------------------------------------------------------------------------
    def load_experts(self, experts: list[int], blocking: bool = True) -> int:
        """Make `experts` resident (reading misses, blocking). Returns the number loaded."""
        io = self._io
        self._drop_pending()
        _, loads = io.slots.assign(list(experts))
        if not loads:
            return 0  # all hits: sticky slots, the slot table is already right
        started = time.perf_counter()
        loads, sizes = self._chunks(loads)
        try:
            parts = io.store.read_many(
                [(io.layer, e) for e, _ in loads], self._sink, sizes
            )
        except Exception:
            for e, _ in loads:
                io.slots.forget(e)
            raise
        # Wall time of the reads (and their unpacking on the I/O threads).
        io.counters.demand_read_seconds += time.perf_counter() - started
        io.counters.demand_read_bytes += len(loads) * io.layout.bundle_stride
        self._write_slots(loads, zip(parts, _rows(loads, sizes)))
        if blocking:
            io.counters.blocked_seconds += time.perf_counter() - started
            io.counters.blocked_loads += len(loads)
        return len(loads)

    def load_in_expert_order(self, experts: list[int]) -> int:
        """load_experts, then move `experts` so that their slot order follows their ids.

        SwitchGLU sorts a large batch's rows by slot id, and that order changes the float
        accumulation. With slots ordered like experts, a pass over a given set computes the same
        bits whatever the pool held before, which bit-exact training resume relies on.
        """
        loaded = self.load_experts(experts)
        io = self._io
        order = sorted(experts)
        current = [io.slots.slot_of(e) for e in order]
        target = sorted(current)
        if current != target:
            src, dst = (
                mx.array(current, dtype=mx.int32),
                mx.array(target, dtype=mx.int32),
            )
            for _, _, linear, part, *_ in io.tensors:
                buffer = linear[part]
                buffer[dst] = buffer[src]
            io.slots.move(dict(zip(order, target)))
            self._publish(zip(order, target))
        return loaded

    def _chunks(
        self, loads: list[tuple[int, int]], cancellable: bool = False
    ) -> tuple[list, list[int]]:
        """`loads` (expert, slot) in slot order, and how many each read task takes: runs of
        consecutive slots, each cut to at most an even share of the I/O threads' work (so
        the reads stay spread over them) and RUN_BUNDLES, each one slot write per tensor;
        cancellable: one bundle a task, so that each read can be cancelled alone."""
        loads = sorted(loads, key=lambda load: load[1])
        limit = 1
        if not cancellable:
            limit = min(RUN_BUNDLES, -(-len(loads) // self._io.store.io_workers))
        sizes, last = [], None
        for _, slot in loads:
            if sizes and sizes[-1] < limit and slot == last + 1:
                sizes[-1] += 1
            else:
                sizes.append(1)
            last = slot
        return loads, sizes

    def _sink(self, m: int):
        """On an I/O thread: where a read task's m bundles land (the store's `sink`): one MLX
        array per tensor (the layout's order), [m, ...], made and evaluated here, each
        bundle's tensors read straight into their rows; the rows of consecutive slots, so
        `_write_slots` writes them with one update per tensor.

        Nothing is copied under the GIL (making an MLX array from numpy holds it for the
        copy, and the thread building the graph waits for it where compute is fast): the
        arrays are allocated by an evaluation on a CPU stream (`_HostArrays`), which
        releases it, and the reads fill them. float16 scales for float32 slots are read
        into numpy and widened into their arrays by numpy; a cast numpy cannot do
        (bfloat16) is left to `_write_slots` as a lazy MLX op. Only evaluated leaf arrays
        leave here, no graph.
        """
        io = self._io
        arrays = _HOST_ARRAYS.zeros(
            [((m, *shape), keep) for shape, _, keep in io.arrays]
        )
        into, widen = [], []
        for a, (shape, read_as, _) in zip(arrays, io.arrays):
            host = np.asarray(memoryview(a))
            if host.dtype != read_as:  # widened: read as it is stored first
                widen.append((host, np.empty((m, *shape), read_as)))
                host = widen[-1][1]
            into.append(host)
        # Padding is read (the checksum covers it) into buffers the task's bundles share:
        # they are read one after another, each checked before the next.
        pad = [np.empty(n, np.uint8) for t, n in io.pieces if t is None]
        targets = []
        for j in range(m):
            gaps = iter(pad)
            targets.append(
                [next(gaps) if t is None else into[t][j] for t, _ in io.pieces]
            )

        def finish() -> list[mx.array]:
            for host, stored in widen:
                np.copyto(host, stored)
            return arrays

        return targets, finish

    def _write_slots(self, loads: list[tuple[int, int]], reads) -> None:
        """Write read bundles into their slots and point the slot table at `loads`.

        reads: per read task, (its arrays, [(row, expert, slot)] of the rows to write). Lazy on
        purpose: evaluating here would make the graph-building thread wait for every earlier
        layer's compute before it could build the next layer. Only changed slots are written;
        the writes run in stream order, before this layer's experts read the slots. Rows
        bound for consecutive slots are written by one slice update per tensor (no scatter,
        which MLX's CPU backend runs several times slower); a task's rows are such a run
        unless some of them are no longer wanted (a hedge's). An update starts at its
        slot's start array, made once (`_slot_start`): building it costs less than an
        indexed assignment, which parses its slice into a new start each time.
        """
        runs = []  # (its arrays, first row, first slot, rows)
        for parts, rows in reads:
            if len(rows) == parts[0].shape[0]:  # a whole task: one run by construction
                runs.append((parts, 0, rows[0][2], len(rows)))
                continue
            for row, _, slot in rows:  # a hedge's task, in part: its rows' own runs
                if runs:
                    last, first_row, first_slot, n = runs[-1]
                    if last is parts and (row, slot) == (first_row + n, first_slot + n):
                        runs[-1] = (parts, first_row, first_slot, n + 1)
                        continue
                runs.append((parts, row, slot, 1))
        runs = [(parts, row, _slot_start(slot), n) for parts, row, slot, n in runs]
        for t, (_, _, linear, part, bf16, cast) in enumerate(self._io.tensors):
            buffer = linear[part]
            for parts, row, start, n in runs:
                value = parts[t]
                if n != value.shape[0]:
                    value = value[row : row + n]
                if bf16:
                    value = value.view(mx.bfloat16)
                if cast is not None:
                    value = value.astype(cast)
                buffer = mx.slice_update(buffer, value, start, _SLOT_AXIS)
            linear[part] = buffer
        self._publish(loads)

    def _publish(self, moved) -> None:
        """Point the slot table at (expert, slot) pairs `moved`: graphs built before keep
        the table they were built with, as with an update in place."""
        table = self._io.table
        for expert, slot in moved:
            table[expert] = slot
        self._io.lut = mx.array(table)  # a copy

    def preload_all(self) -> None:
        """Resident mode: every expert in its own slot, identity slot table."""
        n = self._io.num_experts
        if self._io.slots.n_slots < n:
            raise ValueError("resident mode needs one slot per expert")
        for start in range(0, n, 16):
            self.load_experts(list(range(start, min(n, start + 16))), blocking=False)
            mx.eval(self.glu.parameters(), self._io.lut)  # bound the pending writes
        self._io.resident = True

    # -- compute ----------------------------------------------------------------------------
    def __call__(
        self, x: mx.array, indices: mx.array, pinned: bool = False
    ) -> mx.array:
        """pinned: the caller guarantees every expert in `indices` is in the slots (a staged
        plan, a training replay), so the ids map on the device: no host sync, differentiable."""
        io = self._io
        if io.resident:
            return self.glu(x, indices)
        if pinned:
            return self.glu(x, io.lut[indices])
        # Reactive: the true routing must reach the host to read misses.
        evaluate(io.counters, indices)
        ids = np.array(indices)
        # np.unique's list, at a fraction of its cost on a step's few dozen ids
        unique = sorted(set(ids.reshape(-1).tolist()))
        io.counters.union_experts += len(unique)
        io.counters.union_calls += 1
        if len(unique) <= io.slots.n_slots:
            self.load_experts(unique)
            return self.glu(x, io.lut[indices])
        return self._call_in_groups(x, indices, ids, unique)

    def _call_in_groups(self, x, indices, ids, unique):
        """More distinct experts than slots (a long prefill, a scored chunk): load them a
        slot-full at a time, each expert read once.

        Each (token, k) pair is computed once, in the group holding its expert, and put back in
        its place: a row's result does not depend on its batch mates (tests/test_fidelity.py
        checks chunked against one-position passes), so results equal the single-pass
        computation, at the single pass's compute.
        """
        io = self._io
        n, k = io.slots.n_slots, ids.shape[-1]
        flat = ids.reshape(-1)
        rows = x.reshape(-1, x.shape[-1])
        parts, where = [], []
        for start in range(0, len(unique), n):
            group = unique[start : start + n]
            self.load_experts(group)
            pairs = np.flatnonzero(np.isin(flat, group))
            slot_ids = io.lut[mx.array(flat[pairs].astype(np.int32))][:, None]
            part = self.glu(rows[mx.array(pairs // k)], slot_ids)[:, 0]
            evaluate(io.counters, part)  # before the next group overwrites these slots
            parts.append(part)
            where.append(pairs)
        back = mx.array(np.argsort(np.concatenate(where)).astype(np.int32))
        return mx.concatenate(parts)[back].reshape(*ids.shape, -1)

    # -- staging (prerouted decode) ---------------------------------------------------------
    def stage_begin(
        self,
        experts: list[int],
        hedge: "StagedSet | None" = None,
        cancellable: bool = False,
    ) -> "StagedSet":
        """Reserve slots for a predicted set and start reading the misses in the background.

        Experts already resident keep their slot (sticky), so only changed slots are read and
        written. Until `stage_finish`, the set is this layer's pending one: any other use of the
        slots (a load, a resize, another set) first drops it (`_drop_pending`), so a set whose
        plan was abandoned never leaves reserved slots that were not written.

        `hedge`: an earlier staged set of this layer, not finished (hedged staging). Its reads
        of experts in `experts` count as this set's; its other reads are cancelled where they
        have not started (their slots go back to the pool), and land in their slots where
        they have, unless `experts` needed those slots. Slot buffers are written only by
        `stage_finish`, so a slot taken back never receives the hedge's bundle. The returned
        set's `hedge` tells what became of the hedge (`HedgeOutcome`; None without one).
        cancellable: one bundle a read task, so that each read can be cancelled alone (a
        hedge's); else runs of consecutive slots are read by one task each (`_chunks`).
        """
        io = self._io
        if io.pending is not hedge:
            self._drop_pending()
        experts = list(experts)
        outcome = None
        if hedge is not None:
            wanted = set(experts)
            outcome = HedgeOutcome(
                staged=len(hedge.experts), hits=len(wanted.intersection(hedge.experts))
            )
            for f, rows in hedge.reads:
                if not any(e in wanted for _, e, _ in rows) and f.cancel():
                    for _, e, _ in rows:
                        io.slots.forget(e)
                    outcome.cancelled += len(rows)
        mapping, loads = io.slots.assign(experts)
        loads, sizes = self._chunks(loads, cancellable)
        futures = io.store.submit_many(
            io.layer, [e for e, _ in loads], sink=self._sink, chunks=sizes
        )
        reads = list(zip(futures, _rows(loads, sizes)))
        if hedge is not None:
            kept = []
            for f, rows in hedge.reads:
                if f.cancelled():
                    continue
                # Its reads started: those of experts `experts` does not hold, in vain; a
                # row whose slot went to `experts` is not written (its bundle is not needed).
                outcome.wasted += sum(e not in mapping for _, e, _ in rows)
                keep = [
                    (r, e, slot) for r, e, slot in rows if io.slots.slot_of(e) == slot
                ]
                if not keep:
                    f.cancel()
                    continue
                kept.append((f, keep))
            loads = [(e, slot) for _, rows in kept for _, e, slot in rows] + loads
            reads = kept + reads
        io.pending = StagedSet(
            experts=experts, mapping=mapping, loads=loads, reads=reads, hedge=outcome
        )
        return io.pending

    def stage_finish(self, staged: "StagedSet") -> tuple[float, int]:
        """Wait for the staged reads, write the changed slots, publish the slot table.

        Returns (seconds blocked waiting, experts missing from the slots afterwards).
        """
        io = self._io
        intact = io.pending is staged  # nothing else has used the layer's slots since
        if intact:
            io.pending = None
        # Dropped (a load, a resize or another set used the slots) or taken over by a
        # routed set: its cancelled reads' experts were forgotten, and a slot that went to
        # another expert must not receive its bundle, so only the rows still theirs are
        # written.
        reads = staged.reads
        if not intact:
            reads = [(f, rs) for f, rs in staged.reads if not f.cancelled()]
        started = time.perf_counter()
        try:
            parts = results([f for f, _ in reads])
        except Exception:
            for e, _ in staged.loads:
                io.slots.forget(e)
            raise
        waited = time.perf_counter() - started
        loads, rows = staged.loads, [r for _, r in reads]
        if not intact:
            holds = io.slots.slot_of
            loads = [(e, slot) for e, slot in loads if holds(e) == slot]
            rows = [
                [(r, e, slot) for r, e, slot in rs if holds(e) == slot] for rs in rows
            ]
        if loads:
            self._write_slots(loads, [(p, rs) for p, rs in zip(parts, rows) if rs])
        # The bundles now live in the slot writes' graph, which frees them once it has
        # run; a set kept with its step's plans would free them all on the stepping
        # thread when the plans are dropped.
        staged.reads = []
        dropped = sum(io.slots.slot_of(e) != staged.mapping[e] for e in staged.experts)
        return waited, dropped

    def _drop_pending(self) -> None:
        """Cancel the pending staged set's reads and forget its slots (never written)."""
        staged, self._io.pending = self._io.pending, None
        if staged is None:
            return
        futures = [f for f, _ in staged.reads]
        for f in futures:
            f.cancel()
        for f in futures:
            if not f.cancelled():
                try:
                    f.result()
                except Exception:
                    pass
        for e, _ in staged.loads:
            self._io.slots.forget(e)


def _rows(loads: list[tuple[int, int]], sizes: list[int]) -> list[list[tuple]]:
    """Per read task of `sizes` bundles over `loads` in order: (row, expert, slot) each."""
    out, start = [], 0
    for n in sizes:
        out.append(
            [(j, e, slot) for j, (e, slot) in enumerate(loads[start : start + n])]
        )
        start += n
    return out


class StagedSet(SimpleNamespace):
    """A predicted expert set on its way into a layer's slots: its `loads` (expert, slot)
    and `reads`, per read task (its handle, [(row, expert, slot)] of the rows it writes)."""


@dataclass
class HedgeOutcome:
    """What became of one layer's hedge when its routed set was staged."""

    staged: int  # experts the hedge staged
    hits: int  # of those, in the routed set
    cancelled: int = 0  # reads of the others never started: nothing read
    wasted: int = 0  # reads of the others that had started: bundles read in vain
