"""qwen2_moe: its registry entry, streaming MoE block and layer call arguments. Every layer
MoE; the same softmax router and gated shared expert as qwen3_5_moe, never normalised.
"""

from __future__ import annotations

from mlx_lm.models.base import create_attention_mask

from edge0_eval.engine.families.base import ATTENTION, SHARED, Family
from edge0_eval.engine.families.qwen3_5_moe import QwenStreamingMoE


class Qwen2StreamingMoE(QwenStreamingMoE):
    """qwen2_moe block: the same softmax router and gated shared expert, never normalised.

    Selection is mlx-lm qwen2_moe's own (argpartition of -probs, first k): the order of the k
    experts is the order of the weighted sum, so matching it keeps outputs bit-identical.
    """

    selection_order = "first"

    @staticmethod
    def normalizes(block) -> bool:
        return False  # mlx-lm's qwen2_moe block has no norm_topk_prob: it never does


def layer_args(text, h, cache):
    mask = create_attention_mask(h, cache[0])
    return lambda layer, h, c: ((h, mask, c), {})


FAMILY = Family(
    "qwen2_moe",
    Qwen2StreamingMoE,
    "model.layers.{layer}.mlp",
    text=lambda model: model,
    embed_name="embed_tokens",
    layer_args=layer_args,
    own_lm_head=True,
    lora_targets=ATTENTION + SHARED,  # q/k/v keep their bias
)
