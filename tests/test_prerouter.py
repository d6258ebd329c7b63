"""Prerouter heads: batched computation, warm start, family selection rule, file format."""

from __future__ import annotations

import json
import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from edge0_eval.engine.counters import Counters
from edge0_eval.engine.heads import (
    check_owners,
    default_owners,
    init_heads_from_routers,
    load_heads,
    router_weight,
    save_heads,
    tier_defaults,
)
from edge0_eval.engine.routing import (
    Prerouter,
    PrerouterHeads,
    RoutingRule,
    build_features,
    onehot,
    stack_rules,
)
from edge0_eval.errors import CheckpointError, ConfigError
from edge0_eval.formats.heads_file import KIND, PrerouterConfig, read_metadata

FAMILIES = ("qwen3_5_moe", "bailing_hybrid", "qwen2_moe")


def converted_model(tmp_path_factory, family: str):
    """A float32 tiny int4 model in the streaming layout, built once per test session.

    float32: MLX's fp16 matmuls are ~50x slower than fp32 on this CPU, and the prerouter logic
    does not depend on the dtype.
    """
    from edge0_eval.checkpoints.conversion import convert
    from edge0_eval.checkpoints.tiny import TinyShape, write_tiny

    base = tmp_path_factory.getbasetemp() / "prerouter_models"
    out = base / family
    if not (out / "experts.index.json").is_file():
        src = write_tiny(
            base / f"{family}_src",
            TinyShape(family=family, dtype="float32"),
            quantize_bits=4,
        )
        convert(src, out, progress=False)
    return out


@pytest.fixture(scope="module", params=FAMILIES)
def engine(request, tmp_path_factory):
    from edge0_eval.engine.engine import Engine
    from edge0_eval.engine.options import EngineOptions

    eng = Engine.load(
        converted_model(tmp_path_factory, request.param), EngineOptions(mode="reactive")
    )
    yield eng
    eng.close()


def random_heads(
    owners=(2, 3, 5), width=8, hidden=12, experts=6, k=2, seed=0, dtype=mx.float32
):
    cfg = PrerouterConfig(
        owners=list(owners),
        width=width,
        experts_per_token=k,
        hidden=hidden,
        num_experts=experts,
    )
    keys = mx.random.split(mx.random.key(seed), 3)
    o, d = len(owners), cfg.in_dim
    return PrerouterHeads(
        cfg,
        mx.random.normal((o, width, d), key=keys[0]).astype(dtype),
        mx.random.normal((o, experts, width), key=keys[1]).astype(dtype),
        mx.random.normal((o, experts, d), key=keys[2]).astype(dtype),
    )


# -- heads ---------------------------------------------------------------------------------------


def test_heads_batched_equals_per_owner_formula():
    heads = random_heads()
    feats = mx.random.normal((3, 5, heads.config.in_dim), key=mx.random.key(7))
    out = heads(feats)
    assert out.shape == (3, 5, 6)
    for i in range(3):
        x = np.array(feats[i], dtype=np.float64)
        fc1, fc2 = (
            np.array(heads.fc1[i], np.float64),
            np.array(heads.fc2[i], np.float64),
        )
        lin = np.array(heads.linear[i], np.float64)
        pre = x @ fc1.T
        erf = np.vectorize(math.erf)
        gelu = pre * (1 + erf(pre / math.sqrt(2))) / 2  # exact (erf) GELU, not tanh
        want = gelu @ fc2.T + x @ lin.T
        np.testing.assert_allclose(np.array(out[i]), want, rtol=1e-4, atol=1e-4)
    # extra leading dims are carried through
    assert heads(feats.reshape(3, 5, 1, -1)).shape == (3, 5, 1, 6)


def test_heads_parameters_are_the_stacked_weights_only():
    from mlx.utils import tree_flatten

    heads = random_heads()
    names = sorted(k for k, _ in tree_flatten(heads.trainable_parameters()))
    assert names == ["fc1", "fc2", "linear"]
    with pytest.raises(ValueError):
        PrerouterHeads(heads.config, heads.fc1[:2], heads.fc2, heads.linear)


def test_select_owners_subset():
    heads = random_heads()
    sub = heads.select_owners([5, 2])
    assert sub.owners == [2, 5] and sub.config.start_layer == 3
    assert mx.array_equal(sub.fc1[1], heads.fc1[2])
    with pytest.raises(ConfigError, match="owner layer"):
        heads.select_owners([4])


def test_onehot_and_build_features():
    inds = mx.array([[[0, 3]], [[5, 1]]])  # [O=2, B=1, K=2]
    oh = onehot(inds, 6)
    assert oh.tolist() == [[[1, 0, 0, 1, 0, 0]], [[0, 1, 0, 0, 0, 1]]]
    # "no previous token"
    assert onehot(mx.array([[-1, -1]]), 4).tolist() == [[0, 0, 0, 0]]
    h = mx.ones((2, 1, 3))
    f = build_features(h, oh, mx.zeros_like(oh))
    assert f.shape == (2, 1, 3 + 12)
    assert f[0, 0].tolist() == [1, 1, 1] + [1, 0, 0, 1, 0, 0] + [0] * 6
    with pytest.raises(ValueError):
        build_features(h, oh, oh[:1])


# -- owners / defaults ---------------------------------------------------------------------------


def test_default_owners_and_tiers():
    assert default_owners(7, 40, list(range(40))) == list(range(6, 39))  # 35B: 6..38
    assert default_owners(8, 24, list(range(1, 24))) == list(range(7, 23))  # 8B: 7..22
    assert default_owners(2, 4, [1, 2, 3]) == [1, 2]
    t35 = tier_defaults("qwen3_5_moe", 40, 2048, 256, list(range(40)))
    assert t35 == {
        "experts_per_token": 4,
        "start_layer": 0,
        "width": 512,
    }  # reports/testbed/next_token.md
    t8 = tier_defaults("bailing_hybrid", 24, 1536, 128, list(range(1, 24)))
    assert t8 == {"experts_per_token": 8, "start_layer": 0, "width": 512}
    tiny = tier_defaults("bailing_hybrid", 4, 64, 16, [1, 2, 3])
    assert tiny == {"experts_per_token": None, "start_layer": 2, "width": 128}
    assert check_owners([2, 1], [1, 2, 3]) == [1, 2]
    with pytest.raises(ConfigError, match="both be MoE"):
        check_owners([0], [1, 2, 3])  # layer 0 is dense in bailing
    with pytest.raises(ConfigError, match="both be MoE"):
        check_owners([3], [1, 2, 3], [4])  # nothing after the last layer
    assert check_owners([3], [1, 2, 3]) == [3]  # by default it wraps to the first
    with pytest.raises(ConfigError):
        check_owners([], [1, 2, 3])


# -- engine: warm start, selection rule, traces ----------------------------------------------------


def test_init_heads_equal_next_router_on_current_hidden(engine):
    owners = [n for n in engine.moe_layers if n + 1 in engine.moe_layers]
    heads = init_heads_from_routers(engine, owners, width=16, seed=0)
    cfg = heads.config
    assert cfg.owners == owners and cfg.start_layer == owners[0] + 1
    assert (
        cfg.experts_per_token == engine.experts_per_token
        and cfg.in_dim == cfg.hidden + 2 * cfg.num_experts
    )
    assert heads.fc1.shape == (len(owners), 16, cfg.in_dim)
    assert not heads.fc2.any().item()  # fc2 starts at zero
    # one-hot columns zero-padded
    assert not heads.linear[:, :, cfg.hidden :].any().item()
    x = mx.random.normal((len(owners), 5, cfg.hidden), key=mx.random.key(1))
    oh = onehot(
        mx.random.randint(0, cfg.num_experts, (len(owners), 5, cfg.experts_per_token)),
        cfg.num_experts,
    )
    logits = heads(build_features(x, oh, oh))
    for i, n in enumerate(owners):
        block = engine.blocks[n + 1]
        assert isinstance(block.router, nn.QuantizedLinear)  # 8-bit router dequantized
        want = block.router(x[i])
        np.testing.assert_allclose(
            np.array(logits[i]), np.array(want), rtol=1e-4, atol=1e-4
        )


def test_router_bias_is_folded_into_onehot_columns():
    lin = nn.Linear(4, 3, bias=True)
    block = type("B", (), {"router": lin})()
    w, b = router_weight(block)
    assert b is not None
    from edge0_eval.engine.heads import heads_from_router_weights

    cfg = PrerouterConfig(
        owners=[0], width=2, experts_per_token=2, hidden=4, num_experts=3
    )
    heads = heads_from_router_weights(cfg, [w], [b], seed=0)
    x = mx.random.normal((1, 7, 4))
    oh = onehot(mx.array([[[0, 2]] * 7]), 3)
    np.testing.assert_allclose(
        np.array(heads(build_features(x, oh, oh))[0]),
        np.array(lin(x[0])),
        rtol=1e-5,
        atol=1e-5,
    )


def test_the_heads_rule_matches_the_family_gate(engine):
    k = engine.experts_per_token
    for n in engine.moe_layers:
        block = engine.blocks[n]
        x = mx.random.normal(
            (3, 7, engine.family.hidden_size(engine.config)), key=mx.random.key(n)
        )
        inds, weights = block.rule.select(block.router(x), k)  # the heads' selection
        want_inds, want_w = block.select(x)  # the block's, mlx-lm's
        order, want_order = mx.argsort(inds, axis=-1), mx.argsort(want_inds, axis=-1)
        a = mx.take_along_axis(inds, order, -1)
        b = mx.take_along_axis(want_inds, want_order, -1)
        assert mx.array_equal(a, b), f"layer {n}: selected experts differ"
        np.testing.assert_allclose(
            np.array(mx.take_along_axis(weights, order, -1)),
            np.array(mx.take_along_axis(want_w.astype(mx.float32), want_order, -1)),
            rtol=1e-4,
            atol=1e-5,
        )


def test_bailing_rule_uses_bias_and_groups():
    bias = mx.array([0.0, 0.0, 0.0, 0.0, 10.0, 0.0, 0.0, 0.0])
    rule = RoutingRule(
        score="sigmoid",
        norm_topk_prob=True,
        expert_bias=bias,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
    )
    logits = mx.array([[5.0, 4.0, 3.0, 2.0, -9.0, -9.0, 0.0, 0.0]])
    inds, w = rule.select(logits, 2)
    # expert 4 wins through its bias (selection only); its group {4,5} survives the group cut
    assert sorted(inds[0].tolist()) == [0, 4]
    s = mx.sigmoid(logits[0])
    assert abs(float(w[0].sum()) - 2.5) < 1e-5
    want = {0: float(s[0]), 4: float(s[4])}
    got = dict(zip(inds[0].tolist(), w[0].tolist()))
    assert abs(got[4] / got[0] - want[4] / want[0]) < 1e-5  # weights: unbiased scores


def test_stack_rules_equals_per_layer_rules():
    rules = [
        RoutingRule(
            "sigmoid", True, mx.random.normal((8,), key=mx.random.key(i)), 4, 2, 2.5
        )
        for i in range(3)
    ]
    logits = mx.random.normal((3, 5, 8), key=mx.random.key(9))
    inds, w = stack_rules(rules).select(logits, 3)
    for i, r in enumerate(rules):
        a, b = r.select(logits[i], 3)
        assert mx.array_equal(mx.sort(inds[i], -1), mx.sort(a, -1))


def test_features_from_a_step(engine):
    """A step's features: the last position's MoE input and executed one-hot, t-1 from the
    position before it in the same step, else the one the plans carry."""
    owners = [n for n in engine.moe_layers if n + 1 in engine.moe_layers]
    heads = init_heads_from_routers(engine, owners, width=8)
    pr = Prerouter(
        heads,
        engine.blocks,
        stack_rules([engine.blocks[c].rule for c in heads.config.consumers]),
        engine.experts_per_token,
        Counters(),
        engine.family.embedding(engine.model),
    )
    e = engine.index.num_experts
    try:
        cache = engine.step.new_cache()
        engine.step(mx.array([[5, 6, 7]]), cache, plan_next=False)
        plans = pr.after_step(None, None, None, stage=False)
        x, ids = engine.blocks[owners[0]].last
        assert plans.feats.shape == (len(owners), 1, heads.config.in_dim)
        assert mx.array_equal(plans.feats[0, 0, : x.shape[-1]], x[0, -1]).item()
        assert (plans.onehot.sum(-1) == engine.experts_per_token).all().item()
        assert mx.array_equal(plans.feats[0, 0, -e:], onehot(ids[0, -2], e)).item()
        engine.step(mx.array([[8]]), cache, plan_next=False)
        following = pr.after_step(plans, None, None, stage=False)
        assert mx.array_equal(following.feats[..., -e:], plans.onehot).item()
    finally:
        for n in owners:
            engine.blocks[n].capture = False


# -- files ---------------------------------------------------------------------------------------


def test_save_load_roundtrip(tmp_path):
    heads = random_heads()
    path = save_heads(
        tmp_path / "h.safetensors",
        heads,
        {"source": "unit test", "model": "m"},
        dtype=mx.float32,
    )
    meta = read_metadata(path)
    assert (
        meta["kind"] == KIND
        and meta["K"] == "2"
        and json.loads(meta["owners"]) == [2, 3, 5]
    )
    assert {
        "start_layer",
        "width",
        "hidden",
        "num_experts",
        "format_version",
        "source",
        "model",
    } <= set(meta)
    keys = set(mx.load(str(path)))
    assert "layers.3.linear_init.weight" in keys and len(keys) == 9
    back = load_heads(path, hidden=12, num_experts=6, experts_per_token=2)
    assert back.owners == [2, 3, 5] and back.config.width == 8
    for name in ("fc1", "fc2", "linear"):
        assert mx.array_equal(getattr(back, name), getattr(heads, name))
    sub = load_heads(path, hidden=12, num_experts=6, experts_per_token=2, owners=[5, 3])
    assert sub.owners == [3, 5] and mx.array_equal(sub.fc2[1], heads.fc2[2])
    # default save dtype is float16, like the published adapters
    save_heads(tmp_path / "h16.safetensors", heads)
    assert (
        load_heads(
            tmp_path / "h16.safetensors", hidden=12, num_experts=6, experts_per_token=2
        ).dtype
        == mx.float16
    )


def write_published(
    path,
    owners=(6, 7),
    width=4,
    hidden=10,
    experts=5,
    meta=None,
    drop=None,
    shapes=None,
):
    """A file in the reference repo's layout: per-layer keys, only kind/K/owners metadata."""
    arrays = {}
    d = hidden + 2 * experts
    for n in owners:
        for name, shape in (
            ("fc1", (width, d)),
            ("fc2", (experts, width)),
            ("linear_init", (experts, d)),
        ):
            shape = (shapes or {}).get(f"{n}.{name}", shape)
            arrays[f"layers.{n}.{name}.weight"] = mx.random.normal(shape).astype(
                mx.float16
            )
    if drop:
        arrays.pop(drop)
    metadata = {
        "kind": "prerouter",
        "K": "4",
        "owners": json.dumps(list(owners)),
        "format_version": "1",
        "model": "Qwen3.6-35B-A3B",
        "source": "edge0",
    }
    metadata.update(meta or {})
    mx.save_safetensors(str(path), arrays, metadata=metadata)
    return path


def test_load_published_layout(tmp_path):
    path = write_published(tmp_path / "pub.safetensors")
    heads = load_heads(path, hidden=10, num_experts=5, experts_per_token=4)
    assert heads.owners == [6, 7] and heads.config.start_layer == 7
    assert heads.fc1.shape == (2, 4, 20) and heads.linear.shape == (2, 5, 20)
    assert heads(mx.zeros((2, 3, 20))).shape == (2, 3, 5)


@pytest.mark.parametrize(
    "case,kwargs,load_kwargs,match",
    [
        (
            "missing owner",
            {},
            {"owners": [6, 8]},
            r"no head for owner layer\(s\) \[8\]",
        ),
        (
            "wrong K",
            {},
            {"experts_per_token": 8},
            "trained for K=4 but the engine serves K=8",
        ),
        (
            "wrong kind",
            {"meta": {"kind": "lora"}},
            {},
            "kind='lora', expected 'prerouter'",
        ),
        ("no K", {"meta": {"K": "x"}}, {}, "not an integer"),
        (
            "wrong shape",
            {"shapes": {"7.fc1": (4, 19)}},
            {},
            r"layers.7.fc1.weight has shape",
        ),
        ("wrong hidden", {}, {"hidden": 11}, "has shape"),
        ("missing tensor", {"drop": "layers.7.fc2.weight"}, {}, "missing tensors"),
        (
            "owners disagree",
            {"meta": {"owners": "[6, 7, 8]"}},
            {},
            "do not match the heads",
        ),
        ("newer format", {"meta": {"format_version": "9"}}, {}, "format_version 9"),
    ],
)
def test_load_errors_name_the_file(tmp_path, case, kwargs, load_kwargs, match):
    path = write_published(tmp_path / "bad.safetensors", **kwargs)
    args = {"hidden": 10, "num_experts": 5, "experts_per_token": 4} | load_kwargs
    with pytest.raises(CheckpointError, match=match) as err:
        load_heads(path, **args)
    assert str(path) in str(err.value)


@pytest.mark.parametrize(
    "meta",
    [
        {"features": "next_token", "context_consumers": "[7]"},
        {"context_consumers": "[7]"},
    ],
)
def test_mixed_heads_are_refused_naming_the_file(tmp_path, meta):
    """Mixed heads (metadata context_consumers) are no longer served: one CheckpointError
    naming the file and the way out, before any shape is checked."""
    d = (2 if meta.get("features") == "next_token" else 1) * 10 + 2 * 5
    shapes = {
        f"{n}.{name}": shape
        for n in (6, 7)
        for name, shape in (("fc1", (4, d)), ("linear_init", (5, d)))
    }
    path = write_published(tmp_path / "old.safetensors", meta=meta, shapes=shapes)
    with pytest.raises(CheckpointError) as err:
        load_heads(path, hidden=10, num_experts=5, experts_per_token=4)
    message = str(err.value)
    assert str(path) in message and "no longer served" in message
    assert "edge0-eval train-prerouter" in message


def test_load_missing_or_garbage_file(tmp_path):
    with pytest.raises(CheckpointError, match="not found"):
        load_heads(
            tmp_path / "nope.safetensors", hidden=10, num_experts=5, experts_per_token=4
        )
    bad = tmp_path / "garbage.safetensors"
    bad.write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(CheckpointError, match=str(bad)):
        load_heads(bad, hidden=10, num_experts=5, experts_per_token=4)
    trunc = tmp_path / "trunc.safetensors"
    good = write_published(tmp_path / "good.safetensors").read_bytes()
    trunc.write_bytes(good[: len(good) - 100])
    with pytest.raises(CheckpointError, match=str(trunc)):
        load_heads(trunc, hidden=10, num_experts=5, experts_per_token=4)
