"""The one step of the served model: `(tokens, cache, plans) -> (logits, next plans)`: mlx-lm's
own decoder layers called with each family's arguments (engine/families/), the streaming MoE
blocks routed by the step's `Route`s (engine/routing.py).

Every caller runs the model through `DecodeStep`: a prompt's pieces (`prefill`) and each decode
token of the batch decoder (B rows a step; `Engine.generate` is a batch of one), fidelity
scoring, and training's served path (whole sequences; its gradient pass through `forward`
alone). The cache (mlx-lm's, one per
layer) and the prerouter's per-row state (`Plans`, routing.py) are arguments and results;
the engine keeps neither. One prerouted decode step, top to bottom:

  1. Plans that were not made at the end of the last step are made now (`Prerouter.plan`):
     next-token heads, which need the step's tokens; plans dropped as batch rows changed; the
     unstaged plans of training.
  2. Embed, then mlx-lm's own decoder layers, called with the family's arguments
     (`Family.layer_args`). A consuming layer first waits for its staged reads
     (`Prerouter.finish`) and executes exactly that set (`Route`); each output is clipped when
     clipping is on.
  3. After the last layer, before the LM head: the heads plan the next step from this step's
     features and its reads start, overlapping the LM head (`Prerouter.after_step`).
  4. The LM head; the last position's logits are evaluated with the caches and checked
     finite, and the step is timed.

A chunk of L > 1 positions (a prompt piece, a teacher-forced sequence) with plans is planned in
the pass: consuming layer N+1 runs position t on the owner N head's prediction from position
t-1, made as soon as layer N has run; position 0 on the carried plan (else its true router).
A wrap-around head's consumer (the first MoE layer) runs before its owner (the last), and the
owner's features at t depend on the consumer's output at t, so no layer order computes such a
chunk in one pass: it runs to a fixed point instead (`_fixed_point`): the consumer's routes are
guessed (first its router), the chunk runs, and runs again on the owner's predictions until they
reproduce the routes it ran on. That is the sequential result (each pass fixes at least the
first position it guessed wrong: at most L passes) at the cost of the passes it takes.
"""

from __future__ import annotations

import time
from typing import Callable

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, make_prompt_cache

from edge0_eval.engine.counters import Counters
from edge0_eval.engine.experts import evaluate
from edge0_eval.engine.routing import Plans, Route
from edge0_eval.errors import ConfigError, Edge0Error

# -- the step ----------------------------------------------------------------------------
# How a decoder layer is called: call(i, layer, *args, **kwargs) (training: mx.checkpoint).
LayerCall = Callable[..., mx.array]
# A wrap consumer's guess for a chunk's first fixed-point pass: its router after position 0.
WRAP_ROUTER = "router"


class NonFiniteError(Edge0Error):
    """The model produced NaN/Inf logits: corrupt weights or an activation overflow."""


def prefill_pieces(n: int, chunk: int, split: bool) -> list[tuple[int, int]]:
    """Where `DecodeStep.prefill` cuts a prompt of `n` tokens: pieces of up to `chunk`, the
    last one at least 2 long when chunk > 1 (the heads' t and t-1 features), and with `split`
    (Family.split_prefill) the last 2 tokens alone, as mlx-lm's generate_step runs its last
    one, so that for every earlier position only what the caches hold is computed (never its
    LM head, nor the part of the last layer that no cache needs). The layer-major scorer
    (layer_major.py) cuts a prompt the same way where cuts change the bits."""
    chunk = max(1, chunk)
    keep = min(n, 2 if chunk > 1 else 1)
    if split:
        bounds = list(range(0, n - keep, chunk)) + [n - keep, n]
    else:
        bounds = list(range(0, n, chunk)) + [n]
        if len(bounds) > 2 and bounds[-1] - bounds[-2] < keep:
            bounds[-2] = n - keep
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


class DecodeStep:
    """The served model, one step at a time: `step(tokens, cache, plans) -> (logits, plans)`;
    a prompt in pieces (`prefill`) into a new cache (`new_cache`)."""

    def __init__(
        self,
        model,
        family,
        blocks: dict,
        prerouter,  # a routing.Prerouter, or None
        clip: float | None,
        counters: Counters,
        name: str,
        prefill_chunk: int,
    ):
        self.model, self.family, self.blocks, self.prerouter = (
            model,
            family,
            blocks,
            prerouter,
        )
        self.clip, self.counters, self.name = clip, counters, name
        self.prefill_chunk = prefill_chunk
        self.text = family.text(model)
        self.embed = family.embedding(model)
        self.layers = family.layers(model)
        self.norm, self.head, self.tied = family.output_head(model)

    def new_cache(self) -> list:
        """An empty cache for one sequence (per layer, mlx-lm's own)."""
        return make_prompt_cache(self.model)  # qwen2_moe has no make_cache of its own

    def prefill(
        self,
        tokens: list[int],
        cache: list,
        *,
        stage: bool = True,
        samplers: list | None = None,
    ) -> tuple[mx.array, Plans | None]:
        """Process a prompt into `cache`, in the pieces `prefill_pieces` cuts: (the last
        position's logits [vocab], the first decode step's plans). stage=False (batched
        decode): the plans are the row's features only; the batch plans all its rows
        together. samplers: as for a step (a draft hedge)."""
        if not tokens:
            raise ConfigError("empty prompt: nothing to prefill")
        n = len(tokens)
        pieces = prefill_pieces(n, self.prefill_chunk, self.family.split_prefill)
        where = f"in the prefill of tokens 0..{n - 1}"
        for start, end in pieces[:-1]:
            self(mx.array(tokens[start:end])[None], cache, plan_next=False, where=where)
        start, end = pieces[-1]
        piece = mx.array(tokens[start:end])[None]
        logits, plans = self(piece, cache, stage=stage, samplers=samplers, where=where)
        return logits[0], plans

    def __call__(
        self,
        tokens: mx.array,
        cache: list,
        plans: Plans | None = None,
        *,
        stage: bool = True,
        plan_next: bool = True,
        planned: mx.array | None = None,
        samplers: list | None = None,
        all_logits: bool = False,
        where: str = "at a step",
        rows: list[int] | None = None,
        draw: Callable[[mx.array], mx.array] | None = None,
    ) -> tuple[mx.array, Plans | None]:
        """Logits of `tokens` [B, L] continuing `cache` (updated in place): [B, vocab] of the
        last position (all_logits: [B, L, vocab]), evaluated and finite; and the next step's
        plans (None without heads or `plan_next`).

        plans: None routes every layer truly (a prompt); Plans() starts prerouted routing.
        stage: plans made here start reading into the slot pool (else only ids: training,
        whose pool loads what it routes). planned [B, L]: where False, layers route truly
        (training's prompt positions). samplers: the rows' samplers, for a draft hedge.
        where / rows: name the step and the rows (prompt numbers) in a NonFiniteError.
        draw: a function of the last logits (the rows' greedy tokens), evaluated with them so
        that a step syncs once; the first value returned is then (last logits, draw's result).
        """
        started = time.perf_counter()
        pr = self.prerouter
        if plans is not None and plans.feats is not None and not plans.layers:
            plans = pr.plan(plans, tokens[:, 0], stage=stage)
        if stage and plans is not None and plans.layers:
            self.counters.prerouted_steps += 1
        if plans is not None and pr.wrap is not None and tokens.shape[1] > 1:
            h, events = self._fixed_point(tokens, cache, plans, planned)
        else:
            h, events = self.forward(tokens, cache, plans, planned=planned)
        following = None
        if pr is not None and plan_next:
            following = pr.after_step(plans, h, samplers, stage=stage)
        logits = self.logits(h if all_logits else h[:, -1:])
        built = time.perf_counter()
        last = logits[:, -1]
        # Every position computed (a teacher-forced piece: all of them) is checked, per row.
        finite = mx.isfinite(logits).all(axis=(1, 2))
        # Evaluated with the rest, so reading the verdict below syncs nothing more.
        all_finite = finite.all()
        states = [c.state for c in cache if c is not None]
        drawn = None if draw is None else draw(last)
        evaluate(self.counters, last, finite, all_finite, events, states, drawn)
        if events is not None:
            self.counters.guard_events += events.item()
        if not all_finite.item():
            self.counters.nonfinite_events += 1
            bad = ""
            if rows is not None:
                failed = [r for r, ok in zip(rows, finite.tolist()) if not ok]
                bad = f" (prompt(s) {failed})"
            raise NonFiniteError(
                f"{self.name}: non-finite logits {where}{bad}; a resident weight, expert or "
                f"adapter holds NaN/Inf, or an activation overflowed (try --verify-crc, "
                f"--compute-dtype float32, or re-run convert)"
            )
        self.counters.steps += 1
        self.counters.build_seconds += built - started
        self.counters.eval_seconds += time.perf_counter() - built
        if drawn is not None:
            return (last, drawn), following
        return (logits if all_logits else last), following

    def forward(
        self,
        tokens: mx.array,
        cache: list,
        plans: Plans | None = None,
        *,
        planned: mx.array | None = None,
        replay: dict[int, mx.array] | None = None,
        call: LayerCall | None = None,
        wrap_ahead: mx.array | str | None = None,
    ) -> tuple[mx.array, mx.array | None]:
        """The layer loop, lazily: the last layer's output [B, L, H], and how many values the
        clipping changed (None: off). `replay` (layer -> ids [B, L, K], in the slots) fixes
        every MoE layer's experts: training's gradient pass, with `call` checkpointing.
        `wrap_ahead`: under a wrap-around head, a chunk's guess for its consumer, as the
        owner's `predict` gives them (entry t for position t + 1), or WRAP_ROUTER (its router
        after position 0): one pass of `_fixed_point`."""
        pr = self.prerouter if plans is not None else None
        length = tokens.shape[1]
        wrap = pr.wrap if pr is not None and length > 1 else None
        if wrap is not None and wrap_ahead is None:
            raise ConfigError(
                "a wrap-around prerouter head's consumer runs before its owner: "
                "a chunk of several positions runs to a fixed point (call the "
                "step), or step the tokens one by one"
            )
        h = self.embed(tokens)
        layer_args = self.family.layer_args(self.text, h, cache)
        events, ahead = None, ({} if wrap is None else {wrap[1]: wrap_ahead})
        for i, (layer, c) in enumerate(zip(self.layers, cache)):
            block = self.blocks.get(i)
            if block is not None:
                block.route = (
                    Route(replay[i], pinned=True)
                    if replay is not None
                    else None
                    if pr is None
                    else self._planned_route(i, h, plans, ahead.pop(i, None), planned)
                )
            args, kwargs = layer_args(layer, h, c)
            h = (
                layer(*args, **kwargs)
                if call is None
                else call(i, layer, *args, **kwargs)
            )
            if block is not None:
                block.route = None
            if self.clip:
                bad = mx.logical_or(mx.isnan(h), mx.abs(h) > self.clip).sum()
                events = bad if events is None else events + bad
                h = mx.clip(mx.nan_to_num(h, nan=0.0), -self.clip, self.clip)
            if pr is not None and length > 1 and i in pr.ahead:
                ahead[i + 1] = pr.predict(i, tokens, plans)
        return h, events

    def _fixed_point(
        self, tokens: mx.array, cache: list, plans: Plans, planned: mx.array | None
    ) -> tuple[mx.array, mx.array | None]:
        """A chunk under a wrap-around head (see the module's docstring): passes of `forward`
        until the owner's predictions reproduce the routes the consumer ran on, the caches
        rewound to the chunk's start between passes. Passes and chunks are counted."""
        owner, consumer = self.prerouter.wrap
        marks = [_mark(c) for c in cache]
        guess: mx.array | str = WRAP_ROUTER
        while True:
            h, events = self.forward(
                tokens, cache, plans, planned=planned, wrap_ahead=guess
            )
            self.counters.wrap_passes += 1
            predicted = self.prerouter.predict(owner, tokens, plans)
            same = (predicted[:, :-1] == self.blocks[consumer].last[1][:, 1:]).all(
                axis=-1
            )
            if planned is not None:  # where the router runs, no plan to reproduce
                same = mx.logical_or(same, mx.logical_not(planned[:, 1:]))
            if same.all().item():
                self.counters.wrap_chunks += 1
                return h, events
            for c, mark in zip(cache, marks):
                _rewind(c, mark)
            guess = predicted
            # The carried plans' staged sets are in the slots now: their ids only.
            plans = Plans(
                plans.feats,
                plans.onehot,
                {n: (ids, None) for n, (ids, _) in plans.layers.items()},
            )

    def _planned_route(
        self,
        layer: int,
        h: mx.array,
        plans: Plans,
        ahead: mx.array | str | None,
        planned: mx.array | None,
    ) -> Route | None:
        """Layer `layer`'s route: its plan at position 0 (waiting for its staged reads first),
        `ahead` (predicted in this pass, or a fixed-point guess) at positions 1.., the router
        where neither is (WRAP_ROUTER: the router after position 0)."""
        plan = plans.layers.get(layer)
        if isinstance(ahead, str):
            if plan is None:
                return None
            inds = plan[0]
            if plan[1] is not None:
                self.prerouter.finish(layer, plan[1])
            first = mx.arange(h.shape[1])[None] == 0
            return Route(
                mx.broadcast_to(inds, (inds.shape[0], h.shape[1], inds.shape[-1])),
                mask=first if planned is None else mx.logical_and(planned, first),
            )
        if plan is None and ahead is None:
            return None
        if plan is not None:
            inds, staged = plan
            if staged is not None:
                if layer > 0 and plans.overlap(layer):
                    evaluate(self.counters, h, wait=mx.async_eval)
                    self.counters.early_evals += 1
                self.prerouter.finish(layer, staged)
            if ahead is None:
                # pinned: the staged set is the whole route, nothing to read
                return Route(
                    inds, mask=planned, pinned=staged is not None and planned is None
                )
        first = ahead[:, :1] if plan is None else inds
        inds = mx.concatenate([first, ahead[:, :-1]], axis=1)
        if plan is None:  # position 0 has no prediction: its router
            later = mx.arange(inds.shape[1])[None] > 0
            planned = later if planned is None else mx.logical_and(planned, later)
        return Route(inds, mask=planned)

    def logits(self, h: mx.array) -> mx.array:
        out = self.norm(h)
        return self.head.as_linear(out) if self.tied else self.head(out)


def _mark(c):
    """Where a layer's cache stands, to rewind a fixed-point pass: a KV cache's offset (a
    rerun overwrites what lies beyond it), a recurrent cache's arrays (replaced, not written
    in place, by a pass)."""
    if isinstance(c, ArraysCache):
        return list(c.cache), c.left_padding, c.lengths
    if c is not None and c.is_trimmable():
        return c.offset
    raise ConfigError(
        f"a fixed-point pass cannot rewind a {type(c).__name__}: step the "
        f"tokens one by one"
    )


def _rewind(c, mark) -> None:
    if isinstance(c, ArraysCache):
        c.cache, c.left_padding, c.lengths = list(mark[0]), mark[1], mark[2]
    else:
        c.trim(c.offset - mark)
