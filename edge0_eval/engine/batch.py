"""Batched decode: B rows per step, with continuous batching (`Engine.generate_batch`).

Structure: mlx-lm's own batching, by composition. Each joining row is prefilled alone into its
own cache by the B = 1 path (`Engine.prefill`), so its prefill is exactly its solo prefill; its
caches then join the batch through mlx-lm's cache classes: `KVCache.merge` -> `BatchKVCache`
(left padding, a per-row offset that RoPE and the masks read) and `ArraysCache.merge`
(GatedDeltaNet / GLA states), then `extend` into the running batch. A finishing row leaves with
`filter`; the next waiting prompt joins in its place. Every step decodes the active rows as one
[B, 1] step (`Engine.step`, the same step as a solo decode).

MoE layers. Reactive: a layer reads the union of its rows' routed experts once
(`StreamingSwitchGLU` takes np.unique over all rows). Prerouted: every row keeps its own
prediction as its routing ([B, 1, K] plans); each consuming layer stages the union of the rows'
predicted sets and each row executes its own set, so a row's staged set is its routed set.
As in a solo run, each step plans the next after its last layer, from the per-row features its
`Plans` carry in row order (feats, t-1 one-hots); when rows leave or join, that plan is
abandoned (its reads still land in the slots) and the new row set is planned at the start of the
next step, a joiner's features coming from its own prefill.

Slot pool. A layer's union can hold B x K experts. While a batch runs, each layer's pool holds
min(experts, B x K) slots when that exceeds the configured slots (expert_budget_mib /
slots_per_layer are the B = 1 budget); that buffer is the batch's `expert_buffer_mib` in the
stats, and the pool returns to the configured size afterwards (Engine.generate_batch). So
prerouted never drops a planned expert, and reactive never splits a decode step into waves (it
still would for a longer prefill, as at B = 1).

Numerics. Each row's decode is its own arithmetic: matmuls, gather_qmm and the recurrent
states are per row, and the padded keys a batch row attends over are masked to exact zeros. On
the CPU (MLX 0.32) every row's logits are bit-identical to its solo run, all families and
modes (tests/test_batch.py). Fused attention kernels elsewhere (Metal/CUDA SDPA with a mask
over a longer, left-padded axis) may reduce in another order: there a row is equal to
rounding (the tests' tolerance off the CPU), and its greedy tokens are still compared exactly.
"""

from __future__ import annotations

import numbers
import time
from collections import Counter, deque
from dataclasses import dataclass, field

import mlx.core as mx

from edge0_eval.engine.prerouted import Plans
from edge0_eval.engine.sampling import RowSampler
from edge0_eval.errors import ConfigError


@dataclass
class _Row:
    index: int                       # position in the caller's prompt list
    prompt: list[int]
    sampler: RowSampler
    tokens: list[int] = field(default_factory=list)
    prefill_s: float = 0.0
    prefill_bytes: int = 0
    steps: int = 0                   # decode steps this row took part in
    decode_share_s: float = 0.0      # its share of those steps' wall time (step time / rows)
    decode_wall_s: float = 0.0       # wall time of those steps
    done: bool = False


def merge_caches(caches: list[list]) -> list:
    """One B = 1 prompt cache per row (a list per layer) -> the batch's cache per layer."""
    return [type(layer[0]).merge(list(layer)) for layer in zip(*caches)]


def check_batch_args(prompts, max_tokens, batch_size, seeds) -> int:
    """Validate generate_batch's arguments; the number of concurrent rows."""
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ConfigError("generate_batch: prompts is empty; give at least one prompt")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ConfigError(f"generate_batch: prompt {i} is empty (no tokens); every prompt "
                              f"needs at least one token")
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int)
                                   or batch_size < 1):
        raise ConfigError(f"batch_size must be a whole number >= 1 (or None: all prompts at "
                          f"once), not {batch_size!r}")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0:
        raise ConfigError(f"max_tokens must be a whole number >= 0, not {max_tokens!r}")
    if seeds is not None and len(seeds) != len(prompts):
        raise ConfigError(f"seeds has {len(seeds)} entries for {len(prompts)} prompts; give one "
                          f"seed per prompt (or None: options.seed for every row)")
    for i, seed in enumerate(seeds or []):
        check_seed(seed, f"seeds[{i}]")
    return min(len(prompts), batch_size or len(prompts))


def check_seed(seed, name: str = "seed") -> None:
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
        raise ConfigError(f"{name} must be a whole number >= 0, not {seed!r}")


class BatchDecoder:
    """One generate_batch call: admits rows, steps the batch, keeps the accounting."""

    def __init__(self, engine, prompts, max_tokens, batch_size, sampling: dict, stop,
                 seeds, logits_trace=None):
        self.engine = engine
        self.prompts = [list(p) for p in prompts]
        self.max_tokens, self.stop = max_tokens, stop
        self.rows_at_once = batch_size
        seeds = seeds if seeds is not None else [engine.options.seed] * len(prompts)
        # sampling: RowSampler's keyword arguments (temperature, top_p, top_k, min_p,
        # penalties); a row's penalties see its own prompt.
        self.samplers = [RowSampler(seed=int(s), prompt=p, **sampling)
                         for s, p in zip(seeds, self.prompts)]
        # A list to fill (tests, fidelity): per prompt, the logits [V] each token came from.
        self.logits_trace = logits_trace
        if logits_trace is not None:
            logits_trace[:] = [[] for _ in prompts]
        # The decode figures: snapshot differences (Engine.snapshot) summed over the steps.
        self.decode = Counter()

    # -- rows -------------------------------------------------------------------------------
    def _join(self, index: int):
        """Prefill prompt `index` alone (the B = 1 path) into its own cache; sample its first
        token. Its plans are its features only: the batch plans its rows together."""
        e = self.engine
        row = _Row(index, self.prompts[index], self.samplers[index])
        cache = e.new_cache()
        before, t0 = e.snapshot(), time.perf_counter()
        logits, plans = e.prefill(row.prompt, cache, stage=False)
        if plans is not None:
            mx.eval(plans.feats, plans.onehot)
        row.prefill_s = time.perf_counter() - t0
        row.prefill_bytes = e.snapshot()["bytes"] - before["bytes"]
        if self.max_tokens >= 1:
            self._take(row, row.sampler(logits), logits)
        else:
            row.done = True
        return row, cache, plans

    def _take(self, row: _Row, token: mx.array, logits: mx.array) -> None:
        if self.logits_trace is not None:
            self.logits_trace[row.index].append(logits)
        t = int(token.item())
        row.tokens.append(t)
        row.done = t in self.stop or len(row.tokens) >= self.max_tokens

    # -- the loop ---------------------------------------------------------------------------
    def run(self) -> list[_Row]:
        e, pr = self.engine, self.engine.prerouter
        waiting = deque(range(len(self.prompts)))
        finished: list[_Row] = []
        active: list[_Row] = []
        cache, plans = None, None if pr is None else Plans()
        while waiting or active:
            # Between steps: finished rows leave, waiting prompts take their places.
            t0, before = time.perf_counter(), e.snapshot()
            keep = [j for j, r in enumerate(active) if not r.done]
            joining = bool(waiting) and len(keep) < self.rows_at_once
            if pr is not None and (len(keep) < len(active) or joining):
                if keep or waiting:
                    # Planned for the old rows inside the last step; a joiner's prefill must
                    # not run it either. After the batch's last step the plan is left in
                    # flight (the pool drops it on its next use), outside the decode
                    # figures, as a solo generate's last plan is.
                    pr.abandon(plans)
                plans = plans.take(keep)
            if len(keep) < len(active):
                finished += [r for r in active if r.done]
                active = [active[j] for j in keep]
                if keep:
                    idx = mx.array(keep, dtype=mx.int32)
                    for c in cache:
                        c.filter(idx)
                else:
                    cache = None
            self._account(t0, before)
            joined = []
            while waiting and len(active) + len(joined) < self.rows_at_once:
                row, row_cache, row_plans = self._join(waiting.popleft())
                if row.done:
                    finished.append(row)        # stopped on its first token: never joins
                else:
                    joined.append((row, row_cache, row_plans))
            if joined:
                if active:
                    self.decode["batch_joined"] += len(joined)
                new = merge_caches([c for _, c, _ in joined])
                if cache is None:
                    cache = new
                else:
                    for mine, theirs in zip(cache, new):
                        mine.extend(theirs)
                active += [r for r, _, _ in joined]
                if pr is not None:
                    plans = Plans.join([plans] + [p for *_, p in joined])
            if active:
                plans = self._step(active, cache, plans)
        return sorted(finished, key=lambda r: r.index)

    def _step(self, active: list[_Row], cache: list, plans: Plans | None) -> Plans | None:
        """One decode step of the active rows (prerouted: planned inside the last step, or,
        after rows left or joined, at the start of this one); the next step's plans."""
        e = self.engine
        t0, before = time.perf_counter(), e.snapshot()
        last, plans = e.step(mx.array([[r.tokens[-1]] for r in active]), cache, plans,
                             samplers=[r.sampler for r in active],
                             where=f"at batched decode step {self.decode['batch_steps'] + 1}",
                             rows=[r.index for r in active])
        tokens = [r.sampler(last[j]) for j, r in enumerate(active)]
        mx.eval(*tokens)
        dt = time.perf_counter() - t0
        self.decode["batch_steps"] += 1
        self.decode["batch_tokens"] += len(active)
        self._account(t0, before)
        for j, (r, t) in enumerate(zip(active, tokens)):
            r.steps += 1
            r.decode_share_s += dt / len(active)
            r.decode_wall_s += dt
            self._take(r, t, last[j])
        return plans

    def _account(self, t0: float, before: dict) -> None:
        """Add the decode work since (t0, before) to the batch's decode figures."""
        after, d = self.engine.snapshot(), self.decode
        d["batch_seconds"] += time.perf_counter() - t0
        for key, value in after.items():
            d[key] += value - before[key]

    # -- figures ----------------------------------------------------------------------------
    def batch_stats(self, rows: list[_Row]) -> dict:
        """The batch's own figures (the same in every row's stats; with its decode figures)."""
        d = self.decode
        tokens, steps, seconds = d["batch_tokens"], d["batch_steps"], d["batch_seconds"]
        return {
            "batch_size": self.rows_at_once,       # rows at once: min(batch_size, prompts)
            "batch_rows": len(rows),
            "batch_steps": steps,
            "batch_joined_running": d["batch_joined"],    # rows that joined running rows
            "batch_mean_rows_per_step": tokens / steps if steps else 0.0,
            "batch_generated_tokens": sum(len(r.tokens) for r in rows),
            "batch_decode_tokens": tokens,
            "batch_decode_s": seconds,
            "batch_decode_tok_s": tokens / seconds if seconds > 0 else 0.0,
            "batch_prefill_s": sum(r.prefill_s for r in rows),
            "batch_prefill_bytes_read": sum(r.prefill_bytes for r in rows),
        }

    @staticmethod
    def row_stats(row: _Row) -> dict:
        """A row's own figures: its prefill, its tokens, its share of the decode steps."""
        return {
            "prompt_tokens": len(row.prompt),
            "generated_tokens": len(row.tokens),
            "prefill_s": row.prefill_s,
            "prefill_tok_s": len(row.prompt) / row.prefill_s if row.prefill_s > 0 else 0.0,
            "prefill_bytes_read": row.prefill_bytes,
            "decode_steps": row.steps,
            "decode_s": row.decode_share_s,
            "decode_wall_s": row.decode_wall_s,
            # The row's own stream rate: its tokens over the wall time of its steps.
            "decode_tok_s": row.steps / row.decode_wall_s if row.decode_wall_s > 0 else 0.0,
        }
