"""Per-family glue: where the MoE blocks are, which streaming twin replaces them, and the forward
loop (mirroring mlx-lm's own `__call__`, plus a per-layer hook for the numerical guard and the
prerouter features)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask, create_ssm_mask

from edge0_eval.errors import CheckpointError
from edge0_eval.engine.moe_blocks import BailingStreamingMoE, Qwen2StreamingMoE, QwenStreamingMoE

LayerHook = Callable[[int, mx.array], mx.array]
# How a decoder layer is called: call(i, layer, *args, **kwargs); training's served path uses it
# to run layers under mx.checkpoint.
LayerCall = Callable[..., mx.array]


def _call(i: int, layer: nn.Module, *args, **kwargs) -> mx.array:
    return layer(*args, **kwargs)


@dataclass(frozen=True)
class Family:
    name: str
    block_class: type
    module_path: str   # a layer's MoE block path, with {layer}: the index must name the same
    # Default per-layer hidden clipping (the engine's clip_hidden="auto"); None: off.
    clip_hidden: float | None = None
    # A prompt cut in two pieces computes the same bits as in one (mlx-lm's layers, CPU): then
    # the prefill runs its last two tokens as their own piece, as mlx-lm's generate_step does
    # its last one (Engine.prefill).
    split_prefill: bool = True

    def text_config(self, config: dict) -> dict:
        return config.get("text_config", config) if self.name == "qwen3_5_moe" else config

    def native_top_k(self, config: dict) -> int:
        return int(self.text_config(config)["num_experts_per_tok"])

    def num_experts(self, config: dict) -> int:
        return int(self.text_config(config)["num_experts"])

    def hidden_size(self, config: dict) -> int:
        return int(self.text_config(config)["hidden_size"])

    def layers(self, model: nn.Module) -> list:
        return model.layers

    def embedding(self, model: nn.Module) -> nn.Module:
        """The input embedding (next-token prerouter heads read its rows)."""
        inner = getattr(model, "language_model", model).model
        return inner.word_embeddings if hasattr(inner, "word_embeddings") else inner.embed_tokens

    def output_head(self, model: nn.Module) -> tuple[nn.Module, nn.Module, bool]:
        """(final norm, LM head module, tied): the tied head is the input embedding, applied
        with `as_linear` (the draft hedge slices its rows)."""
        owner = getattr(model, "language_model", model)
        inner = owner.model
        # As the forwards below: mlx-lm's qwen2_moe always has its own lm_head.
        tied = self.name != "qwen2_moe" and bool(owner.args.tie_word_embeddings)
        return inner.norm, self.embedding(model) if tied else owner.lm_head, tied

    def moe_layers(self, model: nn.Module) -> list[int]:
        return [i for i, layer in enumerate(model.layers) if hasattr(layer.mlp, "switch_mlp")]

    def forward(self, model: nn.Module, inputs: mx.array, cache: list,
                hook: LayerHook | None = None, call: LayerCall | None = None,
                last_only: bool = False) -> mx.array:
        """Logits [B, L, vocab]; last_only: [B, 1, vocab] of the last position only.

        A prefill needs only the last position's logits, and the LM head is the biggest single
        op: over a whole chunk it costs as much as several decoder layers (mlx-lm's prefill
        never computes it for the prompt's earlier positions either).
        """
        return _FORWARDS[self.name](model, inputs, cache, hook, call or _call, last_only)


def _layers(layers, h, cache, hook, call, args) -> mx.array:
    """Each decoder layer as `call(i, layer, *a, **kw)`, (a, kw) = `args(layer, h, its cache)`,
    then the hook on its output."""
    for i, (layer, c) in enumerate(zip(layers, cache)):
        a, kw = args(layer, h, c)
        h = call(i, layer, *a, **kw)
        if hook is not None:
            h = hook(i, h)
    return h


def _logits(out, owner, tied: bool, embed) -> mx.array:
    return embed.as_linear(out) if tied else owner.lm_head(out)


def _last(h: mx.array, last_only: bool) -> mx.array:
    return h[:, -1:] if last_only else h


def _qwen_forward(model, inputs, cache, hook, call, last_only):
    text = model.language_model
    inner = text.model
    h = inner.embed_tokens(inputs)
    fa_mask = create_attention_mask(h, cache[inner.fa_idx])
    ssm_mask = create_ssm_mask(h, cache[inner.ssm_idx])
    h = _layers(inner.layers, h, cache, hook, call, lambda layer, h, c: (
        (h,), dict(mask=ssm_mask if layer.is_linear else fa_mask, cache=c)))
    return _logits(inner.norm(_last(h, last_only)), text, text.args.tie_word_embeddings,
                   inner.embed_tokens)


def _bailing_forward(model, inputs, cache, hook, call, last_only):
    inner = model.model
    h = inner.word_embeddings(inputs)
    attn_cache = cache[inner._attn_idx] if inner._attn_idx is not None else None
    attn_mask = create_attention_mask(h, attn_cache, return_array=True)
    gla_mask = create_ssm_mask(h, cache[inner._gla_idx]) if inner._gla_idx is not None else None
    offset = attn_cache.offset if attn_cache is not None else 0
    h = _layers(inner.layers, h, cache, hook, call, lambda layer, h, c: (
        (h, attn_mask if layer.is_global else gla_mask, c), dict(offset=offset)))
    return _logits(inner.norm(_last(h, last_only)), model, model.args.tie_word_embeddings,
                   inner.word_embeddings)


def _qwen2_forward(model, inputs, cache, hook, call, last_only):
    inner = model.model
    h = inner.embed_tokens(inputs)
    mask = create_attention_mask(h, cache[0])
    h = _layers(inner.layers, h, cache, hook, call, lambda layer, h, c: ((h, mask, c), {}))
    # mlx-lm's qwen2_moe always has its own lm_head
    return model.lm_head(inner.norm(_last(h, last_only)))


_FORWARDS = {"qwen3_5_moe": _qwen_forward, "bailing_hybrid": _bailing_forward,
             "qwen2_moe": _qwen2_forward}

FAMILIES = {
    "qwen3_5_moe": Family("qwen3_5_moe", QwenStreamingMoE,
                          "language_model.model.layers.{layer}.mlp"),
    # +-1000 clipping prevents an fp16 overflow collapse on this tier. Other families run
    # unclipped: real models carry legitimate activations far above 1000 (SmolLM2 turned MoE:
    # ~25,000), which clipping destroys.
    # Its GLA sums a piece in 128-token blocks from the piece's start: a cut moves the sums.
    "bailing_hybrid": Family("bailing_hybrid", BailingStreamingMoE, "model.layers.{layer}.mlp",
                             clip_hidden=1000.0, split_prefill=False),
    "qwen2_moe": Family("qwen2_moe", Qwen2StreamingMoE, "model.layers.{layer}.mlp"),
}


def family_for(config: dict, where: str = "config.json") -> Family:
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        raise CheckpointError(
            f"{where}: model_type {model_type!r} is not supported; supported: "
            f"{', '.join(FAMILIES)}"
        )
    return FAMILIES[model_type]
