"""Checkpoints in the layouts people download, built from tiny mlx-lm checkpoints by undoing what
mlx-lm's `sanitize` does: mlx-vlm conversions (vision tower and MTP weights beside the language
model) and original Hugging Face layouts (Qwen3.5/3.6's fused experts and offset norms, Ling's
per-expert keys, router name, absorbed-attention matrix and trailing MTP layer)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.utils import load_model, quantize_model, save_config, save_model

VISION_CONFIG = {
    "model_type": "qwen3_5_moe",
    "depth": 1,
    "hidden_size": 32,
    "num_heads": 2,
    "out_hidden_size": 64,
    "patch_size": 16,
}
# The norms Qwen3.5's Hugging Face checkpoints store as an offset from one.
_OFFSET_NORMS = (
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
    "model.norm.weight",
    ".q_norm.weight",
    ".k_norm.weight",
)


def _extra(quantized: bool, prefix: str, shape=(64, 64)) -> dict:
    """A weight (and bias) under `prefix`, quantized as mlx-vlm quantizes its towers or not."""
    w = mx.random.normal(shape).astype(mx.float16) * 0.02
    if not quantized:
        return {
            f"{prefix}.weight": w,
            f"{prefix}.bias": mx.zeros(shape[:1], mx.float16),
        }
    q, scales, biases = mx.quantize(w, 64, 4)
    return {
        f"{prefix}.weight": q,
        f"{prefix}.scales": scales,
        f"{prefix}.biases": biases,
        f"{prefix}.bias": mx.zeros(shape[:1], mx.float16),
    }


def _save(src: Path, dst: Path, weights: dict, config: dict) -> Path:
    shutil.copytree(src, dst)
    for old in dst.glob("model*.safetensors*"):
        old.unlink()
    mx.save_safetensors(
        str(dst / "model.safetensors"), weights, metadata={"format": "mlx"}
    )
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def mlx_vlm_style(src: Path, dst: Path) -> Path:
    """`src` (a qwen3_5_moe checkpoint, quantized or not) as mlx-vlm writes it: a vision tower and
    MTP weights beside the language model, and a vision_config."""
    config = json.loads((src / "config.json").read_text())
    weights = dict(mx.load(str(src / "model.safetensors")))
    quantized = "quantization" in config
    weights.update(_extra(quantized, "vision_tower.blocks.0.attn.qkv"))
    weights.update(_extra(quantized, "language_model.mtp.fc"))
    weights["language_model.mtp.norm.weight"] = mx.ones((64,), mx.float16)
    config["vision_config"] = VISION_CONFIG
    return _save(src, dst, weights, config)


def hf_qwen(src: Path, dst: Path) -> Path:
    """A float qwen3_5_moe checkpoint in the original Hugging Face layout."""
    config = json.loads((src / "config.json").read_text())
    weights = {}
    for name, value in mx.load(str(src / "model.safetensors")).items():
        name = name.replace("language_model.model.", "model.language_model.")
        name = name.replace("language_model.lm_head.", "lm_head.")
        if "conv1d.weight" in name:
            value = value.moveaxis(2, 1)
        if name.endswith(_OFFSET_NORMS) and value.ndim == 1:
            value = value - 1.0
        weights[name] = value
    for layer in range(config["text_config"]["num_hidden_layers"]):
        old = f"model.language_model.layers.{layer}.mlp.switch_mlp"
        new = f"model.language_model.layers.{layer}.mlp.experts"
        weights[f"{new}.gate_up_proj"] = mx.concatenate(
            [
                weights.pop(f"{old}.gate_proj.weight"),
                weights.pop(f"{old}.up_proj.weight"),
            ],
            axis=1,
        )
        weights[f"{new}.down_proj"] = weights.pop(f"{old}.down_proj.weight")
    weights.update(_extra(False, "model.visual.blocks.0.attn.qkv"))
    weights.update(_extra(False, "mtp.fc"))
    config["vision_config"] = VISION_CONFIG
    return _save(src, dst, weights, config)


def hf_ling(src: Path, dst: Path) -> Path:
    """A float bailing_hybrid checkpoint in the original Hugging Face layout."""
    config = json.loads((src / "config.json").read_text())
    heads, nope = config["num_attention_heads"], config["qk_nope_head_dim"]
    weights = dict(mx.load(str(src / "model.safetensors")))
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        for proj in ("gate_proj", "up_proj", "down_proj"):
            stacked = weights.pop(f"{p}.mlp.switch_mlp.{proj}.weight", None)
            for e in range(0 if stacked is None else stacked.shape[0]):
                weights[f"{p}.mlp.experts.{e}.{proj}.weight"] = stacked[e]
        if f"{p}.mlp.gate.gate_proj.weight" in weights:
            weights[f"{p}.mlp.gate.weight"] = weights.pop(
                f"{p}.mlp.gate.gate_proj.weight"
            )
        if f"{p}.attention.embed_q.weight" not in weights:
            continue  # not an MLA layer
        embed_q = weights.pop(f"{p}.attention.embed_q.weight")  # [H, kv_rank, nope]
        unembed = weights.pop(f"{p}.attention.unembed_out.weight")  # [H, v, kv_rank]
        kv_b = mx.concatenate([embed_q.swapaxes(-1, -2), unembed], axis=1)
        assert embed_q.shape[-1] == nope and kv_b.shape[0] == heads
        weights[f"{p}.attention.kv_b_proj.weight"] = kv_b.reshape(-1, kv_b.shape[-1])
    mtp = f"model.layers.{config['num_hidden_layers']}"  # the MTP layer Ling appends
    weights.update(_extra(False, f"{mtp}.eh_proj"))
    weights[f"{mtp}.enorm.weight"] = mx.ones((64,), mx.float16)
    return _save(src, dst, weights, config)


def requantized(src: Path, dst: Path, **kwargs) -> Path:
    """A float checkpoint quantized by mlx-lm's quantize_model with `kwargs` (a mixed-bit
    predicate, another mode)."""
    model, config = load_model(src)
    model, config = quantize_model(model, config, **kwargs)
    shutil.copytree(src, dst)
    (dst / "model.safetensors").unlink()
    save_model(dst, model)
    save_config(config, dst / "config.json")
    return dst


def names(path: Path) -> set[str]:
    return {
        n
        for f in path.glob("*.safetensors")
        for n, _ in tree_flatten(dict(mx.load(str(f))))
    }
