"""qwen3_5_moe (Qwen3.5/3.6 MoE, the 35B tier): its registry entry, streaming MoE block and
layer call arguments. Full attention every 4th layer, GatedDeltaNet the rest; softmax top-k,
normalised; one shared expert behind a sigmoid gate.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask, create_ssm_mask

from edge0_eval.engine.experts import StreamingSwitchGLU
from edge0_eval.engine.families.base import ATTENTION, SHARED, Family
from edge0_eval.engine.routing import RoutingRule, StreamingMoE, combine, top_k_ids


class QwenStreamingMoE(StreamingMoE):
    """qwen3_5_moe block: softmax top-k, normalised, a shared expert with a sigmoid gate."""

    # mlx-lm qwen3_next / qwen3_5_moe: argpartition(probs)[-k:]
    selection_order = "last"

    def __init__(self, block, switch: StreamingSwitchGLU, experts_per_token: int):
        super().__init__()
        self.gate = block.gate
        self.shared_expert = block.shared_expert
        self.shared_expert_gate = block.shared_expert_gate
        self.norm_topk_prob = self.normalizes(block)
        self._init_streaming(switch, experts_per_token)

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
        inds = top_k_ids(probs, self.experts_per_token, self.selection_order)
        return inds, combine(probs, inds, normalize=self.norm_topk_prob)

    def weights(self, x: mx.array, inds: mx.array) -> mx.array:
        return combine(self._probs(x), inds, normalize=self.norm_topk_prob)

    def shared(self, x: mx.array) -> mx.array:
        return mx.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


def layer_args(text, h, cache):
    inner = text.model
    fa_mask = create_attention_mask(h, cache[inner.fa_idx])
    ssm_mask = create_ssm_mask(h, cache[inner.ssm_idx])
    return lambda layer, h, c: (
        (h,),
        dict(mask=ssm_mask if layer.is_linear else fa_mask, cache=c),
    )


GATED_DELTA = tuple(
    f"linear_attn.{p}"
    for p in "in_proj_qkv in_proj_z in_proj_b in_proj_a out_proj".split()
)

FAMILY = Family(
    "qwen3_5_moe",
    QwenStreamingMoE,
    "language_model.model.layers.{layer}.mlp",
    text=lambda model: model.language_model,
    embed_name="embed_tokens",
    layer_args=layer_args,
    text_config_key="text_config",
    # full attention every 4th layer, GatedDeltaNet (linear attention) the rest
    lora_targets=ATTENTION + GATED_DELTA + SHARED,
)
