"""Routing: the only code that turns router scores into (expert ids, weights), and the
streaming MoE block's common plumbing that every family's block (engine/families/) shares.

Expert selection: `top_k_ids` / `combine` are the only code that turns router scores into
(expert ids, weights). The prerouter heads' logits go through a `RoutingRule` (each block's
`rule`), the same rule detached from the module so that it can be stacked over consumer layers
and applied to all heads in one computation. The order of the k selected ids is the order of
the weighted sum, so each caller keeps the order mlx-lm's block uses ("last": qwen3's
argpartition(probs)[-k:]; "first": argpartition(-sel)[:k]), which keeps outputs bit-identical
to mlx-lm.

Streaming MoE blocks: mlx-lm's MoE block with `switch_mlp` replaced by a `StreamingSwitchGLU`
(engine/experts.py), its child modules kept under their original names (`gate`,
`shared_expert(s)`, ...) so weights, LoRA keys and published adapters address the same paths.
True routing is mlx-lm's own, bit for bit; a `Route` (set by the step) replaces the router's
choice of experts, never its weights.

The prerouter (prediction as routing, with staged reads that overlap compute):
After each step every prerouter head runs in one batched computation on the step's features
(`after_step`); the predicted set of each consuming layer (owner + 1; for the wrap-around head,
owned by the last MoE layer, the first MoE layer) starts loading at once, and during the next
step that layer executes exactly that set (engine/step.py). The heads also run on the prompt's
last token after prefill, so the first decode token is prerouted too. Layers that consume no
head, and prefill itself, route with the true router.

Next-token heads (`config.next_token`) also read the embedding of the token the step is about to
consume, so their plan waits for the next step's tokens (`plan`, at its start): their reads no
longer overlap the LM head. A draft hedge (`hedge`, engine/draft.py: a draft vocabulary file)
drafts each row's token from a slice of the LM head right after the last layer and stages the
next-token heads' sets at that draft; when the token is known the heads route as before, each
hedged layer reads only what its hedge missed, and the hedge's other reads are cancelled where
they have not started (`StreamingSwitchGLU.stage_begin`). Routing, and every logit, are those of
the next-token heads alone: the hedge only changes when bundles are read. When the served
tokens equal the drafts, the hedge's selection is the plan. (Mixed heads and hedges of context
heads were deleted, beaten by kept variants: reports/variants.md.)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from edge0_eval.engine.counters import Counters
from edge0_eval.engine.experts import StagedSet, StreamingSwitchGLU, evaluate
from edge0_eval.errors import ConfigError
from edge0_eval.formats.heads_file import PrerouterConfig

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
        sel = scores
        if self.expert_bias is not None:
            sel = scores + self.expert_bias.astype(mx.float32)
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

    def _init_streaming(
        self, switch: StreamingSwitchGLU, experts_per_token: int
    ) -> None:
        self.switch_mlp = switch
        self.experts_per_token = experts_per_token
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


# -- the prerouter's state between steps (the prerouter below) ---------


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


# -- the heads ------------------------------------------------------------------------------


class PrerouterHeads(nn.Module):
    """All owners' heads as stacked weights; one batched computation per step."""

    def __init__(
        self, config: PrerouterConfig, fc1: mx.array, fc2: mx.array, linear: mx.array
    ):
        super().__init__()
        o, e, w, d = len(config.owners), config.num_experts, config.width, config.in_dim
        for name, arr, shape in (
            ("fc1", fc1, (o, w, d)),
            ("fc2", fc2, (o, e, w)),
            ("linear", linear, (o, e, d)),
        ):
            if tuple(arr.shape) != shape:
                raise ValueError(
                    f"{name} has shape {tuple(arr.shape)}, expected {shape}"
                )
        self.config = config  # plain object attribute: not a parameter
        self.fc1, self.fc2, self.linear = fc1, fc2, linear

    @property
    def owners(self) -> list[int]:
        return list(self.config.owners)

    @property
    def dtype(self):
        return self.fc1.dtype

    def __call__(self, feats: mx.array) -> mx.array:
        """feats [O, ..., in] -> logits [O, ..., E] (in the weights' dtype)."""
        o = feats.shape[0]
        lead = feats.shape[1:-1]
        x = feats.reshape(o, -1, feats.shape[-1]).astype(self.fc1.dtype)
        hid = nn.gelu(mx.matmul(x, self.fc1.swapaxes(1, 2)))  # exact erf GELU
        out = mx.matmul(hid, self.fc2.swapaxes(1, 2)) + mx.matmul(
            x, self.linear.swapaxes(1, 2)
        )
        return out.reshape(o, *lead, out.shape[-1])

    def select_owners(self, owners: list[int]) -> "PrerouterHeads":
        """A PrerouterHeads holding only `owners` (a subset, any order kept ascending)."""
        have = {n: i for i, n in enumerate(self.config.owners)}
        missing = [n for n in owners if n not in have]
        if missing:
            raise ConfigError(
                f"no head for owner layer(s) {missing}; heads cover "
                f"{self.config.owners}"
            )
        owners = sorted(owners)
        idx = mx.array([have[n] for n in owners])
        consumers = [self.config.consumer_of[n] for n in owners]
        cfg = replace(self.config, owners=owners, consumers=consumers)
        return PrerouterHeads(cfg, self.fc1[idx], self.fc2[idx], self.linear[idx])

    def astype(self, dtype) -> "PrerouterHeads":
        weights = (w.astype(dtype) for w in (self.fc1, self.fc2, self.linear))
        return PrerouterHeads(self.config, *weights)


def onehot(inds: mx.array, num_experts: int, dtype=mx.float32) -> mx.array:
    """[..., K] expert ids -> [..., E] with ones at the ids (a K-hot row)."""
    hits = inds[..., None] == mx.arange(num_experts, dtype=inds.dtype)
    return hits.any(axis=-2).astype(dtype)


def build_features(
    h: mx.array,
    onehot_t: mx.array,
    onehot_prev: mx.array,
    next_embedding: mx.array | None = None,
) -> mx.array:
    """concat[h [O,B,H], onehot_t [O,B,E], onehot_prev [O,B,E]] -> [O, B, H + 2E]; with
    `next_embedding` [B, H] (next-token heads) every owner also gets it: [O, B, 2H + 2E].
    (Any lead shape: h [O, ..., H] with next_embedding [..., H].)"""
    if h.shape[:-1] != onehot_t.shape[:-1] or onehot_t.shape != onehot_prev.shape:
        raise ValueError(
            f"feature shapes disagree: h {h.shape}, onehot_t {onehot_t.shape}, "
            f"onehot_prev {onehot_prev.shape}"
        )
    dtype = h.dtype if mx.issubdtype(h.dtype, mx.floating) else mx.float32
    feats = mx.concatenate(
        [h.astype(dtype), onehot_t.astype(dtype), onehot_prev.astype(dtype)], axis=-1
    )
    return (
        feats
        if next_embedding is None
        else append_next_embedding(feats, next_embedding)
    )


def append_next_embedding(feats: mx.array, next_embedding: mx.array) -> mx.array:
    """Context features [O, ..., H + 2E] + the next token's embedding [..., H], the same for
    every owner -> next-token heads' features [O, ..., 2H + 2E]."""
    if tuple(next_embedding.shape[:-1]) != tuple(feats.shape[1:-1]):
        raise ValueError(
            f"next-token embedding has shape {next_embedding.shape}, expected "
            f"{tuple(feats.shape[1:-1])} + (hidden,)"
        )
    emb = mx.broadcast_to(
        next_embedding.astype(feats.dtype)[None], feats.shape[:1] + next_embedding.shape
    )
    return mx.concatenate([feats, emb], axis=-1)


# -- plans and staging ----------------------------------------------------------------------


class Prerouter:
    """The heads and their staging: a step's features in, the next step's `Plans` out."""

    def __init__(
        self,
        heads: PrerouterHeads,
        blocks: dict,
        rule,
        experts_per_token: int,
        counters: Counters,
        embedding,
        measure_recall: bool = False,
    ):
        cfg = heads.config
        self.heads, self.blocks, self.experts_per_token, self.counters = (
            heads,
            blocks,
            experts_per_token,
            counters,
        )
        self.owners, self.consumers = list(cfg.owners), list(cfg.consumers)
        self.consumer_of = dict(zip(self.owners, self.consumers))
        # The heads in the order their consumers run: a wrap head's first MoE layer is needed
        # first though its owner is the last.
        self.order = sorted(range(len(self.consumers)), key=self.consumers.__getitem__)
        self.next_token = bool(cfg.next_token)
        self.embedding = embedding
        # The consumers' routing rules stacked (step.stack_rules): the heads' selection.
        self.rule = rule
        # Owners whose consumer runs later in the same pass (a chunk plans them in the pass);
        # the wrap-around head's consumer runs first.
        self.ahead = {o for o, c in self.consumer_of.items() if c == o + 1}
        self.wrap = next(((o, c) for o, c in self.consumer_of.items() if c <= o), None)
        # a draft-token hedge of `draft_layers` (engine/draft.py's DraftHead, attached by
        # engine/heads.py: this module never imports it, which imports LoRA and the families)
        self.draft = None
        self.draft_layers: list[int] = []
        for owner in self.owners:
            blocks[owner].capture = True
        for layer in self.consumers if measure_recall else ():
            blocks[layer].recall = []

    def after_step(
        self, plans: Plans | None, h: mx.array, samplers: list | None, *, stage: bool
    ) -> Plans:
        """The next step's plans from this step's features: each row's last position (its
        t-1 one-hot from the position before it, else the carried one, else zeros). Context
        heads plan and stage now; next-token heads wait for the tokens, a draft hedge staging
        its guess meanwhile from the last layer's output `h`. Without `stage`, features only."""
        xs, ids = zip(*(self.blocks[n].last for n in self.owners))
        x = mx.stack([x[:, -1] for x in xs])
        num_experts = self.heads.config.num_experts
        now = onehot(mx.stack([i[:, -1] for i in ids]), num_experts, x.dtype)
        if xs[0].shape[1] >= 2:
            prev = onehot(mx.stack([i[:, -2] for i in ids]), num_experts, x.dtype)
        else:
            prev = None if plans is None else plans.onehot
            prev = mx.zeros_like(now) if prev is None else prev
        following = Plans(build_features(x, now, prev), now)
        if not stage:
            return following
        if not self.next_token:
            return self.plan(following)
        return following if self.draft is None else self.hedge(following, h, samplers)

    def plan(
        self, plans: Plans, tokens: mx.array | None = None, *, stage: bool = True
    ) -> Plans:
        """Every consuming layer's experts for the step about to run, per row, from
        `plans.feats` (next-token heads: with the embeddings of `tokens` [B], or the hedge's
        selection when every row's token is its draft); with `stage`, each layer's union of
        its rows' sets starts loading, in the order the step runs its layers."""
        c = self.counters
        started, waits = time.perf_counter(), c.eval_wait_seconds
        selected = None
        if self.next_token and plans.drafted is not None:
            matches = int((np.array(tokens) == plans.drafted[0]).sum())
            c.draft_rows += len(plans.drafted[0])
            c.draft_matches += matches
            if matches == len(plans.drafted[0]):
                selected = plans.drafted[1]
        if selected is None:
            feats = plans.feats
            if self.next_token:
                feats = append_next_embedding(plans.feats, self.embedding(tokens))
            selected = self.rule.select(self.heads(feats), self.experts_per_token)
        inds = selected[0]  # [O, B, K]
        staged = {}
        if stage:
            evaluate(c, inds, plans.onehot)
            c.head_host_seconds += (
                time.perf_counter() - started - (c.eval_wait_seconds - waits)
            )
            staged = self._stage(np.array(inds), self.consumers, plans.hedges)
        layers = {
            self.consumers[o]: (inds[o][:, None], staged.get(self.consumers[o]))
            for o in self.order
        }
        return Plans(plans.feats, plans.onehot, layers)

    def hedge(self, plans: Plans, h: mx.array, samplers: list | None) -> Plans:
        """Draft each row's next token (with its sampler's noise, where it samples), select
        the next-token heads' sets at the drafts and start reading the hedged layers'."""
        c = self.counters
        started, waits = time.perf_counter(), c.eval_wait_seconds
        tokens = self.draft(h, samplers)
        selected = self.rule.select(
            self.heads(append_next_embedding(plans.feats, self.embedding(tokens))),
            self.experts_per_token,
        )
        evaluate(c, tokens, selected)
        c.hedge_host_seconds += (
            time.perf_counter() - started - (c.eval_wait_seconds - waits)
        )
        hedges = self._stage(np.array(selected[0]), self.draft_layers)
        drafted = (np.array(tokens), selected)
        return Plans(plans.feats, plans.onehot, hedges=hedges, drafted=drafted)

    def _stage(
        self, ids: np.ndarray, layers: list[int], hedges: dict | None = None
    ) -> dict[int, StagedSet]:
        """Start reading each of `layers`' union of the rows' ids [O, B, K] (rows parallel to
        the consumers), earliest layer first (the store also serves prefetches by layer).
        With `hedges` (routed sets: {} when there are none), each hedged layer takes over its
        hedge's reads, and the sets are counted."""
        c, staged = self.counters, {}
        for o in self.order:
            layer = self.consumers[o]
            if layer not in layers:
                continue
            union = list(dict.fromkeys(ids[o].reshape(-1).tolist()))  # first-seen order
            hedge = None if hedges is None else hedges.get(layer)
            # A hedge's reads (hedges None: this is one) are cancelled one by one.
            staged[layer] = s = self.blocks[layer].switch_mlp.stage_begin(
                union, hedge=hedge, cancellable=hedges is None
            )
            if hedges is None:
                continue
            if s.hedge is not None:
                c.hedge_staged += s.hedge.staged
                c.hedge_hits += s.hedge.hits
                c.hedge_cancelled += s.hedge.cancelled
                c.hedge_wasted += s.hedge.wasted
            c.staged_experts += len(s.experts)
            c.staged_layers += 1
            c.staged_loads += len(s.loads)
        return staged

    def finish(self, layer: int, staged: StagedSet) -> None:
        """Wait for a consuming layer's staged reads and publish its slots."""
        waited, dropped = self.blocks[layer].switch_mlp.stage_finish(staged)
        self.counters.stage_wait_seconds += waited
        self.counters.dropped_experts += dropped

    def abandon(self, plans: Plans) -> None:
        """Rows left or joined after `plans` were staged: their reads land in the slots (where
        the next plan finds most of them), uncounted as staged sets since they never run."""
        c = self.counters
        for layer, (_, staged) in sorted(plans.layers.items()):
            c.stage_wait_seconds += self.blocks[layer].switch_mlp.stage_finish(staged)[
                0
            ]
            c.staged_experts -= len(staged.experts)
            c.staged_layers -= 1
            c.abandoned_plans += 1
        for layer, staged in sorted(plans.hedges.items()):
            c.stage_wait_seconds += self.blocks[layer].switch_mlp.stage_finish(staged)[
                0
            ]

    def predict(self, owner: int, tokens: mx.array, plans: Plans) -> mx.array:
        """In a pass over L > 1 positions: the ids [B, L, K] `owner`'s head predicts for its
        consumer at every position's next one, from the features of every position at once
        (t-1's one-hot: the carried one at position 0; next-token heads: token t+1's
        embedding, zeros after the last)."""
        x, ids = self.blocks[owner].last
        now = onehot(ids, self.heads.config.num_experts, x.dtype)
        o = self.owners.index(owner)
        first = (
            mx.zeros_like(now[:, :1])
            if plans.onehot is None
            else plans.onehot[o][:, None]
        )
        following = None
        if self.next_token:
            emb = self.embedding(tokens)
            following = mx.concatenate([emb[:, 1:], mx.zeros_like(emb[:, :1])], axis=1)
        prev = mx.concatenate([first, now[:, :-1]], axis=1)
        feats = build_features(x[None], now[None], prev[None], following)
        logits = self.heads.select_owners([owner])(feats)[0]
        return self.blocks[self.consumer_of[owner]].rule.select(
            logits, self.experts_per_token
        )[0]

    def stats(self) -> dict:
        c = self.counters
        steps = max(1, c.prerouted_steps)
        out = {
            "prerouted_steps": c.prerouted_steps,
            "staged_experts": c.staged_experts,
            "staged_loads_per_step": c.staged_loads / steps,
            "dropped_experts": c.dropped_experts,
            "abandoned_plans": c.abandoned_plans,
            "mean_staged_union": c.staged_experts / c.staged_layers
            if c.staged_layers
            else 0.0,
            "stage_wait_ms_per_step": 1000 * c.stage_wait_seconds / steps,
            "early_evals_per_step": c.early_evals / steps,
            "head_host_ms_per_step": 1000 * c.head_host_seconds / steps,
            "prerouter_owners": len(self.owners),
            "prerouter_wrap_around": self.wrap is not None,
            # Chunks (teacher forcing, prefill pieces with plans) under a wrap-around head.
            "wrap_passes_per_chunk": c.wrap_passes / c.wrap_chunks
            if c.wrap_chunks
            else None,
            "prerouter_features": "next_token" if self.next_token else "context",
        }
        if self.draft is not None:
            out.update(
                {
                    "hedge_layers": list(self.draft_layers),
                    "hedge_kind": f"draft token ({self.draft.ids.size} ids)",
                    "hedge_precision": c.hedge_hits / c.hedge_staged
                    if c.hedge_staged
                    else None,
                    "hedge_cancelled_per_step": c.hedge_cancelled / steps,
                    "hedge_wasted_loads_per_step": c.hedge_wasted / steps,
                    "hedge_host_ms_per_step": 1000 * c.hedge_host_seconds / steps,
                    "draft_match_rate": c.draft_matches / c.draft_rows
                    if c.draft_rows
                    else None,
                }
            )
        recalls = [
            r for layer in self.consumers for r in self.blocks[layer].recall or ()
        ]
        if self.blocks[self.consumers[0]].recall is not None:
            out["online_recall"] = (
                float(mx.mean(mx.stack(recalls)).item()) if recalls else None
            )
        return out
