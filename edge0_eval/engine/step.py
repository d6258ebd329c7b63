"""The one step of the served model: `(tokens, cache, plans) -> (logits, next plans)`, with the
pieces it runs around mlx-lm's own decoder layers: each family's streaming MoE block, the
routing rules that turn router scores into experts, and each family's layer call arguments.

Every caller runs the model through `DecodeStep`: a prompt's pieces (`prefill`) and each decode
token of the batch decoder (B rows a step; `Engine.generate` is a batch of one), fidelity
scoring, and training's served path (whole sequences; its gradient pass through `forward`
alone). The cache (mlx-lm's, one per
layer) and the prerouter's per-row state (`Plans`, prerouted.py) are arguments and results;
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

Streaming MoE blocks: mlx-lm's MoE block with `switch_mlp` replaced by a `StreamingSwitchGLU`
(engine/moe.py), its child modules kept under their original names (`gate`,
`shared_expert(s)`, ...) so weights, LoRA keys and published adapters address the same paths.
True routing is mlx-lm's own, bit for bit; a `Route` (set by the step) replaces the router's
choice of experts, never its weights.

Expert selection: `top_k_ids` / `combine` are the only code that turns router scores into
(expert ids, weights). The prerouter heads' logits go through a `RoutingRule` (each block's
`rule`), the same rule detached from the module so that it can be stacked over consumer layers
and applied to all heads in one computation. The order of the k selected ids is the order of
the weighted sum, so each caller keeps the order mlx-lm's block uses ("last": qwen3's
argpartition(probs)[-k:]; "first": argpartition(-sel)[:k]), which keeps outputs bit-identical
to mlx-lm.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask, create_ssm_mask
from mlx_lm.models.cache import ArraysCache, make_prompt_cache

from edge0_eval.engine.moe import Counters, StagedSet, StreamingSwitchGLU
from edge0_eval.errors import ConfigError, Edge0Error

# -- expert selection --------------------------------------------------------------------
# mlx-lm's Gate adds this to the normaliser; a no-op for any real sum of k probabilities.
NORM_EPS = 1e-20


def top_k_ids(sel: mx.array, k: int, order: str = "first") -> mx.array:
    """Ids [..., k] of the k largest entries of `sel` [..., E] (no gradient through the choice)."""
    if order == "last":
        return mx.stop_gradient(mx.argpartition(sel, kth=-k, axis=-1)[..., -k:])
    return mx.stop_gradient(mx.argpartition(-sel, kth=k - 1, axis=-1)[..., :k])


def combine(
    scores: mx.array,
    inds: mx.array,
    *,
    normalize: bool,
    eps: float = 0.0,
    scaling: float | None = None,
) -> mx.array:
    """Combination weights [..., k] of `inds` from `scores` [..., E]: optionally normalised over
    the k (with `eps` added to the sum), optionally times `scaling`."""
    weights = mx.take_along_axis(scores, inds, axis=-1)
    if normalize:
        total = weights.sum(axis=-1, keepdims=True)
        weights = weights / (total + eps if eps else total)
    return weights if scaling is None else weights * scaling


def limit_groups(sel: mx.array, n_group: int, topk_group: int) -> mx.array:
    """Group-limited routing (mlx-lm's Gate): keep the `topk_group` best of `n_group` groups
    (a group's score: the sum of its two best entries); the others' entries become -inf."""
    n_drop = n_group - topk_group
    if n_drop <= 0:
        return sel
    sel = mx.unflatten(sel, axis=-1, shape=(n_group, -1))
    group_scores = mx.topk(sel, 2, axis=-1).sum(axis=-1, keepdims=True)
    drop = mx.argpartition(group_scores, kth=n_drop - 1, axis=-2)[..., :n_drop, :]
    sel = mx.put_along_axis(
        sel, mx.stop_gradient(drop), mx.array(-mx.inf, sel.dtype), axis=-2
    )
    return mx.flatten(sel, -2, -1)


@dataclass
class RoutingRule:
    """A family's selection rule, detached from the module (stackable over consumer layers)."""

    score: str = "softmax"  # "softmax" | "sigmoid"
    norm_topk_prob: bool = True
    # [E], or stacked [O, 1, E]; steers selection only
    expert_bias: mx.array | None = None
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0

    def to_json(self) -> dict:
        return {
            "score": self.score,
            "norm_topk_prob": self.norm_topk_prob,
            "n_group": self.n_group,
            "topk_group": self.topk_group,
            "routed_scaling_factor": self.routed_scaling_factor,
            "has_expert_bias": self.expert_bias is not None,
        }

    def scores(self, logits: mx.array) -> mx.array:
        logits = logits.astype(mx.float32)
        if self.score == "sigmoid":
            return mx.sigmoid(logits)
        return mx.softmax(logits, axis=-1, precise=True)

    def weights(self, scores: mx.array, inds: mx.array) -> mx.array:
        return combine(
            scores,
            inds,
            normalize=inds.shape[-1] > 1 and self.norm_topk_prob,
            eps=NORM_EPS,
            scaling=self.routed_scaling_factor,
        )

    def select(self, logits: mx.array, k: int) -> tuple[mx.array, mx.array]:
        """logits [..., E] -> (inds [..., K], weights [..., K] float32)."""
        scores = self.scores(logits)
        sel = (
            scores
            if self.expert_bias is None
            else scores + self.expert_bias.astype(mx.float32)
        )
        inds = top_k_ids(limit_groups(sel, self.n_group, self.topk_group), k)
        return inds, self.weights(scores, inds)


def stack_rules(rules: list[RoutingRule]) -> RoutingRule:
    """One rule for logits [O, B, E] whose row o follows rules[o] (only expert_bias may differ)."""
    first = rules[0]
    for r in rules[1:]:
        if (
            r.score,
            r.norm_topk_prob,
            r.n_group,
            r.topk_group,
            r.routed_scaling_factor,
        ) != (
            first.score,
            first.norm_topk_prob,
            first.n_group,
            first.topk_group,
            first.routed_scaling_factor,
        ):
            raise ValueError(
                "consumer layers follow different routing rules; select per layer"
            )
    bias = None
    if first.expert_bias is not None:
        bias = mx.stack([r.expert_bias for r in rules])[:, None, :]
    return RoutingRule(
        first.score,
        first.norm_topk_prob,
        bias,
        first.n_group,
        first.topk_group,
        first.routed_scaling_factor,
    )


# -- the streaming MoE blocks ------------------------------------------------------------
@dataclass
class Route:
    """What a block executes instead of its router's choice, for one call."""

    inds: mx.array  # [B, L, K] experts, weighted by the layer's own router
    mask: mx.array | None = None  # [B, L]: where False, the router's own choice instead
    pinned: bool = False  # every expert of `inds` is in the slots: no host sync


class StreamingMoE(nn.Module):
    """Common plumbing. `route` (None: the true router) is set by whoever runs the layer;
    with `capture` on, `last` holds the last call's (MoE input [B, L, H], executed ids)."""

    selection_order = "first"

    def _init_streaming(self, switch: StreamingSwitchGLU, top_k: int) -> None:
        self.switch_mlp = switch
        self.top_k = top_k
        self.num_experts = switch.num_experts
        self.route: Route | None = None
        self.capture = False
        self.last: tuple[mx.array, mx.array] | None = None
        # a list: keep each plan's recall (lazy)
        self.recall: list[mx.array] | None = None

    def __call__(self, x: mx.array) -> mx.array:
        route = self.route
        if route is None:
            inds, weights = self.select(x)
        else:
            inds = route.inds
            if route.mask is not None:
                inds = mx.where(route.mask[..., None], inds, self.select(x)[0])
            weights = self.weights(x, inds)
            if self.recall is not None:  # |planned ∩ true top-k| / k
                hit = (inds[..., :, None] == self.select(x)[0][..., None, :]).any(
                    axis=-1
                )
                self.recall.append(hit.astype(mx.float32).mean())
        if self.capture:
            self.last = (x, inds)
        y = self.switch_mlp(x, inds, pinned=route is not None and route.pinned)
        y = (y * weights[..., None]).sum(axis=-2)
        shared = self.shared(x)
        return y if shared is None else y + shared


class QwenStreamingMoE(StreamingMoE):
    """qwen3_5_moe block: softmax top-k, normalised, a shared expert with a sigmoid gate."""

    # mlx-lm qwen3_next / qwen3_5_moe: argpartition(probs)[-k:]
    selection_order = "last"

    def __init__(self, block, switch: StreamingSwitchGLU, top_k: int):
        super().__init__()
        self.gate = block.gate
        self.shared_expert = block.shared_expert
        self.shared_expert_gate = block.shared_expert_gate
        self.norm_topk_prob = self.normalizes(block)
        self._init_streaming(switch, top_k)

    @staticmethod
    def normalizes(block) -> bool:
        return bool(block.norm_topk_prob)

    @property
    def router(self) -> nn.Module:
        return self.gate

    @property
    def rule(self) -> RoutingRule:
        return RoutingRule(score="softmax", norm_topk_prob=self.norm_topk_prob)

    def _probs(self, x: mx.array) -> mx.array:
        return mx.softmax(self.gate(x), axis=-1, precise=True)

    def select(self, x: mx.array) -> tuple[mx.array, mx.array]:
        probs = self._probs(x)
        inds = top_k_ids(probs, self.top_k, self.selection_order)
        return inds, combine(probs, inds, normalize=self.norm_topk_prob)

    def weights(self, x: mx.array, inds: mx.array) -> mx.array:
        return combine(self._probs(x), inds, normalize=self.norm_topk_prob)

    def shared(self, x: mx.array) -> mx.array:
        return mx.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


class Qwen2StreamingMoE(QwenStreamingMoE):
    """qwen2_moe block: the same softmax router and gated shared expert, never normalised.

    Selection is mlx-lm qwen2_moe's own (argpartition of -probs, first k): the order of the k
    experts is the order of the weighted sum, so matching it keeps outputs bit-identical.
    """

    selection_order = "first"

    @staticmethod
    def normalizes(block) -> bool:
        return False  # mlx-lm's qwen2_moe block has no norm_topk_prob: it never does


class BailingStreamingMoE(StreamingMoE):
    """bailing_hybrid block: sigmoid + expert bias, group-limited top-k, routed scaling."""

    def __init__(self, block, switch: StreamingSwitchGLU, top_k: int):
        super().__init__()
        self.gate = block.gate  # mlx-lm's Gate: its own selection rule, reused as is
        self.shared_experts = block.shared_experts
        self._init_streaming(switch, top_k)
        self.gate.top_k = top_k  # instance attribute: serves K != native top-k

    @property
    def router(self) -> nn.Module:
        return self.gate.gate_proj

    @property
    def rule(self) -> RoutingRule:
        gate = self.gate
        return RoutingRule(
            score=gate.score_function,
            norm_topk_prob=bool(gate.norm_topk_prob),
            expert_bias=gate.expert_bias,
            n_group=int(gate.n_group),
            topk_group=int(gate.topk_group),
            routed_scaling_factor=float(gate.routed_scaling_factor),
        )

    def select(self, x: mx.array) -> tuple[mx.array, mx.array]:
        return self.gate(x)

    def weights(self, x: mx.array, inds: mx.array) -> mx.array:
        # mlx-lm's Gate: normalised only for k > 1, then scaled.
        probs = mx.sigmoid(self.gate.gate_proj(x).astype(mx.float32))
        return combine(
            probs,
            inds,
            normalize=inds.shape[-1] > 1 and self.gate.norm_topk_prob,
            eps=NORM_EPS,
            scaling=self.gate.routed_scaling_factor,
        ).astype(x.dtype)

    def shared(self, x: mx.array) -> mx.array | None:
        return None if self.shared_experts is None else self.shared_experts(x)


# -- each family's layer call arguments (Family.layer_args) ------------------------------
def qwen3_5_layer_args(text, h, cache):
    inner = text.model
    fa_mask = create_attention_mask(h, cache[inner.fa_idx])
    ssm_mask = create_ssm_mask(h, cache[inner.ssm_idx])
    return lambda layer, h, c: (
        (h,),
        dict(mask=ssm_mask if layer.is_linear else fa_mask, cache=c),
    )


def bailing_layer_args(text, h, cache):
    inner = text.model
    attn_cache = cache[inner._attn_idx] if inner._attn_idx is not None else None
    attn_mask = create_attention_mask(h, attn_cache, return_array=True)
    gla_mask = (
        create_ssm_mask(h, cache[inner._gla_idx])
        if inner._gla_idx is not None
        else None
    )
    offset = attn_cache.offset if attn_cache is not None else 0
    return lambda layer, h, c: (
        (h, attn_mask if layer.is_global else gla_mask, c),
        dict(offset=offset),
    )


def qwen2_layer_args(text, h, cache):
    mask = create_attention_mask(h, cache[0])
    return lambda layer, h, c: ((h, mask, c), {})


# -- the prerouter's state between steps (its heads and staging: prerouted.py) ---------


@dataclass
class Plans:
    """The prerouter's state between two steps of B rows, in the batch's row order."""

    # [O, B, in]: the heads' features at each row's last token
    feats: mx.array | None = None
    # [O, B, E]: that token's executed experts (the next t-1)
    onehot: mx.array | None = None
    # consuming layer -> (ids [B, 1, K], its StagedSet; None: not staged, loaded on demand)
    layers: dict[int, tuple[mx.array, StagedSet | None]] = field(default_factory=dict)
    # the draft hedge's reads
    hedges: dict[int, StagedSet] = field(default_factory=dict)
    # (draft tokens [B], the heads' (ids, weights) at them)
    drafted: tuple | None = None

    def overlap(self, layer: int) -> bool:
        """Whether staged layer `layer` (> 0) starts the compute of the layers before it
        ahead of waiting for its reads: at the step's first staged layer after layer 0 (so
        compute runs while the rest is built; before layer 0 there is none), and wherever
        reads of it or a later staged layer are still in flight (so compute runs while they
        land). Else the step's own evaluation starts it: each evaluation call costs the
        building thread more than its own time (reports/perf.md (HW))."""
        staged = {n: s for n, (_, s) in self.layers.items() if n > 0 and s is not None}
        return layer == min(staged) or any(
            not task.done()
            for n, s in staged.items()
            if n >= layer
            for task, _ in s.reads
        )

    def take(self, rows: list[int]) -> "Plans":
        """The row state of `rows`, in that order; whatever was planned is dropped."""
        if self.feats is None or not rows:
            return Plans()
        idx = mx.array(rows, dtype=mx.int32)
        return Plans(self.feats[:, idx], self.onehot[:, idx])

    @staticmethod
    def join(parts: list["Plans"]) -> "Plans":
        """The rows of `parts` one after another (row state only)."""
        parts = [p for p in parts if p.feats is not None]
        if not parts:
            return Plans()
        return Plans(
            mx.concatenate([p.feats for p in parts], axis=1),
            mx.concatenate([p.onehot for p in parts], axis=1),
        )


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
        prerouter,  # a prerouted.Prerouter, or None
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
        logits, plans = self(
            mx.array(tokens[start:end])[None],
            cache,
            stage=stage,
            samplers=samplers,
            where=where,
        )
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
    ) -> tuple[mx.array, Plans | None]:
        """Logits of `tokens` [B, L] continuing `cache` (updated in place): [B, vocab] of the
        last position (all_logits: [B, L, vocab]), evaluated and finite; and the next step's
        plans (None without heads or `plan_next`).

        plans: None routes every layer truly (a prompt); Plans() starts prerouted routing.
        stage: plans made here start reading into the slot pool (else only ids: training,
        whose pool loads what it routes). planned [B, L]: where False, layers route truly
        (training's prompt positions). samplers: the rows' samplers, for a draft hedge.
        where / rows: name the step and the rows (prompt numbers) in a NonFiniteError.
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
        following = (
            pr.after_step(plans, h, samplers, stage=stage)
            if pr is not None and plan_next
            else None
        )
        logits = self.logits(h if all_logits else h[:, -1:])
        built = time.perf_counter()
        last = logits[:, -1]
        # Every position computed (a teacher-forced piece: all of them) is checked, per row.
        finite = mx.isfinite(logits).all(axis=(1, 2))
        # Evaluated with the rest, so reading the verdict below syncs nothing more.
        all_finite = finite.all()
        self.counters.evaluate(
            last, finite, all_finite, events, [c.state for c in cache if c is not None]
        )
        if events is not None:
            self.counters.guard_events += events.item()
        if not all_finite.item():
            self.counters.nonfinite_events += 1
            bad = (
                ""
                if rows is None
                else f" (prompt(s) {[r for r, ok in zip(rows, finite.tolist()) if not ok]})"
            )
            raise NonFiniteError(
                f"{self.name}: non-finite logits {where}{bad}; a resident weight, expert or "
                f"adapter holds NaN/Inf, or an activation overflowed (try --verify-crc, "
                f"--compute-dtype float32, or re-run convert)"
            )
        self.counters.steps += 1
        self.counters.build_seconds += built - started
        self.counters.eval_seconds += time.perf_counter() - built
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
                    self.counters.evaluate(h, wait=mx.async_eval)
                    self.counters.early_evals += 1
                self.prerouter.finish(layer, staged)
            if (
                ahead is None
            ):  # pinned: the staged set is the whole route, nothing to read
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
