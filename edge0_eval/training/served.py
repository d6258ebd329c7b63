"""The student's served path over whole (teacher-forced) sequences, with gradients.

Serving (engine.generate) runs a prompt with the true router; from the first decode step on,
every consuming layer executes the set its prerouter head predicted from the previous token's
features, with the router's combination weights at that set. Training computes exactly that
through the engine's own step (engine/step.py), in two passes (`discover`, then `forward` inside
`mx.value_and_grad`):

1. discover (no gradient, the engine's serving mode): the whole sequence in one step, each
   consuming layer's route at position t being its head's prediction from position t-1, made in
   the pass; positions t < n_true[b] (the prompt) route truly. With a wrap-around head (its
   consumer, the first MoE layer, runs before its owner) the sequence is stepped position by
   position with a KV cache, as decode runs. Plans are not staged: the switches load what is
   routed (host sync allowed). Every MoE layer's executed ids are recorded [B, L, K].
2. the caller loads the union of each layer's ids into the slot pool (`load_routed`); the
   gradient pass (`forward`) replays the executed ids as fixed routes (no re-selection, so it
   cannot route to an expert that is not resident) while the combination weights are
   recomputed differentiably from the router at every position, as served, so gradients flow
   through the routing weights into the LoRA. With `grad_checkpoint` each decoder layer runs
   under `mx.checkpoint`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from edge0_eval.engine.routing import Plans
from edge0_eval.errors import ConfigError
from edge0_eval.training.stage_options import MODES


@dataclass
class Discovery:
    """What the no-gradient pass routed: executed ids per MoE layer, as host arrays."""

    inds: dict[int, np.ndarray]  # layer -> [B, L, K] int32
    mask: np.ndarray  # [B, L] bool: prerouted positions
    valid: np.ndarray  # [B, L] bool: real (non-padding) positions
    logits: mx.array | None = None  # student logits of the pass (when asked for)
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
        mode = engine.options.mode  # trained as served: the engine's own mode
        if mode not in MODES:
            raise ConfigError(
                f"training runs the student in mode {' or '.join(MODES)}, not {mode!r}"
            )
        pr = engine.prerouter
        if mode == "prerouted" and pr is None:
            raise ConfigError(
                "prerouted training needs prerouter heads, and the engine has "
                "none loaded"
            )
        self.engine, self.mode, self.grad_checkpoint = engine, mode, grad_checkpoint
        self.blocks, self.moe = engine.blocks, list(engine.moe_layers)
        self.planned = sorted(pr.consumers) if mode == "prerouted" else []
        # (owner, consumer) or None
        self.wrap = pr.wrap if mode == "prerouted" else None
        self._saved_capture = {layer: self.blocks[layer].capture for layer in self.moe}
        for layer in self.moe:
            self.blocks[layer].capture = True  # every layer's executed ids are recorded
        self.closed = False

    def close(self) -> None:
        """Give the engine back its serving behaviour (what each block records)."""
        if not self.closed:
            for layer in self.moe:
                self.blocks[layer].capture = self._saved_capture[layer]
            self.closed = True

    def discover(
        self,
        tokens: np.ndarray,
        valid: np.ndarray,
        n_true: np.ndarray,
        keep_logits: bool = False,
    ) -> Discovery:
        """No-gradient pass in serving mode; records every MoE layer's executed ids.

        tokens [B, L] int, valid [B, L] bool (False = padding, at the end of a row), n_true [B]:
        positions t < n_true[b] route with the true router (the prompt).
        """
        step, length = self.engine.step, tokens.shape[1]
        mask = None
        if self.planned:
            mask = np.arange(length)[None, :] >= np.asarray(n_true).reshape(-1, 1)
        planned = None if mask is None else mx.array(mask)
        plans = None if mask is None else Plans()
        if self.wrap is None:
            logits, _ = step(
                mx.array(tokens),
                [None] * len(step.layers),
                plans,
                stage=False,
                plan_next=False,
                planned=planned,
                all_logits=True,
                where="in a training pass",
            )
            inds = {layer: self.blocks[layer].last[1] for layer in self.moe}
        else:
            cache, outs = self.engine.step.new_cache(), []
            inds = {layer: [] for layer in self.moe}
            for p in range(length):
                last, plans = step(
                    mx.array(tokens[:, p : p + 1]),
                    cache,
                    plans,
                    stage=False,
                    planned=planned[:, p : p + 1],
                    where=f"at position {p} of a training pass",
                )
                outs.append(last)
                for layer in self.moe:
                    inds[layer].append(self.blocks[layer].last[1])
            logits = mx.stack(outs, axis=1)
            inds = {layer: mx.concatenate(ids, axis=1) for layer, ids in inds.items()}
        mx.eval(list(inds.values()))
        return Discovery(
            inds={k: np.array(v).astype(np.int32) for k, v in inds.items()},
            mask=np.zeros(tokens.shape, bool) if mask is None else mask,
            valid=np.asarray(valid, bool),
            logits=logits if keep_logits else None,
            planned_layers=self.planned,
        )

    def load_routed(self, unions: dict[int, list[int]]) -> int:
        """Make each layer's union resident (the memory bound: only these experts). #read."""
        loaded = 0
        for layer, experts in unions.items():
            switch = self.blocks[layer].switch_mlp
            if len(experts) > switch.slots.n_slots:
                raise ConfigError(
                    f"layer {layer}: {len(experts)} routed experts do not fit "
                    f"{switch.slots.n_slots} slots"
                )
            if experts:
                loaded += switch.load_in_expert_order(experts)
        return loaded

    def replay_plan(
        self, disc: Discovery, rows: np.ndarray, unions: dict[int, list[int]]
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

    def forward(self, tokens: mx.array, plan: dict[int, mx.array]) -> mx.array:
        """The served forward replaying `plan` (its experts resident: `load_routed`),
        differentiable in the LoRA: logits [B, L, vocab]."""
        step = self.engine.step
        call = self._checkpointed if self.grad_checkpoint else None
        h, _ = step.forward(tokens, [None] * len(step.layers), replay=plan, call=call)
        return step.logits(h)

    def _checkpointed(self, i: int, layer, x: mx.array, *args, **kwargs) -> mx.array:
        """Decoder layer i under mx.checkpoint, its route put back for the recomputation the
        backward pass runs after the step's loop has moved on."""
        block = self.blocks.get(i)
        route = None if block is None else block.route

        def inner(params, x):
            layer.update(params)
            if block is not None:
                block.route = route
            return layer(x, *args, **kwargs)

        return mx.checkpoint(inner)(layer.trainable_parameters(), x)


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
        sets = {
            layer: set(np.unique(ids[r][disc.valid[r]]).tolist())
            for layer, ids in disc.inds.items()
        }
        worst = max((len(s) for s in sets.values()), default=0)
        if worst > n_slots:
            raise ConfigError(
                f"one sequence routes to {worst} distinct experts in a layer but "
                f"there are {n_slots} slots per layer; lower --seq-len or raise "
                f"--slots-per-layer"
            )
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
