"""Checkpoints in the layouts people download (`real_layouts.py`) convert through mlx-lm's own
`sanitize` and match what mlx-lm loads from the same files, or are refused before anything is
written with the cause and the fix named."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_model, quantize_model
from real_layouts import hf_ling, hf_qwen, mlx_vlm_style
from test_convert import (
    TOKENS,
    _assert_matches_quantize_model,
    assert_same_tensors,
    load_converted,
    nothing_written,
)

from edge0_eval.checkpoints.conversion import convert
from edge0_eval.checkpoints.tiny import TinyShape, write_tiny
from edge0_eval.engine.engine import Engine
from edge0_eval.engine.mlx_compat import cast_floating, resolve_compute_dtype
from edge0_eval.engine.options import EngineOptions
from edge0_eval.errors import CheckpointError
from edge0_eval.formats.layout import RESIDENT_NAME

PROMPT = [5, 17, 42, 99, 3]


def _greedy(model, n: int) -> list[int]:
    # The engine's dtype policy (float32 activations on CPU), applied to mlx-lm's model too.
    cast_floating(model, resolve_compute_dtype("auto"))
    return [int(t) for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=n)]


def _engine_greedy(out, n: int) -> list[int]:
    engine = Engine.load(out, EngineOptions(mode="reactive", no_lora=True))
    try:
        return engine.generate(PROMPT, max_tokens=n, stop_token_ids=set()).tokens
    finally:
        engine.close()


def _no_side_weights(out) -> None:
    resident = mx.load(str(out / RESIDENT_NAME))
    assert not [n for n in resident if "vision" in n or "visual" in n or "mtp" in n]


def test_mlx_vlm_quantized_conversion_serves_mlx_lm_tokens(tiny_qwen_q4, tmp_path):
    """mlx-community Qwen3.5/3.6 conversions (made by mlx-vlm) carry quantized vision-tower and
    MTP weights: dropped as mlx-lm drops them, the rest repacked bit for bit."""
    src = mlx_vlm_style(tiny_qwen_q4, tmp_path / "src")
    out = convert(src, tmp_path / "out", progress=False)
    _no_side_weights(out)
    reference, _ = load(str(src))
    ours = load_converted(out)
    assert_same_tensors(
        dict(tree_flatten(ours.parameters())),
        dict(tree_flatten(reference.parameters())),
    )
    assert mx.array_equal(ours(TOKENS), reference(TOKENS)).item()
    assert _engine_greedy(out, 8) == _greedy(reference, 8)


@pytest.mark.parametrize(
    "layout,fixture",
    [(mlx_vlm_style, "tiny_qwen"), (hf_qwen, "tiny_qwen"), (hf_ling, "tiny_bailing")],
)
def test_float_layouts_quantized_exactly_as_mlx_lm(layout, fixture, request, tmp_path):
    """bf16/fp16 mlx-vlm conversions and original Hugging Face layouts (fused gate_up experts,
    offset norms, HF conv shapes; Ling's per-expert keys, gate.weight, kv_b_proj, MTP layer)."""
    src = layout(request.getfixturevalue(fixture), tmp_path / "src")
    out = convert(src, tmp_path / "out", progress=False)
    _no_side_weights(out)
    _assert_matches_quantize_model(src, out)


def test_hugging_face_layout_serves_mlx_lm_tokens(tiny_qwen, tmp_path):
    src = hf_qwen(tiny_qwen, tmp_path / "src")
    out = convert(src, tmp_path / "out", progress=False)
    model, config = load_model(src)
    reference, _ = quantize_model(model, config, group_size=64, bits=4)
    assert _engine_greedy(out, 8) == _greedy(reference, 8)


def _refused(src, tmp_path, match: str) -> None:
    with pytest.raises(CheckpointError, match=match):
        convert(src, tmp_path / "out", progress=False)
    assert nothing_written(tmp_path, {src.name})


@pytest.mark.parametrize("quantized", [False, True])
def test_tensor_neither_used_nor_dropped_is_named(
    quantized, tiny_qwen, tiny_qwen_q4, tmp_path
):
    src = tmp_path / "src"
    mlx_vlm_style(tiny_qwen_q4 if quantized else tiny_qwen, src)
    weights = dict(mx.load(str(src / "model.safetensors")))
    weights["language_model.model.layers.0.adapter.weight"] = mx.zeros((4, 4))
    mx.save_safetensors(
        str(src / "model.safetensors"), weights, metadata={"format": "mlx"}
    )
    _refused(
        src,
        tmp_path,
        r"1 tensor\(s\) are neither used by the qwen3_5_moe model nor "
        r"dropped by mlx-lm's sanitize, e.g. "
        r"language_model.model.layers.0.adapter.weight; nothing was written",
    )


def test_hugging_face_load_time_quantization_refused_with_the_fix(tiny_qwen, tmp_path):
    src = hf_qwen(tiny_qwen, tmp_path / "src")
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    }
    (src / "config.json").write_text(json.dumps(config))
    _refused(src, tmp_path, "quant_method 'fp8'.*mlx_lm.convert --hf-path SRC")


def test_sanitize_failure_is_one_clear_error(tiny_bailing, tmp_path):
    """Ling's per-expert keys with one expert missing: mlx-lm's sanitize raises KeyError."""
    src = hf_ling(tiny_bailing, tmp_path / "src")
    weights = dict(mx.load(str(src / "model.safetensors")))
    del weights["model.layers.1.mlp.experts.3.up_proj.weight"]
    mx.save_safetensors(
        str(src / "model.safetensors"), weights, metadata={"format": "mlx"}
    )
    _refused(
        src, tmp_path, "sanitize for model_type 'bailing_hybrid' failed.*do not match"
    )


@pytest.mark.parametrize("layout", [None, hf_qwen])
def test_convert_holds_about_one_layer_at_a_time(layout, tmp_path):
    """Sanitize is applied lazily: a fused HF source is read one layer's tensors at a time too."""
    src = write_tiny(
        tmp_path / "src",
        TinyShape(layers=8, hidden=128, moe_intermediate=128, experts=32),
    )
    if layout is not None:
        src = layout(src, tmp_path / "layout")
    weights = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    mx.clear_cache()
    mx.reset_peak_memory()
    # Arrays other tests' fixtures keep alive count in the peak too; only convert's own do.
    held = mx.get_active_memory()
    convert(src, tmp_path / "out", progress=False)
    # One layer's experts are an eighth of this source; all of them would be the whole.
    assert mx.get_peak_memory() - held < weights / 4


def test_expert_scales_whose_dtype_changes_by_layer_are_refused(tiny_qwen_q4, tmp_path):
    """Expert scales keep one float dtype: a layer whose scales are float32 while the
    others' are float16 is refused naming it (the last layer's dtype would have won)."""
    src = tmp_path / "src"
    mlx_vlm_style(tiny_qwen_q4, src)
    weights = dict(mx.load(str(src / "model.safetensors")))
    name = "language_model.model.layers.2.mlp.switch_mlp.up_proj.scales"
    weights[name] = weights[name].astype(mx.float32)
    mx.save_safetensors(
        str(src / "model.safetensors"), weights, metadata={"format": "mlx"}
    )
    _refused(
        src,
        tmp_path,
        "layers.2.mlp.switch_mlp.up_proj.scales is float32 but .* is float16; expert "
        "scales and biases must share one float dtype",
    )
