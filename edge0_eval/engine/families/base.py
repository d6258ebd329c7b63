"""What a model family is: `Family`, one per supported mlx-lm `model_type` (one module each
in this package, as mlx-lm's `models/<type>.py`), read by every consumer (the engine's step,
convert's checks, LoRA, training, make-tiny) instead of branching on the name.

An entry holds the forward's pieces around mlx-lm's own decoder layers (where the text model,
embedding, layers and output head are; each layer's call arguments), the streaming block that
replaces its MoE blocks (whose `rule` is the family's routing rule), the LoRA targets and the
numerical defaults.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import mlx.core as mx
import mlx.nn as nn

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
ATTENTION = tuple(f"self_attn.{p}_proj" for p in "qkvo")
SHARED = tuple(f"mlp.shared_expert.{p}_proj" for p in ("gate", "up", "down"))
