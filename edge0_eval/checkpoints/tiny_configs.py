"""config.json of each family at a tiny shape, keyed by the family's name in the registry
(engine/families/), written by `edge0-eval make-tiny` (checkpoints/tiny.py). Each refuses a
shape its family cannot build. Kept here, not in the registry, so that the engine never imports
checkpoint making.
"""

from __future__ import annotations

from edge0_eval.errors import ConfigError


def qwen3_5_tiny(shape) -> dict:
    head_dim = shape.hidden // shape.heads
    text = {
        "model_type": "qwen3_5_moe_text",
        "hidden_size": shape.hidden,
        "intermediate_size": shape.moe_intermediate * 4,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": max(1, shape.heads // 2),
        "head_dim": head_dim,
        "rms_norm_eps": 1e-6,
        "vocab_size": shape.vocab_size,
        "max_position_embeddings": 4096,
        "linear_num_value_heads": shape.heads,
        "linear_num_key_heads": max(1, shape.heads // 2),
        "linear_key_head_dim": head_dim,
        "linear_value_head_dim": head_dim,
        "linear_conv_kernel_dim": 4,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "full_attention_interval": 4,
        "num_experts": shape.experts,
        "num_experts_per_tok": shape.experts_per_token,
        "decoder_sparse_step": 1,
        "shared_expert_intermediate_size": shape.moe_intermediate,
        "moe_intermediate_size": shape.moe_intermediate,
        "norm_topk_prob": True,
        "rope_parameters": {
            "type": "default",
            "rope_theta": 10000000,
            "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10],
        },
    }
    return {
        "model_type": "qwen3_5_moe",
        "text_config": text,
        "tie_word_embeddings": False,
    }


def qwen2_tiny(shape) -> dict:
    return {
        "model_type": "qwen2_moe",
        "hidden_size": shape.hidden,
        "intermediate_size": shape.moe_intermediate * 4,  # unused: every layer is MoE
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.heads // 2
        if shape.heads % 2 == 0
        else shape.heads,
        "rms_norm_eps": 1e-6,
        "vocab_size": shape.vocab_size,
        "max_position_embeddings": 4096,
        "rope_theta": 1000000.0,
        "num_experts": shape.experts,
        "num_experts_per_tok": shape.experts_per_token,
        "moe_intermediate_size": shape.moe_intermediate,
        "shared_expert_intermediate_size": shape.moe_intermediate,
        "tie_word_embeddings": False,
    }


def _bailing_groups(experts: int) -> int:
    for groups in (8, 4, 2):
        if experts % groups == 0 and experts // groups >= 2:
            return groups
    return 1


def bailing_tiny(shape) -> dict:
    groups = _bailing_groups(shape.experts)
    if shape.experts_per_token > max(1, groups // 2) * (shape.experts // groups):
        raise ConfigError(
            f"--experts-per-token {shape.experts_per_token} cannot be met by group-limited "
            f"routing over {shape.experts} experts in {groups} groups keeping "
            f"{max(1, groups // 2)}"
        )
    if shape.layers < 2:
        raise ConfigError("bailing_hybrid needs --layers >= 2 (layer 0 is dense)")
    head_dim = shape.hidden // shape.heads
    return {
        "model_type": "bailing_hybrid",
        "hidden_size": shape.hidden,
        "intermediate_size": shape.moe_intermediate * 4,
        "moe_intermediate_size": shape.moe_intermediate,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.heads,
        "num_experts": shape.experts,
        "num_experts_per_tok": shape.experts_per_token,
        "num_shared_experts": 1,
        "n_group": groups,
        "topk_group": max(1, groups // 2),
        "first_k_dense_replace": 1,
        "layer_group_size": 2,
        "group_norm_size": 2 if shape.heads % 2 == 0 else 1,
        "vocab_size": shape.vocab_size,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "routed_scaling_factor": 2.5,
        "head_dim": head_dim,
        "kv_lora_rank": max(16, head_dim * 2),
        "qk_rope_head_dim": max(4, head_dim // 2),
        "qk_nope_head_dim": max(4, head_dim // 2),
        "v_head_dim": head_dim,
        "q_lora_rank": None,
        "partial_rotary_factor": 0.5,
        "score_function": "sigmoid",
        "norm_topk_prob": True,
        "moe_router_enable_expert_bias": True,
        "tie_word_embeddings": False,
        "use_qk_norm": True,
    }


# family name (engine/families/: FAMILIES, same order) -> TinyShape -> config.json
TINY_CONFIGS = {
    "qwen3_5_moe": qwen3_5_tiny,
    "bailing_hybrid": bailing_tiny,
    "qwen2_moe": qwen2_tiny,
}
