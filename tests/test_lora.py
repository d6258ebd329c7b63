"""Unmerged recovery LoRA (edge0_eval.engine.lora): exactness, hand reference, file layouts, bad files.

Models are tiny int4 checkpoints (conftest's session fixtures) loaded with `mlx_lm.load`; its
module paths are the engine's for every resident module (checked at the end on a converted
model loaded by `Engine.load`).
"""

from __future__ import annotations

import json
import warnings

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from edge0_eval.engine.lora import (
    LoRALinear,
    apply_lora,
    default_targets,
    find_targets,
    linear_dims,
    load_adapter,
    lora_modules,
    mark_trainable,
    remove_lora,
    save_adapter,
)
from edge0_eval.errors import CheckpointError, ConfigError

TOKENS = mx.array([[3, 17, 42, 7, 99, 5, 250, 11, 64, 8]])
QWEN_Q = "language_model.model.layers.3.self_attn.q_proj"
# Hand-made "published" adapters: a few modules of each kind per family, in layer order
# (the order load_adapter reports targets in).
PUBLISHED = {
    "qwen3_5_moe": [
        "language_model.model.layers.0.linear_attn.in_proj_qkv",
        "language_model.model.layers.1.linear_attn.out_proj",
        "language_model.model.layers.2.mlp.shared_expert.down_proj",
        QWEN_Q,
    ],
    "bailing_hybrid": [
        "model.layers.0.attention.query_key_value",
        "model.layers.0.mlp.up_proj",
        "model.layers.1.attention.kv_a_proj_with_mqa",
        "model.layers.3.mlp.shared_experts.gate_proj",
    ],
    "qwen2_moe": [
        "model.layers.0.self_attn.q_proj",
        "model.layers.1.self_attn.o_proj",
        "model.layers.3.mlp.shared_expert.up_proj",
    ],
}
CKPT = {
    "qwen3_5_moe": "tiny_qwen_q4",
    "bailing_hybrid": "tiny_bailing_q4",
    "qwen2_moe": "tiny_qwen2_q4",
}


@pytest.fixture(params=list(CKPT))
def family(request):
    return request.param


@pytest.fixture
def ckpt(family, request):
    return request.getfixturevalue(CKPT[family])


def load_model(path):
    from mlx_lm import load

    model, _ = load(str(path))
    return model


def logits(model) -> mx.array:
    out = model(TOKENS)
    mx.eval(out)
    return out


def same_bits(a: mx.array, b: mx.array) -> bool:
    """Bit-for-bit equality (also tells -0.0 from +0.0)."""
    a, b = np.array(a), np.array(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def param_names(model) -> list[str]:
    return sorted(k for k, _ in tree_flatten(model.parameters()))


def module(model, path):
    node = model
    for part in path.split("."):
        node = node[int(part)] if isinstance(node, list) else node[part]
    return node


def random_pairs(model, paths, r=16, seed=0, dtype=mx.float16, scale_b=0.05):
    """{key: array} in the published layout for `paths`, non-zero A and B."""
    key = mx.random.key(seed)
    out = {}
    for path in paths:
        in_dims, out_dims = linear_dims(module(model, path))
        key, ka, kb = mx.random.split(key, 3)
        out[f"{path}.lora_A"] = (
            mx.random.normal((r, in_dims), key=ka) * in_dims**-0.5
        ).astype(dtype)
        out[f"{path}.lora_B"] = (
            mx.random.normal((out_dims, r), key=kb) * scale_b
        ).astype(dtype)
    return out


def published_metadata(**overrides) -> dict:
    meta = {
        "model": "edge0-35b",
        "kind": "lora",
        "K": "4",
        "r": "16",
        "alpha": "32.0",
        "source": "hand-made test file",
        "owners": json.dumps([6, 7, 8]),
        "format_version": "1",
    }
    meta.update(overrides)
    return {k: v for k, v in meta.items() if v is not None}


def write(path, arrays, metadata):
    mx.save_safetensors(str(path), arrays, metadata=metadata)
    return path


# -- targets ---------------------------------------------------------------------------------


def test_default_targets_are_resident_linears_only(family, ckpt):
    model = load_model(ckpt)
    paths = find_targets(model, default_targets(family))
    linears = {
        p
        for p, m in model.named_modules()
        if isinstance(m, (nn.Linear, nn.QuantizedLinear))
    }
    assert set(paths) <= linears
    assert not [
        p
        for p in paths
        if "switch_mlp" in p or p.endswith((".mlp.gate", ".mlp.gate.gate_proj"))
    ]
    left = sorted(linears - set(paths))
    if family == "qwen3_5_moe":
        # 3 GatedDeltaNet layers x (5 + 3 shared) + 1 full-attention layer x (4 + 3 shared)
        assert len(paths) == 31
        assert all(
            p == "language_model.lm_head"
            or p.endswith((".mlp.gate", ".mlp.shared_expert_gate"))
            for p in left
        ), left
    elif family == "qwen2_moe":
        # 4 layers x (4 attention + 3 shared expert)
        assert len(paths) == 28
        assert all(
            p == "lm_head" or p.endswith((".mlp.gate", ".mlp.shared_expert_gate"))
            for p in left
        ), left
    else:
        # layer 0: linear attn 3 + dense MLP 3; layer 2: 3 + shared 3; MLA layers 1, 3: 3 + 3
        assert len(paths) == 24
        assert all(p == "lm_head" or p.endswith(".mlp.gate.gate_proj") for p in left), (
            left
        )
    # Routers and experts are refused outright when asked for.
    router = "mlp.gate.gate_proj" if family == "bailing_hybrid" else "mlp.gate"
    with pytest.raises(ConfigError, match="router"):
        find_targets(model, [router])
    with pytest.raises(ConfigError, match="routed expert"):
        find_targets(model, ["switch_mlp.up_proj"])
    with pytest.raises(ConfigError, match="no default LoRA targets"):
        default_targets("llama")


# -- (1) B = 0 leaves logits unchanged bit for bit -------------------------------------------


def test_zero_b_is_bit_identical(family, ckpt, tmp_path):
    model = load_model(ckpt)
    before, names = logits(model), param_names(model)
    paths = apply_lora(model, r=16, alpha=32, init="zeros", seed=3)
    assert len(lora_modules(model)) == len(paths) > 0
    # A is random (the training init), B is zero: the delta is exactly zero.
    assert all(
        mx.any(m.lora_A != 0).item() and not mx.any(m.lora_B != 0).item()
        for m in lora_modules(model).values()
    )
    assert same_bits(logits(model), before)

    # The same through a file, into a fresh model.
    save_adapter(model, tmp_path / "zero.safetensors", {"source": "test", "K": 4})
    fresh = load_model(ckpt)
    meta = load_adapter(fresh, tmp_path / "zero.safetensors")
    assert meta["targets"] == paths
    assert same_bits(logits(fresh), before)

    # remove_lora restores the original modules and parameter names.
    assert remove_lora(model) == paths
    assert param_names(model) == names and not lora_modules(model)
    assert same_bits(logits(model), before)


# -- (2) a non-zero LoRA matches a reference from the dequantized weights --------------------


def test_nonzero_lora_matches_hand_reference(tiny_qwen_q4):
    model = load_model(tiny_qwen_q4)
    before = logits(model)
    assert apply_lora(
        model, r=16, alpha=32, targets=[QWEN_Q], init="random", seed=1
    ) == [QWEN_Q]
    layer = module(model, QWEN_Q)
    assert isinstance(layer, LoRALinear) and isinstance(
        layer.linear, nn.QuantizedLinear
    )
    assert layer.linear.bits == 4 and layer.scale == 2.0

    base = layer.linear
    f32 = mx.float32
    # Dequantize with float32 scales/biases: the exact weights quantized_matmul multiplies by.
    w = np.array(
        mx.dequantize(
            base.weight,
            base.scales.astype(f32),
            base.biases.astype(f32),
            group_size=base.group_size,
            bits=base.bits,
        )
    )
    a, b = (
        np.array(layer.lora_A, dtype=np.float64),
        np.array(layer.lora_B, dtype=np.float64),
    )
    assert np.abs(b).max() > 0
    x16 = mx.random.normal((2, 5, w.shape[1]), key=mx.random.key(7)).astype(mx.float16)
    x = np.array(x16.astype(f32), dtype=np.float64)
    delta = 2.0 * (x @ a.T) @ b.T
    ref = x @ w.T.astype(np.float64) + delta
    # the LoRA term is not negligible
    assert np.abs(delta).max() > 0.05 * np.abs(ref).max()

    # float32 input: everything in float32; within 1e-5 of the largest output.
    y32 = np.array(layer(x16.astype(f32)))
    assert np.abs(y32 - ref).max() <= 1e-5 * np.abs(ref).max()

    # float16 input (what the model runs): the base output is the int4 kernel's own, the
    # delta is added in float32 and rounded once: y == fp16(base(x) + fp16(delta)), so
    # |y - (base(x) + delta)| <= one fp16 ulp of (|y| + |delta|).
    y16 = np.array(layer(x16).astype(f32), dtype=np.float64)
    base16 = np.array(base(x16).astype(f32), dtype=np.float64)
    ulp = 2.0**-10 * (np.abs(y16) + np.abs(delta)) + 2.0**-24
    assert np.all(np.abs(y16 - (base16 + delta)) <= ulp)
    # and against the float64 reference: the fp16 base kernel's rounding, <= 0.5% of max |y|.
    assert np.abs(y16 - ref).max() <= 5e-3 * np.abs(ref).max()

    after = logits(model)
    assert mx.abs(after.astype(f32) - before.astype(f32)).max().item() > 1e-2
    remove_lora(model)
    assert same_bits(logits(model), before)


# -- (3) the published layout loads and equals our own format --------------------------------


def test_published_layout_equals_own_format(family, ckpt, tmp_path):
    model = load_model(ckpt)
    before = logits(model)
    arrays = random_pairs(model, PUBLISHED[family])
    published = write(tmp_path / "published.safetensors", arrays, published_metadata())

    meta = load_adapter(model, published, experts_per_token=4)
    assert meta["targets"] == PUBLISHED[family]
    assert (meta["kind"], meta["r"], meta["alpha"], meta["scale"], meta["K"]) == (
        "lora",
        16,
        32.0,
        2.0,
        4,
    )
    assert meta["owners"] == [6, 7, 8] and meta["model"] == "edge0-35b"
    assert meta["file_dtype"] == "float16"
    from_published = logits(model)
    assert not same_bits(from_published, before)

    # The same tensors set by hand on a fresh model, written by save_adapter, loaded again.
    other = load_model(ckpt)
    apply_lora(other, r=16, alpha=32, targets=PUBLISHED[family])
    for path in PUBLISHED[family]:
        layer = module(other, path)
        layer.lora_A = arrays[f"{path}.lora_A"].astype(mx.float32)
        layer.lora_B = arrays[f"{path}.lora_B"].astype(mx.float32)
    own = save_adapter(
        other,
        tmp_path / "own.safetensors",
        {"source": "test", "K": 4, "stage": "recovery", "step": 120},
    )
    from safetensors import safe_open

    with safe_open(str(own), "numpy") as f:
        header = f.metadata()
        assert sorted(f.keys()) == sorted(arrays)
    assert {
        k: header[k]
        for k in (
            "kind",
            "format_version",
            "r",
            "alpha",
            "K",
            "stage",
            "step",
            "source",
        )
    } == {
        "kind": "lora",
        "format_version": "1",
        "r": "16",
        "alpha": "32",
        "K": "4",
        "stage": "recovery",
        "step": "120",
        "source": "test",
    }
    assert header["model"] == family

    fresh = load_model(ckpt)
    meta2 = load_adapter(fresh, own)
    assert meta2["targets"] == meta["targets"] and meta2["step"] == 120
    assert same_bits(logits(fresh), from_published)


def test_bfloat16_file_and_alpha_override(tiny_bailing_q4, tmp_path):
    model = load_model(tiny_bailing_q4)
    paths = PUBLISHED["bailing_hybrid"]
    arrays = random_pairs(model, paths, dtype=mx.bfloat16)
    bf16 = write(tmp_path / "bf16.safetensors", arrays, published_metadata())
    assert load_adapter(model, bf16)["file_dtype"] == "bfloat16"
    got = logits(model)
    # bf16 -> float32 is exact, so a float32 file of the same values gives the same logits.
    fp32 = save_adapter(model, tmp_path / "fp32.safetensors", dtype="float32")
    fresh = load_model(tiny_bailing_q4)
    load_adapter(fresh, fp32)
    assert same_bits(logits(fresh), got)

    # No alpha in the file: an explicit alpha is required, and is used.
    no_alpha = write(
        tmp_path / "noalpha.safetensors", arrays, published_metadata(alpha=None)
    )
    with pytest.raises(CheckpointError, match="'alpha' is missing"):
        load_adapter(fresh, no_alpha)
    assert load_adapter(fresh, no_alpha, alpha=32)["scale"] == 2.0
    assert same_bits(logits(fresh), got)
    # No r in the file: inferred from the shapes.
    no_r = write(tmp_path / "nor.safetensors", arrays, published_metadata(r=None))
    assert load_adapter(fresh, no_r)["r"] == 16


def test_k_mismatch_warns_and_reload_replaces(tiny_qwen_q4, tmp_path):
    model = load_model(tiny_qwen_q4)
    first = write(
        tmp_path / "a.safetensors",
        random_pairs(model, PUBLISHED["qwen3_5_moe"]),
        published_metadata(),
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_adapter(model, first, experts_per_token=8)
    assert any("K=4" in str(w.message) for w in caught)
    in_fp32 = logits(model)
    # The reference deployment's fp16 LoRA path, on request: same result to fp16 rounding.
    load_adapter(model, first, compute_dtype=mx.float16)
    assert all(m.lora_A.dtype == mx.float16 for m in lora_modules(model).values())
    assert np.allclose(np.array(logits(model)), np.array(in_fp32), atol=2e-2, rtol=1e-2)

    second = write(
        tmp_path / "b.safetensors",
        random_pairs(model, [QWEN_Q], seed=5),
        published_metadata(K=None),
    )
    load_adapter(model, second)
    assert list(lora_modules(model)) == [QWEN_Q]  # the previous adapter is gone


def test_training_helpers(tiny_qwen_q4, tmp_path):
    model = load_model(tiny_qwen_q4)
    paths = apply_lora(model, r=8, alpha=16, init="zeros")
    with pytest.raises(ConfigError, match="already has LoRA"):
        apply_lora(model, r=8, alpha=16)
    mark_trainable(model)
    trainable = [k for k, _ in tree_flatten(model.trainable_parameters())]
    assert sorted(trainable) == sorted(f"{p}.lora_{m}" for p in paths for m in "AB")
    with pytest.raises(ConfigError, match="contradicts"):
        save_adapter(model, tmp_path / "x.safetensors", {"r": 16})
    with pytest.raises(ConfigError, match="init"):
        apply_lora(load_model(tiny_qwen_q4), init="gaussian")
    with pytest.raises(ConfigError, match="no LoRA layers"):
        save_adapter(load_model(tiny_qwen_q4), tmp_path / "y.safetensors")


# -- (4) bad files: one clear error, model unchanged -----------------------------------------


def _bad_cases(model):
    """name -> (arrays, metadata, text the error must contain besides the file path)."""
    good = random_pairs(
        model, [QWEN_Q, "language_model.model.layers.0.linear_attn.in_proj_z"]
    )
    meta = published_metadata()
    a_key, b_key = f"{QWEN_Q}.lora_A", f"{QWEN_Q}.lora_B"

    def replaced(key, value):
        return {**good, key: value}

    def renamed(module_path):
        out = dict(good)
        out[f"{module_path}.lora_A"] = out.pop(a_key)
        out[f"{module_path}.lora_B"] = out.pop(b_key)
        return out

    missing = "language_model.model.layers.99.self_attn.q_proj"
    router = "language_model.model.layers.0.mlp.gate"
    expert = "language_model.model.layers.0.mlp.switch_mlp.up_proj"
    norm = "language_model.model.layers.0.input_layernorm"
    return {
        "wrong kind": (good, {**meta, "kind": "prerouter"}, "'kind'"),
        "A wrong shape": (replaced(a_key, mx.zeros((16, 32), mx.float16)), meta, a_key),
        "B wrong shape": (replaced(b_key, mx.zeros((64, 16), mx.float16)), meta, b_key),
        "rank vs metadata": (
            replaced(a_key, mx.zeros((8, 64), mx.float16)),
            meta,
            a_key,
        ),
        "3-d tensor": (replaced(a_key, mx.zeros((1, 16, 64), mx.float16)), meta, a_key),
        "integer tensor": (replaced(b_key, mx.zeros((128, 16), mx.int32)), meta, b_key),
        "module does not exist": (renamed(missing), meta, f"{missing}.lora_A"),
        "router": (renamed(router), meta, "router"),
        "routed expert": (renamed(expert), meta, "routed expert"),
        "not a linear": (renamed(norm), meta, "RMSNorm"),
        "B missing": ({k: v for k, v in good.items() if k != b_key}, meta, b_key),
        "unexpected key": (
            {**good, f"{QWEN_Q}.weight": mx.zeros((4,))},
            meta,
            f"{QWEN_Q}.weight",
        ),
        "NaN": (
            replaced(b_key, mx.full((128, 16), float("nan"), mx.float16)),
            meta,
            b_key,
        ),
        "format version": (good, {**meta, "format_version": "2"}, "'format_version'"),
        "alpha not a number": (good, {**meta, "alpha": "big"}, "'alpha'"),
        "no tensors": ({}, meta, "no tensors"),
    }


@pytest.mark.parametrize(
    "case",
    [
        "wrong kind",
        "A wrong shape",
        "B wrong shape",
        "rank vs metadata",
        "3-d tensor",
        "integer tensor",
        "module does not exist",
        "router",
        "routed expert",
        "not a linear",
        "B missing",
        "unexpected key",
        "NaN",
        "format version",
        "alpha not a number",
        "no tensors",
        "missing file",
        "truncated file",
        "not safetensors",
    ],
)
def test_bad_file_one_clear_error_model_unchanged(case, tiny_qwen_q4, tmp_path):
    model = load_model(tiny_qwen_q4)
    before, names = logits(model), param_names(model)
    path = tmp_path / "adapter.safetensors"
    if case == "missing file":
        expect = "not found"
    elif case in ("truncated file", "not safetensors"):
        write(path, random_pairs(model, [QWEN_Q]), published_metadata())
        data = path.read_bytes()
        path.write_bytes(
            data[: len(data) - 100] if case == "truncated file" else b"\0" * 64
        )
        expect = "truncated or corrupt"
    else:
        arrays, meta, expect = _bad_cases(model)[case]
        if arrays:
            write(path, arrays, meta)
        else:  # mx.save_safetensors needs a tensor; write the empty file by hand
            header = json.dumps({"__metadata__": meta}).encode()
            path.write_bytes(len(header).to_bytes(8, "little") + header)
    with pytest.raises(CheckpointError) as info:
        load_adapter(model, path)
    message = str(info.value)
    assert str(path) in message and expect in message and "\n" not in message, message
    assert not lora_modules(model) and param_names(model) == names
    assert same_bits(logits(model), before)


def test_failed_load_keeps_previous_adapter(tiny_qwen_q4, tmp_path):
    model = load_model(tiny_qwen_q4)
    good = write(
        tmp_path / "good.safetensors",
        random_pairs(model, PUBLISHED["qwen3_5_moe"]),
        published_metadata(),
    )
    load_adapter(model, good)
    with_lora = logits(model)
    bad = write(
        tmp_path / "bad.safetensors",
        random_pairs(model, [QWEN_Q]),
        published_metadata(kind="prerouter"),
    )
    with pytest.raises(CheckpointError, match="prerouter"):
        load_adapter(model, bad)
    assert list(lora_modules(model)) == PUBLISHED["qwen3_5_moe"]
    assert same_bits(logits(model), with_lora)


# -- the engine's model has the same paths ---------------------------------------------------


@pytest.fixture
def converted(family, ckpt, tmp_path_factory):
    from edge0_eval.checkpoints.conversion import convert

    return convert(ckpt, tmp_path_factory.mktemp("edge0") / family, progress=False)


def test_engine_model_takes_the_same_adapter(family, ckpt, converted, tmp_path):
    from edge0_eval.engine.engine import Engine
    from edge0_eval.engine.mlx_compat import cast_floating, resolve_compute_dtype
    from edge0_eval.engine.options import EngineOptions

    reference = load_model(ckpt)
    # The engine's dtype policy (float32 activations on CPU), applied to mlx-lm's model too.
    cast_floating(reference, resolve_compute_dtype("auto"))
    adapter = write(
        tmp_path / "a.safetensors",
        random_pairs(reference, find_targets(reference, default_targets(family))),
        published_metadata(),
    )
    meta = load_adapter(reference, adapter)
    expected = logits(reference)

    engine = Engine.load(converted, EngineOptions(mode="resident"))
    try:

        def forward():  # every position's logits, from an empty cache
            return engine.step(
                TOKENS, engine.step.new_cache(), plan_next=False, all_logits=True
            )[0]

        plain = forward()
        apply_lora(engine.model, init="zeros")  # B = 0: bit-identical in the engine too
        assert same_bits(forward(), plain)
        assert load_adapter(engine.model, adapter)["targets"] == meta["targets"]
        got = forward()
        assert same_bits(got, expected)
        assert not same_bits(got, plain)
    finally:
        engine.close()
