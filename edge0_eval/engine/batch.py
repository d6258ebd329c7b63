"""Batched decode: B rows per step, with continuous batching (`Engine.generate_batch`, the
server's worker).

Structure: mlx-lm's own batching, by composition. Each joining row is prefilled alone into its
own cache by the B = 1 path (`DecodeStep.prefill`), so its prefill is exactly its solo prefill; its
caches then join the batch through mlx-lm's cache classes: `KVCache.merge` -> `BatchKVCache`
(left padding, a per-row offset that RoPE and the masks read) and `ArraysCache.merge`
(GatedDeltaNet / GLA states), then `extend` into the running batch. A finishing or cancelled row
leaves with `filter`; a waiting row takes its place. Every step decodes the active rows as one
[B, 1] step (`Engine.step`, the same step as a solo decode). Rows join and leave only between
steps: `add` queues a row, `cancel` ends one, `step` runs one iteration (leave, join, decode);
`run` steps until every row has finished (generate_batch's fixed prompt list).

MoE layers. Reactive: a layer reads the union of its rows' routed experts once
(`StreamingSwitchGLU` takes the set over all rows). Prerouted: every row keeps its own
prediction as its routing ([B, 1, K] plans); each consuming layer stages the union of the rows'
predicted sets and each row executes its own set, so a row's staged set is its routed set.
As in a solo run, each step plans the next after its last layer, from the per-row features its
`Plans` carry in row order (feats, t-1 one-hots); when rows leave or join, that plan is
abandoned (its reads still land in the slots) and the new row set is planned at the start of the
next step, a joiner's features coming from its own prefill.

Slot pool. A layer's union can hold B x K experts. While a batch runs, each layer's pool holds
min(experts, B x K) slots when that exceeds the configured slots (expert_budget_mib /
slots_per_layer are the B = 1 budget); that buffer is the batch's `expert_buffer_mib` in the
stats (`Engine.batch_pool`). So prerouted never drops a planned expert, and reactive never
splits a decode step into waves (it still would for a longer prefill, as at B = 1).

Faults. A joiner whose prefill raises fails alone (its cache never joined). A decode step that
raises (an expert read's I/O or checksum error, non-finite logits) fails every row in it: their
caches were being written; the batch is emptied and the next rows start a fresh one. A failed
row carries the exception (`Row.error`); `run` raises it.

Numerics. Each row's decode is its own arithmetic: matmuls, gather_qmm and the recurrent
states are per row, and the padded keys a batch row attends over are masked to exact zeros. On
the CPU (MLX 0.32) every row's logits are bit-identical to its solo run, all families and
modes, whenever it joins or its mates leave (tests/test_batch.py). Fused attention kernels
elsewhere (Metal/CUDA SDPA with a mask over a longer, left-padded axis) may reduce in another
order: there a row is equal to rounding (the tests' tolerance off the CPU), and its greedy
tokens are still compared exactly.
"""

from __future__ import annotations

import numbers
import time
from collections import Counter, deque
from typing import Hashable

import mlx.core as mx

from edge0_eval.engine.moe import snapshot
from edge0_eval.engine.rows import (
    Row,
    RowFigures,
    RowSampler,
    StopRule,
    greedy_tokens,
)
from edge0_eval.engine.step import Plans
from edge0_eval.errors import ConfigError


def merge_caches(caches: list[list]) -> list:
    """One B = 1 prompt cache per row (a list per layer) -> the batch's cache per layer."""
    return [type(layer[0]).merge(list(layer)) for layer in zip(*caches)]


def check_batch_args(prompts, max_tokens, batch_size, seeds) -> int:
    """Validate generate_batch's arguments; the number of concurrent rows."""
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ConfigError("generate_batch: prompts is empty; give at least one prompt")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ConfigError(
                f"generate_batch: prompt {i} is empty (no tokens); every prompt "
                f"needs at least one token"
            )
    check_rows_at_once(batch_size, "batch_size", none="all prompts at once")
    check_max_tokens(max_tokens)
    if seeds is not None and len(seeds) != len(prompts):
        raise ConfigError(
            f"seeds has {len(seeds)} entries for {len(prompts)} prompts; give one "
            f"seed per prompt (or None: options.seed for every row)"
        )
    for i, seed in enumerate(seeds or []):
        check_seed(seed, f"seeds[{i}]")
    return min(len(prompts), batch_size or len(prompts))


def check_rows_at_once(value, name: str, none: str | None = None) -> None:
    if value is None and none is not None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(
            f"{name} must be a whole number >= 1"
            + (f" (or None: {none})" if none else "")
            + f", not {value!r}"
        )


def check_max_tokens(max_tokens, name: str = "max_tokens") -> None:
    if (
        isinstance(max_tokens, bool)
        or not isinstance(max_tokens, int)
        or max_tokens < 0
    ):
        raise ConfigError(f"{name} must be a whole number >= 0, not {max_tokens!r}")


def check_seed(seed, name: str = "seed") -> None:
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
        raise ConfigError(f"{name} must be a whole number >= 0, not {seed!r}")


class BatchDecoder:
    """Continuous batching on one engine: rows are added, cancelled and stepped between steps.

    rows_at_once: the most rows decoded together; more wait (first come, first joined).
    logits_trace: a dict to fill (tests, fidelity): key -> the logits [V] each token came from.
    The caller owns the engine's thread: nothing here is thread-safe.
    """

    def __init__(self, engine, rows_at_once: int, logits_trace: dict | None = None):
        check_rows_at_once(rows_at_once, "rows_at_once")
        self.engine, self.rows_at_once, self.logits_trace = (
            engine,
            rows_at_once,
            logits_trace,
        )
        self.waiting: deque[Row] = deque()
        self.active: list[Row] = []
        self.cache: list | None = None
        self.plans: Plans | None = None if engine.prerouter is None else Plans()
        # The decode figures: snapshot differences (Engine.snapshot) summed over the steps.
        self.decode = Counter()

    def _snapshot(self) -> dict:
        e = self.engine
        return snapshot(e.counters, e.store, e.blocks)

    # -- rows -------------------------------------------------------------------------------
    def add(
        self,
        key: Hashable,
        prompt: list[int],
        *,
        stop: StopRule,
        seed: int,
        sampling: dict,
        top_logprobs: int | None = None,
    ) -> Row:
        """Queue a row; it joins at the next step with room. stop: the row's stop rule (its
        max_tokens, stop ids and strings). sampling: RowSampler's keyword arguments
        (temperature, top_p, top_k, min_p, penalties); its penalties see its prompt.
        top_logprobs: keep each token's logprob and the top k (None: none)."""
        if len(prompt) == 0:
            raise ConfigError(f"row {key!r}: the prompt is empty (no tokens)")
        check_max_tokens(stop.max_tokens)
        check_seed(seed)
        row = Row(
            key,
            list(prompt),
            RowSampler(seed=int(seed), prompt=prompt, **sampling),
            stop,
            RowFigures(len(prompt)),
            top_logprobs=top_logprobs,
        )
        if self.logits_trace is not None:
            self.logits_trace[key] = []
        self.waiting.append(row)
        return row

    def cancel(self, row: Row) -> None:
        """End `row` now: a waiting row never joins; an active one leaves before the next step."""
        if row.done:
            return
        row.done = row.cancelled = True
        if row in self.waiting:
            self.waiting.remove(row)

    @property
    def pending(self) -> bool:
        """Rows are waiting or decoding."""
        return bool(self.waiting or self.active)

    def _join(self, row: Row, stage: bool):
        """Prefill `row` alone (the B = 1 path) into its own cache; sample its first token.
        stage: the row joins an empty batch alone, and its prefill plans its first step (with
        its sampler, for a draft hedge); else its plans are its features only: the batch
        plans its rows together."""
        e = self.engine
        cache = e.step.new_cache()
        before, t0 = self._snapshot(), time.perf_counter()
        logits, plans = e.step.prefill(
            row.prompt, cache, stage=stage, samplers=[row.sampler] if stage else None
        )
        if plans is not None:
            mx.eval(plans.feats, plans.onehot)
        row.figures.prefill_s = time.perf_counter() - t0
        row.figures.prefill = Counter(
            {k: v - before[k] for k, v in self._snapshot().items()}
        )
        if row.stop.finish is None:
            self._take(row, row.sampler(logits).item(), logits)
        else:  # max_tokens 0
            row.done = True
        return cache, plans

    def _take(
        self, row: Row, token: int, logits: mx.array, j: int | None = None
    ) -> None:
        """Give `row` its token, sampled from `logits`: the row's [V], or with `j` row j of
        a step's [B, V], sliced out only where it is kept (a trace, the row's logprobs)."""
        keep = self.logits_trace is not None or row.top_logprobs is not None
        if j is not None:
            logits = logits[j] if keep else None
        if self.logits_trace is not None:
            self.logits_trace[row.key].append(logits)
        row.take(int(token), logits)

    # -- the loop ---------------------------------------------------------------------------
    def run(self) -> list[Row]:
        """Step until every row has finished; the rows in the order they were added. The first
        failed row's exception is raised."""
        rows = list(self.waiting)
        while self.pending:
            for row in self.step():
                if row.error is not None:
                    raise row.error
        return rows

    def step(self) -> list[Row]:
        """One iteration: rows that finished leave, waiting rows join (prefilled alone), then
        one decode step of the active rows. Returns the rows that took a token or failed."""
        pr = self.engine.prerouter
        touched: list[Row] = []
        # Between steps: finished rows leave, waiting rows take their places.
        t0, before = time.perf_counter(), self._snapshot()
        keep = [j for j, r in enumerate(self.active) if not r.done]
        joining = bool(self.waiting) and len(keep) < self.rows_at_once
        if pr is not None and (len(keep) < len(self.active) or joining):
            if keep or self.waiting:
                # Planned for the old rows inside the last step; a joiner's prefill must not
                # run it either. After the batch's last step the plan is left in flight (the
                # pool drops it on its next use), outside the decode figures, as a solo
                # generate's last plan is.
                pr.abandon(self.plans)
            self.plans = self.plans.take(keep)
        if len(keep) < len(self.active):
            self.active = [self.active[j] for j in keep]
            if keep:
                idx = mx.array(keep, dtype=mx.int32)
                for c in self.cache:
                    c.filter(idx)
            else:
                self.cache = None
        self._account(t0, before)
        joined = []
        # One row joining an empty batch plans its first step in its prefill, as a solo
        # sequence does (a batch of one is a solo run: Engine.generate).
        alone = not self.active and (len(self.waiting) == 1 or self.rows_at_once == 1)
        while self.waiting and len(self.active) + len(joined) < self.rows_at_once:
            row = self.waiting.popleft()
            try:
                row_cache, row_plans = self._join(row, stage=alone)
            except Exception as exc:  # noqa: BLE001 - the row fails alone (see Faults)
                row.error, row.done = exc, True
                touched.append(row)
                continue
            touched.append(row)
            if not row.done:  # stopped on its first token: never joins
                joined.append((row, row_cache, row_plans))
            elif alone and pr is not None:
                pr.abandon(row_plans)
        if joined:
            if self.active:
                self.decode["batch_joined"] += len(joined)
            new = merge_caches([c for _, c, _ in joined])
            if self.cache is None:
                self.cache = new
            else:
                for mine, theirs in zip(self.cache, new):
                    mine.extend(theirs)
            self.active += [r for r, _, _ in joined]
            if pr is not None:
                parts = [self.plans] + [p for *_, p in joined]
                self.plans = parts[1] if alone else Plans.join(parts)
        if self.active:
            try:
                self._step()
            except Exception as exc:  # noqa: BLE001 - every row of the step fails
                for row in self.active:
                    row.error, row.done = exc, True
                touched += [r for r in self.active if r not in touched]
                self.active, self.cache = [], None
                self.plans = None if pr is None else Plans()
                return touched
            touched += [r for r in self.active if r not in touched]
        return touched

    def _step(self) -> None:
        """One decode step of the active rows (prerouted: planned inside the last step, or,
        after rows left or joined, at the start of this one); keeps the next step's plans."""
        e, active, c = self.engine, self.active, self.engine.counters
        t0, before = time.perf_counter(), self._snapshot()
        cpu0, waits = time.thread_time(), c.eval_wait_seconds + c.read_wait_seconds
        eval_cpu = c.eval_wait_cpu_seconds
        samplers = [r.sampler for r in active]
        last, self.plans = e.step(
            mx.array([[r.tokens[-1]] for r in active]),
            self.cache,
            self.plans,
            samplers=samplers,
            where=f"at batched decode step {self.decode['batch_steps'] + 1}",
            rows=[r.key for r in active],
        )
        # Greedy rows (evaluation's usual setting) are drawn together; a row with its own
        # key or penalties is drawn by its sampler.
        if all(s.greedy for s in samplers):
            drawn = greedy_tokens(last)
            c.evaluate(drawn)
            tokens = drawn.tolist()
        else:
            drawn = [s(last[j]) for j, s in enumerate(samplers)]
            c.evaluate(*drawn)
            tokens = [t.item() for t in drawn]
        for j, (r, t) in enumerate(zip(active, tokens)):
            self._take(r, t, last, j)
        dt = time.perf_counter() - t0
        # Host work, on the critical path where compute is fast: the step's wall time outside
        # evaluation and read waits, and the thread's CPU time outside evaluation (what that
        # wall time is when other threads and processes leave this thread a core).
        c.host_seconds += dt - (c.eval_wait_seconds + c.read_wait_seconds - waits)
        c.host_cpu_seconds += (
            time.thread_time() - cpu0 - (c.eval_wait_cpu_seconds - eval_cpu)
        )
        self.decode["batch_steps"] += 1
        self.decode["batch_tokens"] += len(active)
        diff = self._account(t0, before)
        for r in active:
            r.figures.add_step(diff, dt, len(active))

    def _account(self, t0: float, before: dict) -> dict:
        """Add the decode work since (t0, before) to the batch's decode figures; returns it."""
        after, d = self._snapshot(), self.decode
        d["batch_seconds"] += time.perf_counter() - t0
        diff = {key: value - before[key] for key, value in after.items()}
        d.update(diff)
        return diff

    # -- figures ----------------------------------------------------------------------------
    def batch_stats(self, rows: list[Row]) -> dict:
        """The batch's own figures (the same in every row's stats; with its decode figures)."""
        d = self.decode
        tokens, steps, seconds = d["batch_tokens"], d["batch_steps"], d["batch_seconds"]
        return {
            "batch_size": self.rows_at_once,  # rows at once: min(batch_size, prompts)
            "batch_rows": len(rows),
            "batch_steps": steps,
            "batch_joined_running": d["batch_joined"],  # rows that joined running rows
            "batch_mean_rows_per_step": tokens / steps if steps else 0.0,
            "batch_generated_tokens": sum(len(r.tokens) for r in rows),
            "batch_decode_tokens": tokens,
            "batch_decode_s": seconds,
            "batch_decode_tok_s": tokens / seconds if seconds > 0 else 0.0,
            "batch_prefill_s": sum(r.figures.prefill_s for r in rows),
            "batch_prefill_bytes_read": sum(r.figures.prefill["bytes"] for r in rows),
        }
