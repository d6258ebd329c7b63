"""The model-family registry: one `Family` per supported mlx-lm `model_type`, read by every
consumer (the engine's step, convert's checks, LoRA, training, make-tiny) instead of branching on
the name. Adding a family is one entry here plus its streaming MoE block and layer arguments (step.py) and
its tiny shape (checkpoints/tiny_configs.py, keyed by the family's name).

An entry holds the forward's pieces around mlx-lm's own decoder layers (where the text model,
embedding, layers and output head are; each layer's call arguments), the streaming block that
replaces its MoE blocks (whose `rule` is the family's routing rule), the LoRA targets and the
numerical defaults. `open_model_dir` and `check_model_dir` open a converted model with this
registry (the files' checks: formats/).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import mlx.core as mx
import mlx.nn as nn

from edge0_eval.engine.step import (
    BailingStreamingMoE,
    Qwen2StreamingMoE,
    QwenStreamingMoE,
    bailing_layer_args,
    qwen2_layer_args,
    qwen3_5_layer_args,
)
from edge0_eval.errors import CheckpointError
from edge0_eval.formats import model_dir
from edge0_eval.formats.layout import ExpertIndex

# (text model, h, cache) -> per layer (layer, h, its cache) -> (args, kwargs) of the layer call
LayerArgs = Callable[[nn.Module, mx.array, list], Callable]


@dataclass(frozen=True)
class Family:
    name: str
    block_class: type
    # a layer's MoE block path, with {layer}: the index must name the same
    module_path: str
    # model -> the module holding .model and lm_head
    text: Callable[[nn.Module], nn.Module]
    embed_name: str  # the input embedding, an attribute of text.model
    layer_args: LayerArgs
    # suffix patterns of the resident linears that get LoRA
    lora_targets: tuple[str, ...]
    # the config.json section of the text model's keys
    text_config_key: str | None = None
    own_lm_head: bool = False  # an lm_head even when tie_word_embeddings is set
    gate_selects: bool = False  # mlx-lm's block selects in its gate (its top_k there)
    # Default per-layer hidden clipping (the engine's clip_hidden="auto"); None: off.
    clip_hidden: float | None = None
    # A prompt cut in two pieces computes the same bits as in one (mlx-lm's layers, CPU): then
    # the prefill runs its last two tokens as their own piece, as mlx-lm's generate_step does
    # its last one (DecodeStep.prefill).
    split_prefill: bool = True

    def text_config(self, config: dict) -> dict:
        return (
            config.get(self.text_config_key, config) if self.text_config_key else config
        )

    def native_top_k(self, config: dict) -> int:
        return int(self.text_config(config)["num_experts_per_tok"])

    def num_experts(self, config: dict) -> int:
        return int(self.text_config(config)["num_experts"])

    def hidden_size(self, config: dict) -> int:
        return int(self.text_config(config)["hidden_size"])

    def layers(self, model: nn.Module) -> list:
        return model.layers

    def embedding(self, model: nn.Module) -> nn.Module:
        return getattr(self.text(model).model, self.embed_name)

    def output_head(self, model: nn.Module) -> tuple[nn.Module, nn.Module, bool]:
        """(final norm, LM head module, tied): the tied head is the input embedding, applied
        with `as_linear` (the draft hedge slices its rows)."""
        text = self.text(model)
        tied = not self.own_lm_head and bool(text.args.tie_word_embeddings)
        return text.model.norm, self.embedding(model) if tied else text.lm_head, tied

    def moe_layers(self, model: nn.Module) -> list[int]:
        return [i for i, layer in enumerate(model.layers) if "switch_mlp" in layer.mlp]


# Checked against mlx-lm 0.32's qwen3_5.py / bailing_hybrid.py / qwen2_moe.py. Patterns that a
# config does not build (MLA's q_a_proj when q_lora_rank is None) match nothing. The shared
# experts' out=1 gates are left out; routers and routed experts never carry LoRA (lora.py).
_ATTENTION = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
)
_SHARED = (
    "mlp.shared_expert.gate_proj",
    "mlp.shared_expert.up_proj",
    "mlp.shared_expert.down_proj",
)

FAMILIES = {
    "qwen3_5_moe": Family(
        "qwen3_5_moe",
        QwenStreamingMoE,
        "language_model.model.layers.{layer}.mlp",
        text=lambda model: model.language_model,
        embed_name="embed_tokens",
        layer_args=qwen3_5_layer_args,
        text_config_key="text_config",
        lora_targets=_ATTENTION
        + (  # full attention every 4th layer, GatedDeltaNet the rest
            "linear_attn.in_proj_qkv",
            "linear_attn.in_proj_z",
            "linear_attn.in_proj_b",
            "linear_attn.in_proj_a",
            "linear_attn.out_proj",
        )
        + _SHARED,
    ),
    # +-1000 clipping prevents an fp16 overflow collapse on this tier. Other families run
    # unclipped: real models carry legitimate activations far above 1000 (SmolLM2 turned MoE:
    # ~25,000), which clipping destroys.
    # Its GLA sums a piece in 128-token blocks from the piece's start: a cut moves the sums.
    "bailing_hybrid": Family(
        "bailing_hybrid",
        BailingStreamingMoE,
        "model.layers.{layer}.mlp",
        text=lambda model: model,
        embed_name="word_embeddings",
        layer_args=bailing_layer_args,
        gate_selects=True,
        clip_hidden=1000.0,
        split_prefill=False,
        lora_targets=(  # linear attention; MLA (embed_q/unembed_out are MultiLinear, not
            # Linear); both kinds' output; the shared experts; the dense layer-0 MLP (the
            # router `mlp.gate.gate_proj` does not end with `.mlp.gate_proj`)
            "attention.query_key_value",
            "attention.g_proj",
            "attention.q_proj",
            "attention.q_a_proj",
            "attention.q_b_proj",
            "attention.kv_a_proj_with_mqa",
            "attention.dense",
            "mlp.shared_experts.gate_proj",
            "mlp.shared_experts.up_proj",
            "mlp.shared_experts.down_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        ),
    ),
    "qwen2_moe": Family(
        "qwen2_moe",
        Qwen2StreamingMoE,
        "model.layers.{layer}.mlp",
        text=lambda model: model,
        embed_name="embed_tokens",
        layer_args=qwen2_layer_args,
        own_lm_head=True,
        lora_targets=_ATTENTION + _SHARED,
    ),  # q/k/v keep their bias
}


def family_for(config: dict, where: str = "config.json") -> Family:
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        raise CheckpointError(
            f"{where}: model_type {model_type!r} is not supported; supported: "
            f"{', '.join(FAMILIES)}"
        )
    return FAMILIES[model_type]


def open_model_dir(directory: str | Path) -> tuple[dict, Family, ExpertIndex]:
    """A converted model's config.json, family and expert index, checked against each other
    (formats/model_dir.py, with this registry)."""
    return model_dir.open_model_dir(directory, family_for)


def check_model_dir(directory: str | Path, verify_crc: bool = True) -> None:
    """What Engine.load checks before reading weights, without loading any (a preflight)."""
    model_dir.check_model_dir(directory, family_for, verify_crc)
