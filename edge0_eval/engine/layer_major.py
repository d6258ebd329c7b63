"""Layer-major teacher-forced scoring: a batch of sequences, one layer at a time.

Teacher forcing knows every token up front, so nothing makes scoring run in position order.
`LayerMajor` takes a batch of sequences (a prompt and the teacher's tokens each) and runs them
layer by layer, as offloaded throughput systems do (FlexGen's block schedule). At each layer:

  1. every sequence's attention (or GatedDeltaNet, GLA) part runs as prefill runs it: mlx-lm's
     own layer over the sequence's piece, with its own cache and the family's call arguments
     (families/), while a stand-in for the MoE block records its input and returns -0.0, so
     the layer returns its residual stream unchanged (h + -0.0 is h, bit for bit);
  2. the MoE block runs once over every position of the batch: the union of the batch's
     routing is read once (a slot-full at a time when it overflows the slots: experts.py's groups),
     and each sequence's output is its residual + the block's output, as mlx-lm's layer adds
     them.

Then the next layer. Reads per scored position fall by about the batch's positions, and the
experts' compute becomes one large matmul per layer.

Routing is the served path's, position by position (what `Sequence.prefill` then one
`Sequence.step` per token compute): prompt positions route with the true router; in prerouted
mode a consuming layer routes each continuation position on its owner's head prediction from
the position before (features: the owner's MoE input, its executed ids there and one position
earlier, zeros before a sequence's first position and where the engine's last prefill piece
held one position; next-token heads: the next token's embedding), computed for the whole batch
as soon as the owner has run. A wrap-around head's consumer (the first MoE layer) runs before
its owner (the last), so a round under it runs to a fixed point: the consumer's routes are
guessed (its router; the carried plan at a round's first position, which is exact), the layers
from the consumer on run, and the sequences whose owner predictions differ from the routes they
ran on run again on those predictions, their caches rewound, until every sequence reproduces
its routes. That is the sequential result: a pass fixes at least the first wrong position of
each sequence, so a round takes at most its positions + 1 passes; the passes are counted
(`LayerMajorStats.wrap_passes`).

Rounds. A batch runs in rounds: round r takes piece r of every sequence through every layer.
Where a family's layers compute a position's bits whatever piece it sits in
(`Family.split_prefill`: qwen3_5_moe, qwen2_moe on the CPU) a piece is a window of up to
`window` positions; otherwise (bailing_hybrid, whose GLA and MLA run other algorithms for one
position than for a piece) the pieces are exactly those of the path it reproduces (`cuts`: the
engine's prefill pieces, then one position each), so float32 on the CPU stays bit-identical to
stepping, at the price of one round per continuation position.

Memory. A round holds the batch's hidden states and one MoE call's intermediates, estimated at
`bytes_per_position` (the activation itemsize x (8 x hidden + 8 x K x hidden + 3 x K x expert
width + 2 x experts), checked against MLX's measured peak); sequences are grouped so that a
round holds at most `memory_mib` of them,
and a sequence longer than that runs in windows that fit (a batch is split, never grown past
the bound). Expert weights stay in the engine's slot pool (its configured size; a layer's
union beyond it is read a slot-full at a time, each expert once). Each sequence's mlx-lm cache
is held as for decoding (attention KV grows with its positions; recurrent states are fixed).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from edge0_eval.engine.counters import Counters
from edge0_eval.engine.engine import Engine
from edge0_eval.engine.families import family_for
from edge0_eval.engine.options import EngineOptions
from edge0_eval.engine.routing import StreamingMoE, build_features, onehot
from edge0_eval.engine.step import (
    DecodeStep,
    NonFiniteError,
    _mark,
    _rewind,
    prefill_pieces,
)
from edge0_eval.errors import ConfigError

# The memory a batch's rounds may hold (hidden states + one MoE call), MiB: the scorer's
# default (`fidelity bench --score-mib` changes it).
DEFAULT_MEMORY_MIB = 2048
# The longest piece of a sequence a round runs where cuts do not change the bits: attention
# over a piece holds heads x piece x (offset + piece) scores, so 1,024 keeps that near 0.1-0.3
# GiB at 16 heads while one round covers a 1,024-token continuation.
DEFAULT_WINDOW = 1024
# Log-prob rows are made this many positions at a time ([rows, vocab] float32 twice: 0.25 GB
# at a 248,320-id vocabulary).
LOGITS_ROWS = 128

# (prompt length, sequence length) -> the piece bounds [(start, end), ...] of a sequence.
Cuts = Callable[[int, int], list[tuple[int, int]]]


@dataclass
class Forced:
    """One sequence to score: the prompt, then the teacher's tokens forced after it. Scored:
    the log-probs before each of `tokens` (the first from the prompt's last position)."""

    prompt: list[int]
    tokens: list[int]

    @property
    def length(self) -> int:  # positions run: the prompt and every token but the last
        return len(self.prompt) + len(self.tokens) - 1


@dataclass
class LayerMajorStats:
    """What the scorer did, summed over its calls."""

    sequences: int = 0
    scored: int = 0  # positions scored (log-prob rows)
    positions: int = 0  # positions run (prompts included)
    prompt_tokens: int = 0
    batches: int = 0
    rounds: int = 0
    layer_passes: int = 0  # (round or fixed-point pass, layer) MoE calls over a batch
    wrap_rounds: int = 0  # rounds run to a fixed point under a wrap-around head
    wrap_passes: int = 0  # and the passes they took
    max_round_positions: int = 0
    seconds: float = 0.0  # wall time of the batches, consumers of the rows excluded
    head_seconds: float = 0.0  # of which: the LM head and log-probs of scored positions

    def rates(self) -> dict:
        """What scoring costs, prompts and positions apart: seconds = prompt tokens /
        prompt_tokens_per_s + scored positions / positions_per_s. A prompt token costs a
        position through the layers; a scored position that and its share of the LM head."""
        layers = self.seconds - self.head_seconds
        if self.positions == 0 or layers <= 0 or self.scored == 0:
            return {"prompt_tokens_per_s": None, "positions_per_s": None}
        per_position = layers / self.positions
        return {
            "prompt_tokens_per_s": 1 / per_position,
            "positions_per_s": 1 / (per_position + self.head_seconds / self.scored),
        }

    def as_dict(self) -> dict:
        out = dict(vars(self))
        out["wrap_passes_per_round"] = (
            self.wrap_passes / self.wrap_rounds if self.wrap_rounds else None
        )
        return out | self.rates()


class _Deferred(nn.Module):
    """Stands in for a layer's MoE block in step 1: records its input, returns -0.0 (the
    identity of addition), so the layer's output is its residual stream."""

    def __init__(self):
        super().__init__()
        self.x = None

    def __call__(self, x: mx.array) -> mx.array:
        self.x = x
        return mx.full(x.shape, -0.0, dtype=x.dtype)


@dataclass
class _Seq:
    """One sequence's state in a batch."""

    index: int
    ids: list[int]  # the tokens run: prompt + forced tokens but the last
    prompt: int  # prompt length
    cuts: list[tuple[int, int]]
    cache: list
    # A position whose t-1 one-hot is zeros besides 0: the prompt's last where the engine's
    # last prefill piece holds it alone (its plan sees no t-1 ids then).
    zero_prev: int | None
    # Carried from round to round, committed when a round is settled: per consumer, the
    # ids [1, 1, K] planned for the next position; per owner, its ids at the last one.
    plan: dict = field(default_factory=dict)
    last_ids: dict = field(default_factory=dict)
    # The round being run: its piece, call arguments, hidden states, and per MoE layer the
    # ids it executed and per consumer the ids predicted for each next position [1, L, K].
    start: int = 0
    end: int = 0
    args: Callable | None = None
    h: mx.array | None = None
    mid: mx.array | None = None
    x: mx.array | None = None
    executed: dict = field(default_factory=dict)
    ahead: dict = field(default_factory=dict)


class LayerMajor:
    """Teacher-forced log-probs of many sequences, layer by layer (see the module's docstring).

    `rows(items)` yields (item index, first row, log-prob rows [r, vocab] float32) as pieces of
    each item's rows are made; `stats` says what it did."""

    def __init__(
        self,
        step: DecodeStep,
        *,
        moe_layers: list[int],
        dims: dict,
        prerouter=None,
        experts_per_token: int | None = None,
        cuts: Cuts | None = None,
        prefill_last_single: Callable[[int], bool] = lambda n: n < 2,
        memory_mib: float = DEFAULT_MEMORY_MIB,
        window: int = DEFAULT_WINDOW,
        new_cache: Callable[[], list] | None = None,
    ):
        if not (memory_mib > 0) or window < 1:
            raise ConfigError(
                f"layer-major scoring: memory {memory_mib!r} MiB and window {window!r} "
                f"must be positive (--score-mib, --window)"
            )
        self.step, self.family = step, step.family
        self.moe_layers, self.prerouter, self.experts_per_token = (
            list(moe_layers),
            prerouter,
            experts_per_token,
        )
        self.cuts, self.prefill_last_single = cuts, prefill_last_single
        self.window, self.new_cache = window, new_cache
        self.memory_mib = memory_mib
        itemsize = step.embed(mx.array([[0]])).dtype.size
        k, hidden = dims.get("experts_per_token") or 1, dims["hidden"]
        # Held per position of a round: ~8 hidden-size arrays (the pieces' input, residual
        # and MoE input, their batch copies, the block's output and the new residual) and,
        # in the MoE call, ~8 K x hidden ones (SwitchGLU's sorted copy of the input and its
        # output, unsorted, weighted; the slot-full groups' gathers) with 3 K x expert-width
        # ones and the router's scores. Measured on the testbed (MLX peak, CPU, float32):
        # 0.16-0.19 MiB per position against 0.17 here.
        self.bytes_per_position = itemsize * (
            8 * hidden
            + 8 * k * hidden
            + 3 * k * dims.get("moe_intermediate", 0)
            + 2 * dims.get("experts", 0)
        )
        self.round_positions = max(
            1, int(memory_mib * 2**20 // self.bytes_per_position)
        )
        self.stats = LayerMajorStats()
        self._heads = {}
        pr = prerouter
        # Consuming layers with the owner whose head plans them.
        self.owner_of = {} if pr is None else {c: o for o, c in pr.consumer_of.items()}
        self.wrap = None if pr is None else pr.wrap

    # -- construction -----------------------------------------------------------------------
    @classmethod
    def for_engine(cls, engine: Engine, **kwargs) -> "LayerMajor":
        """The Edge0 engine's served path: its streaming blocks, slot pool, prerouter, LoRA and
        hidden clipping; prompt pieces as `DecodeStep.prefill` cuts them."""
        opts, family = engine.options, engine.family
        text = family.text_config(engine.config)
        dims = {
            "hidden": family.hidden_size(engine.config),
            "experts": engine.index.num_experts,
            "experts_per_token": engine.experts_per_token,
            "moe_intermediate": int(text.get("moe_intermediate_size") or 0),
        }

        def cuts(prompt: int, n: int) -> list[tuple[int, int]]:
            pieces = prefill_pieces(prompt, opts.prefill_chunk, family.split_prefill)
            return pieces + [(p, p + 1) for p in range(prompt, n)]

        def last_single(prompt: int) -> bool:
            a, b = prefill_pieces(prompt, opts.prefill_chunk, family.split_prefill)[-1]
            return b - a < 2

        return cls(
            engine.step,
            moe_layers=engine.moe_layers,
            dims=dims,
            prerouter=engine.prerouter,
            experts_per_token=engine.experts_per_token,
            cuts=None if family.split_prefill else cuts,
            prefill_last_single=last_single,
            new_cache=engine.step.new_cache,
            **kwargs,
        )

    @classmethod
    def for_mlx_lm(cls, model, *, cuts: Cuts, **kwargs) -> "LayerMajor":
        """An mlx-lm model, every weight resident (the teacher arm): its own MoE blocks run
        over the batch. `cuts`: the pieces of the path it reproduces (used where the family's
        layers compute other bits for other cuts)."""
        args = getattr(model, "args", None)
        config = dict(vars(args)) if args is not None else {}
        config.setdefault("model_type", getattr(model, "model_type", None))
        family = family_for(config, "the mlx-lm model")
        text = family.text_config(config)
        moe = family.moe_layers(model)
        dims = {
            "hidden": family.hidden_size(config),
            "experts": int(text.get("num_experts") or 0),
            "experts_per_token": int(text.get("num_experts_per_tok") or 1),
            "moe_intermediate": int(text.get("moe_intermediate_size") or 0),
        }
        chunk = EngineOptions.prefill_chunk  # unused: the teacher's pieces are `cuts`
        step = DecodeStep(model, family, {}, None, None, Counters(), "teacher", chunk)
        cuts = None if family.split_prefill else cuts
        return cls(
            step,
            moe_layers=moe,
            dims=dims,
            cuts=cuts,
            new_cache=step.new_cache,
            **kwargs,
        )

    # -- scoring ----------------------------------------------------------------------------
    def rows(self, items: list[Forced]) -> Iterator[tuple[int, int, np.ndarray]]:
        """(item index, first row, log-prob rows [r, vocab] float32) of every item, row i of
        an item being the log-probs before its token i; items in batches that fit the
        memory bound, each batch in rounds (see the module's docstring)."""
        for i, item in enumerate(items):
            if not item.prompt:
                raise ConfigError(f"item {i}: empty prompt: nothing to prefill")
        batch, held = [], 0
        for i, item in enumerate(items):
            if not item.tokens:
                continue
            cuts = self._cuts(i, item)
            # A round holds at most one piece of each sequence.
            cost = max(b - a for a, b in cuts)
            if batch and held + cost > self.round_positions:
                yield from self._batch(batch)
                batch, held = [], 0
            batch.append((i, item, cuts))
            held += cost
        if batch:
            yield from self._batch(batch)

    def _cuts(self, index: int, item: Forced) -> list[tuple[int, int]]:
        """The item's pieces: windows that fit the bound, or (a family whose cuts change the
        bits) the reproduced path's own, its prompt pieces whatever the bound."""
        n = item.length
        if self.cuts is None:
            w = max(1, min(self.window, self.round_positions))
            return [(a, min(n, a + w)) for a in range(0, n, w)]
        cuts = self.cuts(len(item.prompt), n)
        if not cuts or cuts[-1][1] != n or any(b <= a for a, b in cuts):
            raise ConfigError(f"item {index}: bad cuts {cuts} of {n} positions")
        return cuts

    def _batch(self, batch: list[tuple[int, Forced, list]]) -> Iterator:
        self._clock = time.perf_counter()
        seqs = []
        for index, item, cuts in batch:
            ids = [int(t) for t in item.prompt] + [int(t) for t in item.tokens[:-1]]
            n, prompt = len(ids), len(item.prompt)
            seqs.append(
                _Seq(
                    index,
                    ids,
                    prompt,
                    cuts,
                    self.new_cache(),
                    prompt - 1
                    if prompt >= 2 and self.prefill_last_single(prompt)
                    else None,
                )
            )
            self.stats.sequences += 1
            self.stats.prompt_tokens += prompt
            self.stats.positions += n
            self.stats.scored += len(item.tokens)
        self.stats.batches += 1
        for r in range(max(len(s.cuts) for s in seqs)):
            now = [s for s in seqs if r < len(s.cuts)]
            for s in now:
                s.start, s.end = s.cuts[r]
            yield from self._round(now)
            for s in now:
                if r == len(s.cuts) - 1:
                    s.cache = None  # done: its cache goes
        self._tick()

    def _tick(self) -> float:
        """Adds the time since the last tick to `stats.seconds` (the scorer's own time: a
        consumer's between the rows it is handed is not counted); returns it."""
        now = time.perf_counter()
        spent, self._clock = now - self._clock, now
        self.stats.seconds += spent
        return spent

    def _round(self, seqs: list[_Seq]) -> Iterator:
        self.stats.rounds += 1
        self.stats.max_round_positions = max(
            self.stats.max_round_positions, sum(s.end - s.start for s in seqs)
        )
        step = self.step
        for s in seqs:
            h = step.embed(mx.array(s.ids[s.start : s.end])[None])
            s.args = self.family.layer_args(step.text, h, s.cache)
            s.h, s.executed, s.ahead = h, {}, {}
        wrap = self.wrap
        if wrap is not None and not any(s.end > s.prompt for s in seqs):
            wrap = None  # only prompt positions: every layer routes truly
        consumer = None if wrap is None else wrap[1]
        layers = self.step.layers
        for i in range(len(layers)):
            if i == consumer:
                break
            self._layer(i, seqs, None)
        if consumer is not None:
            self._fixed_point(seqs, consumer)
        self._commit(seqs)
        yield from self._logprobs(seqs)

    def _fixed_point(self, seqs: list[_Seq], consumer: int) -> None:
        """The layers from the wrap consumer on, until each sequence's owner predictions
        reproduce the consumer's routes (see the module's docstring)."""
        self.stats.wrap_rounds += 1
        saved = {id(s): (s.h, [_mark(c) for c in s.cache[consumer:]]) for s in seqs}
        todo, guess = list(seqs), {}
        while True:
            self.stats.wrap_passes += 1
            for i in range(consumer, len(self.step.layers)):
                self._layer(i, todo, guess)
            left = []
            for s in todo:
                # The owner (the last MoE layer) ran after the consumer: its predictions.
                pred, ran = s.ahead[consumer], s.executed[consumer]
                # Continuation positions after the round's first: planned from the pass.
                later = mx.arange(s.start + 1, s.end) >= s.prompt
                same = (pred[0, :-1] == ran[0, 1:]).all(axis=-1)
                if not mx.logical_or(same, mx.logical_not(later)).all().item():
                    left.append(s)
            if not left:
                return
            for s in left:
                h, marks = saved[id(s)]
                for c, mark in zip(s.cache[consumer:], marks):
                    _rewind(c, mark)
                s.h = h
                guess[id(s)] = s.ahead[consumer]
            todo = left

    def _layer(self, i: int, seqs: list[_Seq], guess: dict | None) -> None:
        """Layer i over `seqs`' pieces: step 1 per sequence, step 2 over the batch."""
        layer, clip = self.step.layers[i], self.step.clip
        block = layer.mlp if i in self.moe_layers else None
        deferred = _Deferred() if block is not None else None
        if deferred is not None:
            # On this layer instance, for this pass only: mlx-lm's classes stay untouched.
            layer.mlp = deferred
        try:
            for s in seqs:
                c = s.cache[i]
                args, kwargs = s.args(layer, s.h, c)
                out = layer(*args, **kwargs)
                if deferred is None:
                    s.h = self._clip(out) if clip else out
                    mx.eval(s.h, c.state if c is not None else [])
                    continue
                s.mid, s.x = out, deferred.x
                mx.eval(s.mid, s.x, c.state if c is not None else [])
        finally:
            if deferred is not None:
                layer.mlp = block
        if block is None:
            return
        self.stats.layer_passes += 1
        x = mx.concatenate([s.x for s in seqs], axis=1)
        planned, mask = self._planned(i, seqs, guess)
        y, inds = self._moe(block, x, planned, mask)
        bounds = np.cumsum([0] + [s.end - s.start for s in seqs]).tolist()
        outs = []
        for s, a, b in zip(seqs, bounds, bounds[1:]):
            h = s.mid + y[:, a:b]
            s.h = self._clip(h) if clip else h
            if inds is not None:
                s.executed[i] = inds[:, a:b]
            s.mid = s.x = None
            outs.append(s.h)
        mx.eval(outs, [s.executed.get(i) for s in seqs if i in s.executed])
        if self.prerouter is not None and i in self.prerouter.consumer_of:
            self._predict(i, seqs, x, inds, bounds)

    def _clip(self, h: mx.array) -> mx.array:
        clip = self.step.clip
        return mx.clip(mx.nan_to_num(h, nan=0.0), -clip, clip)

    def _planned(self, i: int, seqs: list[_Seq], guess: dict | None):
        """Layer i's plans over the batch (ids [1, N, K], where-planned [1, N]), or (None,
        None) where it routes truly everywhere."""
        if i not in self.owner_of or not any(s.end > s.prompt for s in seqs):
            return None, None
        wrap_consumer = self.wrap is not None and i == self.wrap[1]
        plans, masks = [], []
        k = self.experts_per_token
        for s in seqs:
            length = s.end - s.start
            first = s.plan.get(i)
            if first is None:
                first = mx.zeros((1, 1, k), dtype=mx.int32)
            if wrap_consumer:
                ahead = (guess or {}).get(id(s))
            else:
                ahead = s.ahead[i]
            later = (
                mx.zeros((1, length - 1, k), dtype=mx.int32)
                if ahead is None
                else ahead[:, :-1].astype(mx.int32)
            )
            plans.append(mx.concatenate([first.astype(mx.int32), later], axis=1))
            pos = mx.arange(s.start, s.end)
            m = pos >= s.prompt
            if s.plan.get(i) is None:
                m = mx.logical_and(m, pos > s.start)
            if ahead is None:
                m = mx.logical_and(m, pos == s.start)
            masks.append(m[None])
        return mx.concatenate(plans, axis=1), mx.concatenate(masks, axis=1)

    def _moe(self, block, x: mx.array, planned, mask):
        """The block over the batch's MoE inputs x [1, N, H]: (output, executed ids or None).

        A streaming block (the engine) composes its parts as `StreamingMoE.__call__` does:
        the true router's ids and weights where unplanned, the planned ids weighted by the
        router where planned (the weights each path computes), the experts over the union
        (read once), the shared expert. An mlx-lm block (the teacher) is called as it is."""
        if not isinstance(block, StreamingMoE):
            return block(x), None
        if planned is None:
            inds, weights = block.select(x)
        else:
            m = mask[..., None]
            if mask.all().item():
                inds = planned
                weights = block.weights(x, inds)
            else:
                true_inds, true_w = block.select(x)
                inds = mx.where(m, planned, true_inds.astype(planned.dtype))
                weights = mx.where(m, block.weights(x, inds), true_w)
        y = block.switch_mlp(x, inds)
        y = (y * weights[..., None]).sum(axis=-2)
        shared = block.shared(x)
        return (y if shared is None else y + shared), inds

    def _predict(self, owner: int, seqs, x: mx.array, inds: mx.array, bounds) -> None:
        """Owner's head over the batch: each position's prediction for its consumer at the
        next position (Prerouter.predict's features, per sequence: t-1's ids from the round
        before at a piece's start, zeros at a sequence's start and where the engine's last
        prefill piece held one position; next-token heads: the next token's embedding)."""
        pr = self.prerouter
        consumer = pr.consumer_of[owner]
        E = pr.heads.config.num_experts
        now = onehot(inds, E, x.dtype)
        prevs, follows = [], []
        for s, a, b in zip(seqs, bounds, bounds[1:]):
            carried = s.last_ids.get(owner)
            first = (
                mx.zeros((1, 1, E), dtype=x.dtype)
                if carried is None
                else onehot(carried, E, x.dtype)
            )
            prev = mx.concatenate([first, now[:, a : b - 1]], axis=1)
            pos = mx.arange(s.start, s.end)
            zero = pos == 0
            if s.zero_prev is not None:
                zero = mx.logical_or(zero, pos == s.zero_prev)
            prevs.append(mx.where(zero[None, :, None], 0, prev))
            if pr.next_token:
                nxt = s.ids[s.start + 1 : s.end + 1]
                emb = self.step.embed(mx.array(nxt)[None]) if nxt else None
                pad = (s.end - s.start) - len(nxt)
                if pad:
                    zeros = mx.zeros((1, pad, x.shape[-1]), dtype=x.dtype)
                    emb = zeros if emb is None else mx.concatenate([emb, zeros], axis=1)
                follows.append(emb)
        prev = mx.concatenate(prevs, axis=1)
        following = mx.concatenate(follows, axis=1) if follows else None
        feats = build_features(x[None], now[None], prev[None], following)
        heads = self._heads.get(owner)
        if heads is None:
            heads = self._heads[owner] = pr.heads.select_owners([owner])
        pred = pr.blocks[consumer].rule.select(heads(feats)[0], pr.experts_per_token)[0]
        mx.eval(pred)
        for s, a, b in zip(seqs, bounds, bounds[1:]):
            s.ahead[consumer] = pred[:, a:b]

    def _commit(self, seqs: list[_Seq]) -> None:
        """A settled round's carries: each consumer's plan for the next position, each owner's
        ids at the last position."""
        if self.prerouter is None:
            return
        for s in seqs:
            for consumer, pred in s.ahead.items():
                s.plan[consumer] = pred[:, -1:]
            for owner in self.prerouter.consumer_of:
                if owner in s.executed:
                    s.last_ids[owner] = s.executed[owner][:, -1:]

    def _logprobs(self, seqs: list[_Seq]) -> Iterator:
        """The round's scored rows (positions from the prompt's last on), per sequence."""
        self._tick()
        for s in seqs:
            first = max(s.start, s.prompt - 1)
            for a in range(first, s.end, LOGITS_ROWS):
                b = min(s.end, a + LOGITS_ROWS)
                logits = self.step.logits(s.h[:, a - s.start : b - s.start])[0]
                logits = logits.astype(mx.float32)
                lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
                finite = mx.isfinite(logits).all()
                mx.eval(lp, finite)
                if not finite.item():
                    raise NonFiniteError(
                        f"{self.step.name}: non-finite logits teacher-forced at positions "
                        f"{a}..{b - 1} of item {s.index}; a resident weight, expert or "
                        f"adapter holds NaN/Inf, or an activation overflowed (try "
                        f"--verify-crc, --compute-dtype float32, or re-run convert)"
                    )
                rows = np.array(lp)
                self.stats.head_seconds += self._tick()
                yield s.index, a - (s.prompt - 1), rows
                self._clock = time.perf_counter()
            s.h = None  # the next round starts from its tokens' embeddings
