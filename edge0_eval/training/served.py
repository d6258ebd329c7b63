"""The student's served path over whole (teacher-forced) sequences, with gradients.

Serving (engine.generate) runs a prompt with the true router; from the first decode step on
(its input is the first generated token), every consuming layer c = owner + 1 executes the set
that the prerouter head of owner c-1 predicted from the previous token's features (h_{c-1}(t-1),
onehot(executed at c-1, t-1), onehot(executed at c-1, t-2)), with the router's combination weights
at that set. Layers that consume no head route truly.

For a full sequence this is computed layer by layer in one forward pass: after layer N has run
over all positions, its MoE input and executed sets are known everywhere, so head N runs over
all positions at once, its logits are shifted one position to the right and become layer N+1's
plan at every prerouted position. Positions t with t < n_true[b] (the prompt) keep the true
router. This is the served computation exactly (same modules,
same heads, same selection rule), not an approximation. Next-token heads see token t+1's input
embedding with position t's features, as `Prerouter.plan_tokens` gives them when serving.

The wrap-around head (owner: the last MoE layer, consumer: the first MoE layer, start layer 0)
breaks that layer order: position p's first MoE layer needs position p-1's last layer. With it,
the discovery pass runs position by position with a KV cache, exactly as decode does (every head
plans position p from position p-1; positions t < n_true route truly, the first always). The
gradient pass still runs the whole sequence at once, replaying the discovered ids.

A training step needs two passes (`ServedPath.discover`, then `ServedPath.forward` inside
`mx.value_and_grad`):

1. discover (no gradient, the engine's serving mode): the switches load whatever is routed
   (reactive, host sync allowed) and every MoE layer's executed ids are recorded [B, L, K].
2. the caller loads the union of each layer's ids into the slot pool (`load_routed`) and pins the
   switches; the gradient pass *replays* the executed ids as fixed plans (no re-selection, so it
   cannot route to an expert that is not resident) while the combination weights are recomputed
   differentiably from the router's softmax/sigmoid at every position, as served.
   Gradients therefore flow through the routing weights into the LoRA, as in the served function.

Nothing is patched: every MoE block gets a `TrainingPlan` through its planner interface
(`set_planner`, engine/moe.py), and the decoder layers are called through the family forward's
`call` argument, which runs each layer under `mx.checkpoint` for gradient checkpointing. The MoE
input that the next layer's head needs crosses the checkpoint boundary as an explicit output so
its gradient is kept.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from mlx_lm.models.cache import make_prompt_cache

from edge0_eval.engine.prerouter import RoutingRule, build_features, onehot
from edge0_eval.errors import ConfigError
from edge0_eval.training.options import MODES


@dataclass
class TrainingPlan:
    """One MoE block's routing for one pass; the block calls it with its input (`set_planner`).

    inds: fixed ids to replay [B, L, K] (the gradient pass), or None: select now (discover), the
    true router's choice except where `mask` marks a prerouted position and `plan_inds` (the
    head's choice) is given. Weights are recomputed differentiably from the router.
    """

    inds: mx.array | None = None
    mask: mx.array | None = None
    plan_inds: mx.array | None = None

    def __call__(self, block, x: mx.array) -> tuple[mx.array, mx.array]:
        inds = self.inds
        if inds is None:
            true, _ = _true_route(block, x)
            inds = true if self.plan_inds is None else mx.where(self.mask[..., None],
                                                                self.plan_inds, true)
        return inds, block.combine(block.router_probs(x), inds)


def _true_route(block, x):
    if hasattr(block, "select"):                       # qwen: softmax top-k
        return block.select(block.router_probs(x), block.top_k)
    return block.gate(x)                               # bailing: mlx-lm's Gate


# -- plans -----------------------------------------------------------------------------------------

@dataclass
class Discovery:
    """What the no-gradient pass routed: executed ids per MoE layer, as host arrays."""

    inds: dict[int, np.ndarray]           # layer -> [B, L, K] int32
    mask: np.ndarray                      # [B, L] bool: prerouted positions
    valid: np.ndarray                     # [B, L] bool: real (non-padding) positions
    logits: mx.array | None = None        # student logits of the pass (when asked for)
    planned_layers: list[int] = field(default_factory=list)

    def unions(self, rows: np.ndarray | None = None) -> dict[int, list[int]]:
        """Distinct experts each layer routed to at the valid positions of `rows` (all rows)."""
        out = {}
        for layer, ids in self.inds.items():
            sel = ids if rows is None else ids[rows]
            valid = self.valid if rows is None else self.valid[rows]
            out[layer] = np.unique(sel[valid]).astype(int).tolist()
        return out


class ServedPath:
    """Trainable full-sequence forward of an engine's student, routed exactly as served."""

    def __init__(self, engine, grad_checkpoint: bool = False):
        mode = engine.options.mode                # trained as served: the engine's own mode
        if mode not in MODES:
            raise ConfigError(f"training runs the student in mode {' or '.join(MODES)}, not "
                              f"{mode!r}")
        self.engine = engine
        self.mode = mode
        self.model = engine.model
        self.family = engine.family
        self.layers = self.family.layers(self.model)
        self.n_layers = len(self.layers)
        self.moe = list(engine.moe_layers)
        self.blocks = engine.blocks
        self.top_k = engine.top_k
        self.clip = engine.clip
        self.grad_checkpoint = grad_checkpoint
        self.owner_of: dict[int, int] = {}      # consumer layer -> owner layer (owner + 1)
        self.heads = {}
        self.rules = {}
        self.wrap: tuple[int, int] | None = None    # (owner, consumer) of a wrap-around head
        if mode == "prerouted":
            pr = engine.prerouter
            if pr is None:
                raise ConfigError("prerouted training needs prerouter heads, and the engine has "
                                  "none loaded")
            for owner, consumer in zip(pr.owners, pr.consumers):
                if consumer == owner + 1:
                    self.owner_of[consumer] = owner
                else:
                    self.wrap = (owner, consumer)
                self.heads[owner] = pr.owner_heads(owner)
                self.rules[consumer] = RoutingRule.from_block(self.blocks[consumer])
        self.owners = sorted(self.owner_of.values())
        self.planned = sorted(self.owner_of) + ([self.wrap[1]] if self.wrap else [])
        self._plans: dict[int, TrainingPlan] = {}       # MoE layer -> its plan of this pass
        self._inputs: dict[int, mx.array] = {}          # MoE layer -> its input of this pass
        self._checkpoint = False
        self._saved_capture = {}
        for layer in self.moe:
            block = self.blocks[layer]
            self._saved_capture[layer] = block.capturing
            block.set_capture(True)
        self.closed = False

    def close(self) -> None:
        """Give the engine back its serving behaviour (planners removed, switches unpinned)."""
        if self.closed:
            return
        self.clear_plans()
        for layer in self.moe:
            block = self.blocks[layer]
            block.set_capture(self._saved_capture[layer])
            block.switch_mlp.pin(False)
        self.closed = True

    # -- passes -------------------------------------------------------------------------------
    def _call_layer(self, i: int, layer, x, *args, **kwargs):
        """How the family forward calls decoder layer i: plainly, or under mx.checkpoint."""
        plan = self._plans.get(i)
        block = self.blocks.get(i)
        if not self._checkpoint:
            out = layer(x, *args, **kwargs)
            if block is not None:
                self._inputs[i] = block.captured()[0]
            return out

        def inner(params, x):
            # Also runs again during the backward pass, after the forward has returned: put
            # this layer's plan back so the recomputation routes exactly like the forward.
            layer.update(params)
            if plan is not None:
                block.set_planner(plan)
            out = layer(x, *args, **kwargs)
            side = block.captured()[0] if block is not None else None
            return (out, side) if side is not None else (out,)

        outs = mx.checkpoint(inner)(layer.trainable_parameters(), x)
        if len(outs) == 2:
            self._inputs[i] = outs[1]
        return outs[0]

    def _run(self, tokens: mx.array, mask: mx.array | None, replay: dict | None) -> mx.array:
        """One forward with plans; replay: layer -> fixed ids (None: select while running)."""
        self._plans = {}
        for layer in self.moe:
            plan = TrainingPlan(inds=None if replay is None else replay[layer], mask=mask)
            self._plans[layer] = plan
            self.blocks[layer].set_planner(plan)
        self._inputs = {}
        executed: dict[int, mx.array] = {}
        next_emb = self._next_embeddings(tokens)

        def hook(i: int, h: mx.array) -> mx.array:
            if self.clip:
                h = mx.clip(mx.nan_to_num(h, nan=0.0), -self.clip, self.clip)
            if i in self.blocks:
                executed[i] = self.blocks[i].captured()[1]
            consumer = i + 1
            # The gradient pass replays fixed ids: only the discovery selects from the heads.
            if consumer in self.owner_of and mask is not None and \
                    self._plans[consumer].inds is None:
                owner = self.owner_of[consumer]
                x = self._inputs[owner]                          # [B, L, H]
                ids = executed[owner]                            # [B, L, K]
                oh = onehot(ids, self.blocks[owner].num_experts, mx.float32)
                oh_prev = mx.concatenate([mx.zeros_like(oh[:, :1]), oh[:, :-1]], axis=1)
                heads = self.heads[owner]
                feats = build_features(x[None], oh[None], oh_prev[None],
                                       next_emb if heads.config.next_token else None)
                logits = heads(feats)[0]                         # [B, L, E]
                # The plan for token t comes from the features of token t-1.
                logits = mx.concatenate([logits[:, :1], logits[:, :-1]], axis=1)
                self._plans[consumer].plan_inds, _ = self.rules[consumer].select(logits,
                                                                                 self.top_k)
            return h

        cache = [None] * self.n_layers    # a cache-less full-sequence pass (causal masks)
        self._checkpoint = self.grad_checkpoint and replay is not None
        # The plans stay installed after the forward returns: a gradient transform may
        # recompute (checkpointed) layers later. `clear_plans()` removes them.
        return self.family.forward(self.model, tokens, cache, hook, self._call_layer)

    def _next_embeddings(self, tokens: mx.array) -> mx.array | None:
        """Next-token heads: position t's features end with token t+1's input embedding
        (the last position's plan is never used: zeros)."""
        if not any(heads.config.next_token for heads in self.heads.values()):
            return None
        emb = self.family.embedding(self.model)(tokens).astype(mx.float32)   # [B, L, H]
        return mx.concatenate([emb[:, 1:], mx.zeros_like(emb[:, :1])], axis=1)

    def clear_plans(self) -> None:
        """Back to plain serving behaviour of the blocks (call after the gradient pass)."""
        for layer in self.moe:
            self.blocks[layer].set_planner(None)
            self.blocks[layer].set_capture(True)
        self._plans, self._inputs = {}, {}
        self._checkpoint = False

    def discover(self, tokens: np.ndarray, valid: np.ndarray, n_true: np.ndarray,
                 keep_logits: bool = False) -> Discovery:
        """No-gradient pass in serving mode; records every MoE layer's executed ids.

        tokens [B, L] int, valid [B, L] bool (False = padding, at the end of a row), n_true [B]:
        positions t < n_true[b] route with the true router (the prompt).
        """
        for layer in self.moe:
            self.blocks[layer].switch_mlp.pin(False)
        mask = self._mask(tokens.shape, n_true)
        if self.wrap is not None:
            return self._discover_stepwise(tokens, valid, mask, keep_logits)
        logits = self._run(mx.array(tokens), None if mask is None else mx.array(mask), None)
        inds = {layer: self.blocks[layer].captured()[1] for layer in self.moe}
        mx.eval(logits, list(inds.values()))
        self.clear_plans()
        out = Discovery(inds={k: np.array(v).astype(np.int32) for k, v in inds.items()},
                        mask=np.zeros(tokens.shape, bool) if mask is None else mask,
                        valid=np.asarray(valid, bool),
                        logits=logits if keep_logits else None,
                        planned_layers=sorted(self.owner_of))
        return out

    def _discover_stepwise(self, tokens: np.ndarray, valid: np.ndarray, mask: np.ndarray,
                           keep_logits: bool) -> Discovery:
        """discover() with a wrap-around head: position by position with a KV cache, as decode
        runs; every head plans position p from position p-1's features."""
        length = tokens.shape[1]
        cache = make_prompt_cache(self.model)
        owners = sorted(self.heads)
        consumer_of = {o: c for c, o in self.owner_of.items()} | {self.wrap[0]: self.wrap[1]}
        prev_oh = {o: None for o in owners}
        next_logits: dict[int, mx.array] = {}          # consumer -> [B, 1, E] for position p
        inds = {layer: [] for layer in self.moe}
        outs = []
        e = self.blocks[owners[0]].num_experts
        next_emb = self._next_embeddings(mx.array(tokens))

        def hook(i: int, h: mx.array) -> mx.array:
            if self.clip:
                h = mx.clip(mx.nan_to_num(h, nan=0.0), -self.clip, self.clip)
            return h

        try:
            for p in range(length):
                m = mx.array(mask[:, p: p + 1])
                for layer in self.moe:
                    plan = TrainingPlan(mask=m)
                    if layer in next_logits:
                        plan.plan_inds, _ = self.rules[layer].select(next_logits[layer],
                                                                     self.top_k)
                    self.blocks[layer].set_planner(plan)
                logits = self.family.forward(self.model, mx.array(tokens[:, p: p + 1]), cache,
                                             hook)
                for layer in self.moe:
                    inds[layer].append(self.blocks[layer].captured()[1])
                for o in owners:
                    x, ids = self.blocks[o].captured()
                    oh = onehot(ids, e, mx.float32)
                    prev = mx.zeros_like(oh) if prev_oh[o] is None else prev_oh[o]
                    prev_oh[o] = oh
                    heads = self.heads[o]
                    feats = build_features(x[None], oh[None], prev[None],
                                           next_emb[:, p: p + 1] if heads.config.next_token
                                           else None)
                    next_logits[consumer_of[o]] = heads(feats)[0]
                mx.eval(logits, next_logits, [v[-1] for v in inds.values()],
                        [c.state for c in cache])
                outs.append(logits)
        finally:
            self.clear_plans()
        return Discovery(inds={k: np.array(mx.concatenate(v, axis=1)).astype(np.int32)
                               for k, v in inds.items()},
                         mask=mask, valid=np.asarray(valid, bool),
                         logits=mx.concatenate(outs, axis=1) if keep_logits else None,
                         planned_layers=sorted(self.planned))

    def _mask(self, shape, n_true: np.ndarray) -> np.ndarray | None:
        if not self.planned:
            return None
        positions = np.arange(shape[1])[None, :]
        return positions >= np.asarray(n_true).reshape(-1, 1)

    def load_routed(self, unions: dict[int, list[int]]) -> int:
        """Make each layer's union resident (the memory bound: only these experts). #read."""
        loaded = 0
        for layer, experts in unions.items():
            switch = self.blocks[layer].switch_mlp
            if len(experts) > switch.slots.n_slots:
                raise ConfigError(f"layer {layer}: {len(experts)} routed experts do not fit "
                                  f"{switch.slots.n_slots} slots")
            if experts:
                loaded += switch.load_in_expert_order(experts)
        return loaded

    def replay_plan(self, disc: Discovery, rows: np.ndarray, unions: dict[int, list[int]]
                    ) -> "Replay":
        """Fixed ids for the gradient pass; padding positions point at a resident expert."""
        plan = Replay()
        valid = disc.valid[rows]
        for layer, ids in disc.inds.items():
            sel = ids[rows].copy()
            fill = unions[layer][0] if unions[layer] else 0
            sel[~valid] = fill
            plan[layer] = mx.array(sel)
        return plan

    def forward(self, tokens: mx.array, mask: mx.array | None, plan: dict[int, mx.array]
                ) -> mx.array:
        """The served forward replaying `plan`, differentiable in the LoRA (switches pinned)."""
        return self._run(tokens, mask, plan)

    def pin(self, pinned: bool) -> None:
        for layer in self.moe:
            self.blocks[layer].switch_mlp.pin(pinned)


class Replay(dict):
    """layer -> fixed ids [B, L, K] for the gradient pass."""


def pack_rows(disc: Discovery, n_slots: int) -> list[np.ndarray]:
    """Split the batch rows into micro-batches whose per-layer routed unions fit `n_slots`.

    Greedy in row order (deterministic). A single row that alone needs more slots than there are
    raises ConfigError: shorten --seq-len or raise --slots-per-layer.
    """
    rows = np.arange(disc.valid.shape[0])
    groups, current, current_sets = [], [], None
    for r in rows:
        sets = {layer: set(np.unique(ids[r][disc.valid[r]]).tolist())
                for layer, ids in disc.inds.items()}
        worst = max((len(s) for s in sets.values()), default=0)
        if worst > n_slots:
            raise ConfigError(f"one sequence routes to {worst} distinct experts in a layer but "
                              f"there are {n_slots} slots per layer; lower --seq-len or raise "
                              f"--slots-per-layer")
        if current_sets is None:
            current, current_sets = [r], sets
            continue
        merged = {layer: current_sets[layer] | sets[layer] for layer in sets}
        if max((len(s) for s in merged.values()), default=0) <= n_slots:
            current.append(r)
            current_sets = merged
        else:
            groups.append(np.array(current))
            current, current_sets = [r], sets
    if current:
        groups.append(np.array(current))
    return groups
