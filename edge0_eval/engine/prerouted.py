"""Prerouted decode: prediction-as-routing with staged reads that overlap compute.

After each decode step every prerouter head runs in one batched computation on the step's
features; the predicted expert set of each consuming layer (owner + 1, or for the wrap-around
head, owned by the last MoE layer, the first MoE layer) starts loading in the background at once,
and during the next step each consuming layer executes exactly that set.
The heads also run once on the prompt's last token after prefill, so the first decode token is
prerouted too (on the true router it would be one fully blocking step per generation). Layers
before `start_layer` and prefill itself route with the true router; with a wrap-around head
(start layer 0) every MoE layer of every decode step is prerouted.

Next-token heads (`config.next_token`) also read the embedding of the token the step is about to
consume, so their plan cannot run after the last layer: the step's features wait, and
`plan_tokens` plans when the next forward receives its tokens (the sampled ones, or the forced
ones when scoring), before its first layer. Their reads then no longer overlap the LM head.

Hedged staging (`set_draft`, engine/draft.py: a draft vocabulary, a file of its own). After the
step's last layer, the hedge drafts each row's token from a slice of the LM head and stages the
next-token heads' own sets at that draft, so reads overlap the LM head although the token is
not known yet. When the token is known the next-token heads route as before; each hedged layer
then reads only what its hedge missed, and the hedge's reads of experts outside the routed set
are cancelled where they have not started (`StreamingSwitchGLU.stage_begin`). So routed ⊆
staged, not =: the routing, and every logit, are those of the next-token heads alone; the
hedge only changes when bundles are read, and wastes the reads of its misses that had already
run (counted). When the served tokens equal the drafts, the hedge's sets are the routing, and
the plans computed for it are used as they are. (Mixed heads and hedges of context heads were
deleted, issue 26: reports/variants.md.)

A consuming layer's plan and the pin of its switch (its experts are in the slots: no host
sync) are installed together in `before_layer` and removed together in `after_step`/`reset`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from edge0_eval.errors import CheckpointError, ConfigError
from edge0_eval.engine.draft import DraftHead, is_draft_file, load_draft_vocab
from edge0_eval.engine.mlx_compat import resolve_compute_dtype
from edge0_eval.engine.moe import StagedSet
from edge0_eval.engine.heads_file import KIND, load_heads, read_metadata
from edge0_eval.engine.prerouter import (PrerouterHeads, append_next_embedding, consumer_rule,
                                         pair_problems, trace_features)


@dataclass
class StagingCounters:
    steps: int = 0                  # decode steps that ran prerouted
    staged_experts: int = 0         # experts staged: per consuming layer per step, the union
    #                                 of the rows' planned sets (K at B = 1)
    staged_layers: int = 0          # (step, consuming layer) stagings
    abandoned_plans: int = 0        # batched decode: layer plans dropped as rows left/joined
    staged_loads: int = 0           # of those, bundles read (misses)
    dropped_experts: int = 0        # planned experts absent from the slots at execution: must be 0
    stage_wait_seconds: float = 0.0
    head_seconds: float = 0.0
    hedge_seconds: float = 0.0
    hedge_staged: int = 0           # experts the hedge staged (per hedged layer per step)
    hedge_hits: int = 0             # of those, in the routed set
    hedge_cancelled: int = 0        # misses whose reads never started
    hedge_wasted: int = 0           # misses read anyway (bundles read in vain this step)
    draft_rows: int = 0             # draft hedge: rows whose token was drafted
    draft_matches: int = 0          # of those, served the drafted token


class Prerouter:
    """Owns the heads, the plans for the next step and the in-flight staged reads."""

    def __init__(self, engine, heads: PrerouterHeads, measure_recall: bool = False):
        self.engine = engine
        self.config = cfg = heads.config
        self.owners = list(cfg.owners)
        self.start_layer = cfg.start_layer
        problems = pair_problems(self.owners, cfg.consumers, engine.moe_layers)
        if problems:
            raise CheckpointError(f"prerouter heads do not fit this model: {'; '.join(problems)} "
                                  f"(MoE layers: {engine.moe_layers})")
        self.consumers = list(cfg.consumers)     # parallel to self.owners
        self.measure_recall = measure_recall
        self.counters = StagingCounters()
        self._prev_onehot = self._feats = None
        self.next_token = bool(cfg.next_token)
        self._awaiting_tokens = False           # next-token heads: features wait for the tokens
        self._embedding = engine.family.embedding(engine.model) if self.next_token else None
        self._plans: dict[int, tuple] = {}      # consuming layer -> (inds, staged set)
        self._hedges: dict[int, StagedSet] = {}  # hedged layer -> the draft hedge's staged set
        for owner in self.owners:
            engine.blocks[owner].set_capture(True)
        self.heads = heads
        self.rule = consumer_rule(engine, self.consumers)
        self.draft: DraftHead | None = None     # a draft-token hedge, for `draft_layers`
        self.draft_layers: list[int] = []
        self._drafted: tuple | None = None      # (draft tokens [B], (inds, weights))

    def set_draft(self, ids: mx.array, n_layers: int | None = None) -> None:
        """Hedge with the next-token heads at a token drafted among `ids` (draft vocabulary,
        most frequent first), staging their first `n_layers` layers in step order (None: all)."""
        if not self.next_token:
            raise ConfigError("a hedge serves next-token prerouter heads, whose plans wait for "
                              "the token; these heads plan before the LM head already")
        late = sorted(self.consumers)
        if n_layers is not None:
            if not 1 <= n_layers <= len(late):
                raise ConfigError(f"hedge_layers {n_layers}: the next-token heads plan "
                                  f"{len(late)} layers; choose 1 to {len(late)}")
            late = late[:n_layers]
        family, model = self.engine.family, self.engine.model
        self.draft = DraftHead(*family.output_head(model), ids)
        self.draft_layers = late

    def owner_heads(self, owner: int) -> PrerouterHeads:
        """The heads of one owner as the engine runs them: the served training path plans
        with these."""
        return self.heads.select_owners([owner])

    # -- per sequence -----------------------------------------------------------------------
    def reset(self) -> None:
        self._prev_onehot = self._feats = None
        self._awaiting_tokens = False
        self._drain()
        self._plans = {}
        self._clear_plans()

    def _clear_plans(self) -> None:
        for layer in self.consumers:
            block = self.engine.blocks[layer]
            block.set_plan(None)
            block.switch_mlp.pin(False)

    def _drain(self) -> None:
        staged_sets = [staged for _, staged in self._plans.values()]
        staged_sets += self._hedges.values()
        self._hedges, self._drafted = {}, None
        for staged in staged_sets:
            for f in staged.futures:
                f.cancel()
            for f in staged.futures:
                if not f.cancelled():
                    try:
                        f.result()
                    except Exception:
                        pass
            # The reserved slots were never written: forget them so nothing trusts them.
            block = self.engine.blocks[staged.layer]
            for e, _ in staged.loads:
                block.switch_mlp.slots.forget(e)

    # -- hooks used by the engine -----------------------------------------------------------
    @property
    def has_plan(self) -> bool:
        """Staged plans wait for the next forward's layers."""
        return bool(self._plans)

    @property
    def rows_planned(self) -> bool:
        """The current rows' next step is planned: staged, or waiting for their tokens (and
        maybe hedged). Rows leaving or joining drop it (`abandon_plans`)."""
        return self.has_plan or self._awaiting_tokens

    def before_layer(self, layer: int, h: mx.array | None) -> None:
        """Called as layer `layer` is about to be built (h: the previous layer's output, None
        before layer 0): finish its staging and set its plan."""
        plan = self._plans.pop(layer, None)
        if plan is None:
            return
        inds, staged = plan
        if h is not None:
            mx.async_eval(h)  # let earlier layers compute while this layer's reads finish
        block = self.engine.blocks[layer]
        waited, dropped = block.switch_mlp.stage_finish(staged)
        self.counters.stage_wait_seconds += waited
        self.counters.dropped_experts += dropped
        block.set_plan(inds)    # weighted by the layer's own router at the planned experts
        block.switch_mlp.pin(True)      # the plan's experts are in the slots now
        if self.measure_recall:
            block.set_measure_recall(True)

    def after_prefill(self, prompt_tokens: int) -> None:
        """Plan the first decode step from the prompt's last token, as after_step plans the next."""
        self.reset()
        self.set_rows(None, [self.prefill_features(prompt_tokens)])
        self.plan_rows()

    def prefill_features(self, prompt_tokens: int) -> tuple[mx.array, mx.array]:
        """(feats [O, 1, in], onehot_t [O, 1, E]) of the prompt's last token, just prefilled.

        Its t-1 features come from the token before it (prefill keeps the two in one chunk);
        a one-token prompt has zeros there, as the first token of a document has in training.
        """
        prev = None
        if prompt_tokens >= 2 and self._chunk_length() >= 2:   # prefill_chunk=1 has no t-1
            _, prev = trace_features(self.engine, self.owners, position=-2)
        return trace_features(self.engine, self.owners, prev)

    def after_step(self, h: mx.array | None = None, samplers: list | None = None) -> None:
        """Run all heads on this step's features and start staging the next step's sets (h:
        the last layer's output, which a draft hedge drafts the next tokens from, with the
        rows' samplers' noise)."""
        self._clear_plans()
        self._feats, self._prev_onehot = trace_features(self.engine, self.owners,
                                                        self._prev_onehot)
        self.plan_rows(h, samplers)

    # -- rows (batched decode) --------------------------------------------------------------
    # The per-row state, [O, B, ...] in the batch's row order: the features the next plan runs
    # on and each row's one-hot of its last token (the next step's t-1).
    def set_rows(self, keep: list[int] | None, joining: list[tuple[mx.array, mx.array]]
                 ) -> None:
        """Keep rows `keep` (None: all; []: none), then append the joining rows' prefill
        features (`prefill_features` of each)."""
        feats, onehot = self._feats, self._prev_onehot
        if keep is not None and feats is not None:
            if keep:
                idx = mx.array(keep, dtype=mx.int32)
                feats, onehot = feats[:, idx], onehot[:, idx]
            else:
                feats = onehot = None
        parts = ([(feats, onehot)] if feats is not None else []) + list(joining)
        if parts:
            feats = mx.concatenate([f for f, _ in parts], axis=1)
            onehot = mx.concatenate([o for _, o in parts], axis=1)
        self._feats, self._prev_onehot = feats, onehot

    def plan_rows(self, h: mx.array | None = None, samplers: list | None = None) -> None:
        """Plan the next step of the current rows (after_step does it inside the forward);
        next-token heads wait for the rows' tokens (`plan_tokens`). A draft hedge needs the
        last layer's output `h`: after a prefill or a change of rows the LM head has run
        already, and that step goes unhedged."""
        if self.next_token:
            self._awaiting_tokens = self._feats is not None
        elif self._feats is not None:
            self.plan(self._feats, self._prev_onehot)
        if self.draft is not None and self._awaiting_tokens and h is not None:
            self._stage_draft(h, samplers)

    def _stage_hedge_sets(self, consumers: list[int], ids: np.ndarray, layers: set[int]
                          ) -> None:
        """Start reading, in step order, each of `layers`' hedge set: the union of the rows'
        predicted experts `ids` [O, B, K] (rows parallel to `consumers`)."""
        for o in sorted(range(len(consumers)), key=consumers.__getitem__):
            layer = consumers[o]
            if layer in layers:
                union = list(dict.fromkeys(ids[o].reshape(-1).tolist()))
                staged = self.engine.blocks[layer].switch_mlp.stage_begin(union)
                staged.layer = layer
                self._hedges[layer] = staged

    def _stage_draft(self, h: mx.array, samplers: list | None) -> None:
        """Draft each row's next token (with its sampler's noise, where it samples), plan the
        next-token heads at the drafts and start reading the draft layers' sets (the union of
        the rows')."""
        assert not self._hedges, "a hedge staged twice: the last one was never consumed"
        started = time.perf_counter()
        tokens = self.draft(h, samplers)
        selected = self.rule.select(self.heads(append_next_embedding(
            self._feats, self._embedding(tokens))), self.engine.top_k)
        mx.eval(tokens, selected)
        self.counters.hedge_seconds += time.perf_counter() - started
        self._drafted = (np.array(tokens), selected)
        self._stage_hedge_sets(self.consumers, np.array(selected[0]), set(self.draft_layers))

    def plan_tokens(self, tokens: mx.array) -> None:
        """Next-token heads: plan the step about to consume `tokens` [B] (one per row, in row
        order) from the waiting features and those tokens' input embeddings (or, where every
        row's token is its draft, with the plans the draft hedge computed: the same heads on
        the same inputs)."""
        if not self._awaiting_tokens:
            return
        self._awaiting_tokens = False
        rows = self._feats.shape[1]
        if tokens.shape != (rows,):
            raise ValueError(f"plan_tokens got tokens of shape {tokens.shape} for {rows} rows")
        drafted, self._drafted = self._drafted, None
        if drafted is not None:
            matches = int((np.array(tokens) == drafted[0]).sum())
            self.counters.draft_rows += rows
            self.counters.draft_matches += matches
            if matches == rows:
                self.plan(None, self._prev_onehot, selected=drafted[1])
                return
        self.plan(append_next_embedding(self._feats, self._embedding(tokens)), self._prev_onehot)

    def abandon_plans(self) -> None:
        """Rows left or joined after the last step planned: finish the in-flight reads (their
        experts land in the slots, where the next plan finds most of them) and drop the plans,
        uncounted as staged sets since they never run."""
        for layer, (_, staged) in sorted(self._plans.items()):
            waited, _ = self.engine.blocks[layer].switch_mlp.stage_finish(staged)
            self.counters.stage_wait_seconds += waited
            self.counters.staged_experts -= len(staged.experts)
            self.counters.staged_layers -= 1
            self.counters.abandoned_plans += 1
        for layer, staged in sorted(self._hedges.items()):
            waited, _ = self.engine.blocks[layer].switch_mlp.stage_finish(staged)
            self.counters.stage_wait_seconds += waited
        self._plans, self._hedges, self._drafted = {}, {}, None
        self._awaiting_tokens = False

    def _chunk_length(self) -> int:
        return self.engine.blocks[self.owners[0]].captured()[0].shape[1]

    def plan(self, feats: mx.array | None, *also,
             selected: tuple[mx.array, mx.array] | None = None) -> None:
        """Plan the next step of every row from `feats` [O, B, in], or with the heads'
        `selected` (inds, weights) already computed from them, and start staging.

        Each row keeps its own predicted set as its routing ([B, 1, K] plans); each consuming
        layer stages the union of its rows' sets (needs that many slots: the engine sizes the
        pool for batched decode), so every row's staged set is its routed set.
        """
        engine = self.engine
        started = time.perf_counter()
        # One batched computation for all heads, then each consumer's selection rule.
        inds, _ = selected or self.rule.select(self.heads(feats), engine.top_k)
        mx.eval(inds, *also)                                                     # [O, B, K]
        self.counters.head_seconds += time.perf_counter() - started
        ids = np.array(inds)
        # Queue the reads in the order the next step runs its layers: a wrap head's first MoE
        # layer is needed first, though its owner is the last (the store also orders queued
        # prefetches by layer).
        consumers = self.consumers
        for o in sorted(range(len(consumers)), key=consumers.__getitem__):
            layer = consumers[o]
            union = list(dict.fromkeys(ids[o].reshape(-1).tolist()))   # first-seen order
            staged = engine.blocks[layer].switch_mlp.stage_begin(
                union, hedge=self._hedges.pop(layer, None))
            staged.layer = layer
            if staged.hedge is not None:
                c, h = self.counters, staged.hedge
                c.hedge_staged += h.staged
                c.hedge_hits += h.hits
                c.hedge_cancelled += h.cancelled
                c.hedge_wasted += h.wasted
            self.counters.staged_experts += len(staged.experts)
            self.counters.staged_layers += 1
            self.counters.staged_loads += len(staged.loads)
            self._plans[layer] = (inds[o][:, None], staged)

    def stats(self) -> dict:
        c = self.counters
        steps = max(1, c.steps)
        out = {
            "prerouted_steps": c.steps,
            "staged_experts": c.staged_experts,
            "staged_loads_per_step": c.staged_loads / steps,
            "dropped_experts": c.dropped_experts,
            "abandoned_plans": c.abandoned_plans,
            "mean_staged_union": c.staged_experts / c.staged_layers if c.staged_layers else 0.0,
            "stage_wait_ms_per_step": 1000 * c.stage_wait_seconds / steps,
            "head_ms_per_step": 1000 * c.head_seconds / steps,
            "prerouter_owners": len(self.owners),
            "prerouter_wrap_around": any(c != o + 1 for o, c in zip(self.owners, self.consumers)),
            "prerouter_features": "next_token" if self.next_token else "context",
        }
        if self.draft is not None:
            out.update({
                "hedge_layers": list(self.draft_layers),
                "hedge_kind": f"draft token ({self.draft.ids.size} ids)",
                "hedge_precision": c.hedge_hits / c.hedge_staged if c.hedge_staged else None,
                "hedge_cancelled_per_step": c.hedge_cancelled / steps,
                "hedge_wasted_loads_per_step": c.hedge_wasted / steps,
                "hedge_ms_per_step": 1000 * c.hedge_seconds / steps,
                "draft_match_rate": c.draft_matches / c.draft_rows if c.draft_rows else None,
            })
        if self.measure_recall:
            values = [r for layer in self.consumers
                      for r in self.engine.blocks[layer].recalls()]
            out["online_recall"] = float(mx.mean(mx.stack(values)).item()) if values else None
        return out


def attach_prerouter(engine, path: Path) -> Prerouter:
    """Load the heads in `path` (and the draft hedge, if any) for `engine` (resolved by
    EngineOptions.resolve); hook them in."""
    options = engine.options
    prerouter = Prerouter(engine, _load_heads(engine, path),
                          measure_recall=options.measure_recall)
    hedge_path = engine.resolved.hedge_path
    if hedge_path is not None:
        try:
            if not is_draft_file(hedge_path) and _holds_heads(hedge_path):
                raise CheckpointError(f"{hedge_path} holds prerouter heads: hedges of context "
                                      f"heads are no longer served (issue 26); pass a draft "
                                      f"vocabulary from `edge0-eval draft-vocab` (--hedge), or "
                                      f"none (--no-hedge)")
            vocab = engine.family.embedding(engine.model).weight.shape[0]
            prerouter.set_draft(load_draft_vocab(hedge_path, vocab), options.hedge_layers)
        except ConfigError as exc:
            raise CheckpointError(f"{hedge_path}: {exc} (prerouter heads: {path}); pass other "
                                  f"hedge heads (--hedge) or none (--no-hedge)") from None
    return prerouter


def _holds_heads(path: Path) -> bool:
    try:
        return read_metadata(path).get("kind") == KIND
    except CheckpointError:
        return False            # the draft loader reports what is wrong with it


def _load_heads(engine, path: Path) -> PrerouterHeads:
    return load_heads(path, hidden=engine.family.hidden_size(engine.config),
                      num_experts=engine.index.num_experts, top_k=engine.top_k,
                      model_type=engine.config.get("model_type"),
                      moe_layers=engine.moe_layers,
                      dtype=resolve_compute_dtype(engine.options.compute_dtype))
