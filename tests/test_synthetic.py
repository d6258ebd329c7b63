"""`edge0-eval make-synthetic`: real tier shapes in the streaming layout, loadable by mlx-lm."""

from __future__ import annotations

import json
import subprocess
import sys
import zlib

import mlx.core as mx
import pytest
from mlx.utils import tree_map
from test_convert import load_converted

from edge0_eval.checkpoints.synthetic import (
    Quantization,
    estimate_bytes,
    write_synthetic,
)
from edge0_eval.engine.engine import Engine
from edge0_eval.engine.options import EngineOptions
from edge0_eval.errors import ConfigError
from edge0_eval.formats.layout import EXPERTS_NAME, RESIDENT_NAME, ExpertIndex

SMALL_35B = {
    "num_experts": 8,
    "vocab_size": 1024,
}  # real per-layer shape, fewer experts
SMALL_8B = {"num_experts": 16, "vocab_size": 1024}  # 16 = 8 groups x 2 (group routing)


def _check_index(out, layers, experts, bundle_bytes):
    index = ExpertIndex.load(out)  # validates geometry and file size
    assert index.moe_layers == layers and index.num_experts == experts
    assert index.describe_quant() == "4-bit group 64 affine"
    (layout,) = index.layouts
    assert layout.bundle_bytes == bundle_bytes and layout.bundle_stride % 4096 == 0
    assert (out / EXPERTS_NAME).stat().st_size == len(
        layers
    ) * experts * layout.bundle_stride
    data = (out / EXPERTS_NAME).read_bytes()
    for pos, layer in enumerate(layers):
        for e in (0, experts - 1):
            start = index.bundle_offset(layer, e)
            assert (
                zlib.crc32(data[start : start + layout.bundle_stride])
                == index.crc32[pos][e]
            )
    return index


def _forward_is_sane(model):
    """Random int4 weights must give finite, O(1) logits (fp32: MLX's CPU fp16 qmm is slow)."""
    model.update(
        tree_map(
            lambda a: (
                a.astype(mx.float32) if mx.issubdtype(a.dtype, mx.floating) else a
            ),
            model.parameters(),
        )
    )
    logits = model(mx.array([[1, 2, 3, 4, 5, 6, 7, 8]]))
    assert mx.all(mx.isfinite(logits)).item()
    assert 0.05 < logits.std().item() < 20


def test_35b_shape_two_layers(tmp_path):
    out = write_synthetic(
        tmp_path / "o", "35b", layers=2, overrides=SMALL_35B, progress=False
    )
    index = _check_index(out, [0, 1], 8, bundle_bytes=1769472)  # 1.77 MB per expert
    assert index.model_type == "qwen3_5_moe"
    assert index.module_path == "language_model.model.layers.{layer}.mlp.switch_mlp"
    assert index.layouts[0].tensor("gate_proj.weight").shape == [512, 256]
    assert index.layouts[0].tensor("down_proj.scales").shape == [2048, 8]
    config = json.loads((out / "config.json").read_text())
    text = config["text_config"]
    assert (
        text["hidden_size"],
        text["num_attention_heads"],
        text["num_key_value_heads"],
        text["head_dim"],
        text["linear_num_value_heads"],
        text["linear_num_key_heads"],
        text["moe_intermediate_size"],
        text["num_experts_per_tok"],
    ) == (2048, 16, 2, 256, 32, 16, 512, 8)
    routers = {
        f"language_model.model.layers.{l}.mlp.{m}": {"group_size": 64, "bits": 8}
        for l in (0, 1)
        for m in ("gate", "shared_expert_gate")
    }
    assert config["quantization"] == {
        "group_size": 64,
        "bits": 4,
        "mode": "affine",
        **routers,
    }
    assert config["quantization_config"] == config["quantization"]
    resident = mx.load(str(out / RESIDENT_NAME))
    assert resident["language_model.model.embed_tokens.weight"].shape == (1024, 256)
    assert resident["language_model.model.layers.0.mlp.gate.weight"].shape == (
        8,
        512,
    )  # 8-bit
    load_converted(out)  # mlx-lm builds the model and loads every weight, strictly


def test_35b_shape_forward_covers_both_attention_kinds(tmp_path):
    # 4 layers: three GatedDeltaNet + one full attention (mlx-lm needs one of each to run).
    out = write_synthetic(
        tmp_path / "o", "35b", layers=4, overrides=SMALL_35B, progress=False
    )
    _forward_is_sane(load_converted(out))


def test_8b_shape_two_layers(tmp_path):
    out = write_synthetic(
        tmp_path / "o", "8b", layers=2, overrides=SMALL_8B, progress=False
    )
    index = _check_index(out, [1], 16, bundle_bytes=1327104)  # layer 0 is dense
    assert index.model_type == "bailing_hybrid"
    assert index.module_path == "model.layers.{layer}.mlp.switch_mlp"
    config = json.loads((out / "config.json").read_text())
    assert (
        config["hidden_size"],
        config["num_experts_per_tok"],
        config["n_group"],
        config["topk_group"],
        config["routed_scaling_factor"],
        config["score_function"],
        config["num_shared_experts"],
        config["first_k_dense_replace"],
    ) == (1536, 8, 8, 4, 2.5, "sigmoid", 1, 1)
    assert config["quantization"] == {
        "group_size": 64,
        "bits": 4,
        "mode": "affine",
        "model.layers.1.mlp.gate.gate_proj": {"group_size": 64, "bits": 8},
    }
    resident = mx.load(str(out / RESIDENT_NAME))
    assert resident["model.layers.1.mlp.gate.expert_bias"].dtype == mx.float32
    # unquantized
    assert resident["model.layers.1.attention.embed_q.weight"].dtype == mx.float16
    _forward_is_sane(load_converted(out))


# Quantization -> the experts' quantization in words and each layer's bundle bytes, at the
# real 35B expert shape (gate/up 512 x 2048, down 2048 x 512), 4 layers.
_2_3_BITS = (
    "gate_proj 2-bit group 64 affine, up_proj 2-bit group 64 affine, "
    "down_proj 3-bit group 64 affine"
)
MIXES = {
    "experts_2_3": (Quantization(recipe="experts_2_3"), _2_3_BITS, [1114112] * 4),
    "config_i": (
        Quantization(recipe="config_i"),
        f"layer(s) 0, 3: 8-bit group 64 affine; layer(s) 1, 2: {_2_3_BITS}",
        [3342336, 1114112, 1114112, 3342336],
    ),
    "mixed_4_6": (
        Quantization(recipe="mixed_4_6"),
        "layer(s) 0, 1: 4-bit group 64 affine; layer(s) 2, 3: gate_proj 4-bit group 64 "
        "affine, up_proj 4-bit group 64 affine, down_proj 6-bit group 64 affine",
        [1769472, 1769472, 2031616, 2031616],
    ),
    "mxfp4": (Quantization(mode="mxfp4"), "4-bit group 32 mxfp4", [1671168] * 4),
    "mxfp8": (Quantization(mode="mxfp8"), "8-bit group 32 mxfp8", [3244032] * 4),
    "nvfp4": (Quantization(mode="nvfp4"), "4-bit group 16 nvfp4", [1769472] * 4),
}


@pytest.mark.parametrize("mix", MIXES)
def test_35b_shape_in_a_mixed_quantization(mix, tmp_path):
    """make-synthetic --recipe / --mode: the experts in the mix (bytes per bundle as the bits
    say), a config mlx-lm loads strictly, O(1) logits, and the engine decodes it."""
    quantization, words, strides = MIXES[mix]
    out = write_synthetic(
        tmp_path / "o",
        "35b",
        layers=4,
        overrides=SMALL_35B,
        progress=False,
        quantization=quantization,
    )
    index = ExpertIndex.load(out)
    assert index.describe_quant() == words
    assert [index.layout(layer).bundle_bytes for layer in index.moe_layers] == strides
    sizes = estimate_bytes("35b", 4, SMALL_35B, quantization)
    assert (
        sizes["experts"]
        == index.file_size
        == 8 * sum(index.layout(layer).bundle_stride for layer in index.moe_layers)
    )
    assert sizes["resident"] == sum(
        v.nbytes for v in mx.load(str(out / RESIDENT_NAME)).values()
    )
    _forward_is_sane(load_converted(out))
    engine = Engine.load(out, EngineOptions(mode="reactive", experts_per_token=4))
    try:
        result = engine.generate([1, 2, 3, 4], max_tokens=3, stop_token_ids=set())
        assert len(result.tokens) == 3 and result.stats["bytes_read"] > 0
    finally:
        engine.close()


def test_recipe_with_a_float_mode_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="--recipe experts_2_3 is affine"):
        write_synthetic(
            tmp_path / "o",
            "35b",
            layers=1,
            overrides=SMALL_35B,
            progress=False,
            quantization=Quantization(mode="mxfp4", recipe="experts_2_3"),
        )
    assert list(tmp_path.iterdir()) == []


def test_seeded_and_layer_count_independent(tmp_path):
    a = write_synthetic(
        tmp_path / "a", "8b", layers=2, overrides=SMALL_8B, progress=False
    )
    b = write_synthetic(
        tmp_path / "b", "8b", layers=3, overrides=SMALL_8B, progress=False
    )
    c = write_synthetic(
        tmp_path / "c", "8b", layers=2, seed=1, overrides=SMALL_8B, progress=False
    )
    a_bytes = (a / EXPERTS_NAME).read_bytes()
    assert (b / EXPERTS_NAME).read_bytes()[: len(a_bytes)] == a_bytes
    assert (c / EXPERTS_NAME).read_bytes() != a_bytes
    ra, rb = mx.load(str(a / RESIDENT_NAME)), mx.load(str(b / RESIDENT_NAME))
    for name in (
        "model.word_embeddings.weight",
        "model.layers.1.mlp.gate.gate_proj.scales",
    ):
        assert mx.array_equal(ra[name], rb[name]).item()


def test_full_tier_sizes():
    """The real shapes without writing them: 35B ~19.5 GB int4 of which experts 18.1 GB."""
    big = estimate_bytes("35b")
    assert big["experts"] == 40 * 256 * 1769472
    assert 19.3e9 < big["experts"] + big["resident"] < 19.7e9
    small = estimate_bytes("8b")
    assert small["experts"] == 23 * 128 * 1327104
    assert estimate_bytes("35b", layers=4)["experts"] == 4 * 256 * 1769472


@pytest.mark.parametrize(
    "shape, layers, overrides, message",
    [
        ("8b", 1, None, "at least 2"),
        ("8b", 2, {"num_experts": 8}, "does not fit 8-group routing"),
        ("35b", 0, None, "at least 1"),
        ("13b", 2, None, "unknown --shape"),
    ],
)
def test_bad_options_write_nothing(tmp_path, shape, layers, overrides, message):
    with pytest.raises(ConfigError, match=message):
        write_synthetic(
            tmp_path / "o", shape, layers=layers, overrides=overrides, progress=False
        )
    assert list(tmp_path.iterdir()) == []


def test_cli(tmp_path):
    out = tmp_path / "o"
    cmd = [
        sys.executable,
        "-m",
        "edge0_eval",
        "make-synthetic",
        str(out),
        "--shape",
        "8b",
        "--layers",
        "2",
        "--experts",
        "16",
        "--vocab",
        "1024",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "1 MoE layers x 16 experts" in proc.stdout
    proc = subprocess.run(cmd, capture_output=True, text=True)  # now OUT is not empty
    assert proc.returncode == 2 and "exists and is not empty" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--recipe", "experts_2_3"], "down_proj 3-bit group 64 affine"),
        (["--mode", "mxfp8"], "8-bit group 32 mxfp8"),
        (["--bits", "3", "--group-size", "32"], "3-bit group 32 affine"),
    ],
)
def test_cli_quantization_flags(tmp_path, flags, words):
    from edge0_eval.cli import main

    out = tmp_path / "o"
    argv = ["make-synthetic", str(out), "--shape", "8b", "--layers", "2"]
    assert main(argv + ["--experts", "16", "--vocab", "1024", *flags]) == 0
    assert words in ExpertIndex.load(out).describe_quant()


def test_cli_bits_the_mode_has_not_refused(tmp_path, capsys):
    from edge0_eval.cli import main

    argv = ["make-synthetic", str(tmp_path / "o"), "--shape", "8b", "--layers", "2"]
    assert main(argv + ["--mode", "mxfp4", "--bits", "8"]) == 2
    err = capsys.readouterr().err
    assert "--bits 8 is not supported by --mode mxfp4" in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []
