"""Each family's streaming MoE block: mlx-lm's MoE block with `switch_mlp` replaced by a
`StreamingSwitchGLU` (engine/moe.py), its child modules kept under their original names
(`gate`, `shared_expert(s)`, ...) so weights, LoRA keys and published adapters address the same
paths. Routing is the family's rule (engine/routing.py); a prerouted step's plan replaces the
router's choice of experts, never its weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx
import mlx.nn as nn

from edge0_eval.engine import routing
from edge0_eval.engine.moe import StreamingSwitchGLU


@dataclass
class BlockTrace:
    """What a streaming block is told to route and what it executed.

    Written only through the block's methods below (`set_plan`, `set_planner`, `set_capture`,
    `set_measure_recall`) and read through `captured` and `recalls`; the engine's prerouted
    decode and training's served path steer the block that way instead of reaching into it.
    """

    layer: int
    plan: tuple | None = None          # (inds, None): execute exactly these, router weights
    planner: Callable | None = None    # (block, x) -> (inds, weights): decided at call time
    capture: bool = False              # keep the last call's MoE input and executed ids
    last_input: mx.array | None = None
    last_inds: mx.array | None = None
    measure_recall: bool = False
    recall: list = field(default_factory=list)


class _StreamingBlock(nn.Module):
    """Common plumbing: the engine may set a routing plan and reads back what executed."""

    def _init_trace(self, layer: int, top_k: int):
        self.top_k = top_k
        self._trace = BlockTrace(layer)

    def set_plan(self, inds: mx.array | None) -> None:
        """Execute exactly `inds` [B, L, K], weighted by the router's own weights at them."""
        self._trace.plan = None if inds is None else (inds, None)

    def set_planner(self, planner: Callable | None) -> None:
        """Route every call by `planner(block, x) -> (inds, weights)` (None: back to normal)."""
        self._trace.planner = planner

    def set_capture(self, on: bool) -> None:
        """Keep each call's MoE input and executed ids for `captured`; clears what was kept."""
        self._trace.capture = on
        self._trace.last_input = self._trace.last_inds = None

    @property
    def capturing(self) -> bool:
        return self._trace.capture

    def captured(self) -> tuple[mx.array | None, mx.array | None]:
        """(MoE input [B, L, H], executed ids [B, L, K]) of the last call while capturing."""
        return self._trace.last_input, self._trace.last_inds

    def set_measure_recall(self, on: bool) -> None:
        """While a plan is set, also run the true router and keep the plan's recall."""
        self._trace.measure_recall = on

    def recalls(self) -> list[mx.array]:
        """Online recall of each planned call while measuring (lazy scalars)."""
        return list(self._trace.recall)

    def _current_plan(self, x: mx.array) -> tuple | None:
        if self._trace.planner is not None:
            return self._trace.planner(self, x)
        return self._trace.plan

    def true_inds(self, x: mx.array) -> mx.array:
        raise NotImplementedError

    def _record_recall(self, x: mx.array, planned: mx.array) -> None:
        """Online recall of a plan: |planned ∩ true top-k| / k, kept lazy (no sync here)."""
        true = self.true_inds(x)
        hit = (planned[..., :, None] == true[..., None, :]).any(axis=-1)
        self._trace.recall.append(hit.astype(mx.float32).mean())

    def _routed(self, x: mx.array, inds: mx.array, scores: mx.array) -> mx.array:
        if self._trace.plan is not None and self._trace.measure_recall:
            self._record_recall(x, inds)
        if self._trace.capture:
            self._trace.last_input, self._trace.last_inds = x, inds
        y = self.switch_mlp(x, inds)
        return (y * scores[..., None]).sum(axis=-2)


class QwenStreamingMoE(_StreamingBlock):
    """qwen3_next / qwen3_5_moe block: softmax top-k, normalised, shared expert with sigmoid gate."""

    def __init__(self, block, switch: StreamingSwitchGLU, layer: int, top_k: int):
        super().__init__()
        self.gate = block.gate
        self.shared_expert = block.shared_expert
        self.shared_expert_gate = block.shared_expert_gate
        # qwen2_moe blocks have no such flag: they never normalise.
        self.norm_topk_prob = getattr(block, "norm_topk_prob", False)
        self.num_experts = block.num_experts
        self.switch_mlp = switch
        self._init_trace(layer, top_k)

    def router_probs(self, x: mx.array) -> mx.array:
        return mx.softmax(self.gate(x), axis=-1, precise=True)

    def true_inds(self, x: mx.array) -> mx.array:
        return self.select(self.router_probs(x), self.top_k)[0]

    selection_order = "last"     # mlx-lm qwen3_next / qwen3_5_moe

    def select(self, probs: mx.array, k: int) -> tuple[mx.array, mx.array]:
        inds = routing.top_k(probs, k, self.selection_order)
        return inds, self.combine(probs, inds)

    def combine(self, probs: mx.array, inds: mx.array) -> mx.array:
        return routing.combine(probs, inds, normalize=self.norm_topk_prob)

    def __call__(self, x: mx.array) -> mx.array:
        plan = self._current_plan(x)
        if plan is None:
            inds, scores = self.select(self.router_probs(x), self.top_k)
        else:
            inds, scores = plan
            if scores is None:
                scores = self.combine(self.router_probs(x), inds)
        y = self._routed(x, inds, scores)
        shared = mx.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return y + shared


class Qwen2StreamingMoE(QwenStreamingMoE):
    """qwen2_moe block: the same softmax router and gated shared expert, never normalised.

    Selection is mlx-lm qwen2_moe's own (argpartition of -probs, first k): the order of the k
    experts is the order of the weighted sum, so matching it keeps outputs bit-identical.
    """

    selection_order = "first"


class BailingStreamingMoE(_StreamingBlock):
    """bailing_hybrid block: sigmoid + expert bias, group-limited top-k, routed scaling."""

    def __init__(self, block, switch: StreamingSwitchGLU, layer: int, top_k: int):
        super().__init__()
        self.gate = block.gate            # mlx-lm's Gate: its own selection rule, reused as is
        self.shared_experts = block.shared_experts
        self.switch_mlp = switch
        self.num_experts = switch._io.num_experts
        self._init_trace(layer, top_k)
        self.gate.top_k = top_k           # instance attribute: serves K != native top-k

    def router_probs(self, x: mx.array) -> mx.array:
        return mx.sigmoid(self.gate.gate_proj(x).astype(mx.float32))

    def true_inds(self, x: mx.array) -> mx.array:
        return self.gate(x)[0]

    def combine(self, probs: mx.array, inds: mx.array) -> mx.array:
        # mlx-lm's Gate: normalised only for k > 1, then scaled.
        return routing.combine(probs, inds,
                               normalize=inds.shape[-1] > 1 and self.gate.norm_topk_prob,
                               eps=routing.NORM_EPS, scaling=self.gate.routed_scaling_factor)

    def __call__(self, x: mx.array) -> mx.array:
        plan = self._current_plan(x)
        if plan is None:
            inds, scores = self.gate(x)
        else:
            inds, scores = plan
            if scores is None:
                scores = self.combine(self.router_probs(x), inds)
            scores = scores.astype(x.dtype)
        out = self._routed(x, inds, scores)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
