"""Each family's streaming MoE block: mlx-lm's MoE block with `switch_mlp` replaced by a
`StreamingSwitchGLU` (engine/moe.py), its child modules kept under their original names
(`gate`, `shared_expert(s)`, ...) so weights, LoRA keys and published adapters address the same
paths. True routing is mlx-lm's own, bit for bit; a `Route` (set by the step, engine/step.py)
replaces the router's choice of experts, never its weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from edge0_eval.engine import routing
from edge0_eval.engine.moe import StreamingSwitchGLU


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
        self.recall: list[mx.array] | None = (
            None  # a list: keep each plan's recall (lazy)
        )

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

    selection_order = (
        "last"  # mlx-lm qwen3_next / qwen3_5_moe: argpartition(probs)[-k:]
    )

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
    def rule(self) -> routing.RoutingRule:
        return routing.RoutingRule(score="softmax", norm_topk_prob=self.norm_topk_prob)

    def _probs(self, x: mx.array) -> mx.array:
        return mx.softmax(self.gate(x), axis=-1, precise=True)

    def select(self, x: mx.array) -> tuple[mx.array, mx.array]:
        probs = self._probs(x)
        inds = routing.top_k(probs, self.top_k, self.selection_order)
        return inds, routing.combine(probs, inds, normalize=self.norm_topk_prob)

    def weights(self, x: mx.array, inds: mx.array) -> mx.array:
        return routing.combine(self._probs(x), inds, normalize=self.norm_topk_prob)

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
    def rule(self) -> routing.RoutingRule:
        gate = self.gate
        return routing.RoutingRule(
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
        return routing.combine(
            probs,
            inds,
            normalize=inds.shape[-1] > 1 and self.gate.norm_topk_prob,
            eps=routing.NORM_EPS,
            scaling=self.gate.routed_scaling_factor,
        ).astype(x.dtype)

    def shared(self, x: mx.array) -> mx.array | None:
        return None if self.shared_experts is None else self.shared_experts(x)
