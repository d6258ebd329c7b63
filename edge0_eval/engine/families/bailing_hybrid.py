"""bailing_hybrid (Ling, the 8B tier): its registry entry, streaming MoE block and layer call
arguments. Linear attention (GLA) and MLA layers, layer 0 dense; sigmoid routing with an expert
bias, 8 groups keep 4, routed scaling; one shared expert.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask, create_ssm_mask

from edge0_eval.engine.experts import StreamingSwitchGLU
from edge0_eval.engine.families.base import Family
from edge0_eval.engine.routing import NORM_EPS, RoutingRule, StreamingMoE, combine


class BailingStreamingMoE(StreamingMoE):
    """bailing_hybrid block: sigmoid + expert bias, group-limited top-k, routed scaling."""

    def __init__(self, block, switch: StreamingSwitchGLU, experts_per_token: int):
        super().__init__()
        self.gate = block.gate  # mlx-lm's Gate: its own selection rule, reused as is
        self.shared_experts = block.shared_experts
        self._init_streaming(switch, experts_per_token)
        self.gate.top_k = (
            experts_per_token  # instance attribute: serves K != native top-k
        )

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


def layer_args(text, h, cache):
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


# +-1000 clipping prevents an fp16 overflow collapse on this tier. Other families run
# unclipped: real models carry legitimate activations far above 1000 (SmolLM2 turned MoE:
# ~25,000), which clipping destroys.
# Its GLA sums a piece in 128-token blocks from the piece's start: a cut moves the sums.
FAMILY = Family(
    "bailing_hybrid",
    BailingStreamingMoE,
    "model.layers.{layer}.mlp",
    text=lambda model: model,
    embed_name="word_embeddings",
    layer_args=layer_args,
    gate_selects=True,
    clip_hidden=1000.0,
    split_prefill=False,
    # linear attention; MLA (embed_q/unembed_out are MultiLinear, not Linear); both
    # kinds' output; the shared experts; the dense layer-0 MLP (the router
    # `mlp.gate.gate_proj` does not end with `.mlp.gate_proj`)
    lora_targets=tuple(
        "attention.query_key_value attention.g_proj attention.q_proj attention.q_a_proj "
        "attention.q_b_proj attention.kv_a_proj_with_mqa attention.dense "
        "mlp.shared_experts.gate_proj mlp.shared_experts.up_proj "
        "mlp.shared_experts.down_proj mlp.gate_proj mlp.up_proj mlp.down_proj".split()
    ),
)
