"""Stage 1 at scale: the float32 collector (the dequantized build routes like the served int4
path, the check refuses a build that does not, `--collect float32` end to end) and
`--train-tokens` (a learning curve's subsets of the training documents)."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.switch_layers import QuantizedSwitchLinear
from test_prerouter import FAMILIES, converted_model
from test_train_prerouter import CORPUS, options

from edge0_eval.engine.engine import Engine, EngineOptions
from edge0_eval.errors import CheckpointError, ConfigError
from edge0_eval.training.collect_fp32 import (
    check_float32,
    compare,
    load_float32,
    run_documents,
    set_agreement,
)
from edge0_eval.training.corpus import encode_prefix, subset_documents
from edge0_eval.training.features import FeatureStore
from edge0_eval.training.models import collector_options
from edge0_eval.training.prerouter_fit import train_prerouter
from edge0_eval.training.state import report_paths

SERVED = EngineOptions(mode="reactive", no_lora=True)


def _docs(engine, n=2, length=48) -> list[list[int]]:
    return [encode_prefix(engine.tokenizer, p.read_text(), length) for p in CORPUS[:n]]


@pytest.fixture(scope="module", params=FAMILIES)
def fast(request, tmp_path_factory):
    model = converted_model(tmp_path_factory, request.param)
    engine = load_float32(model, SERVED)
    yield model, engine
    engine.close()


def _logits(engine, tokens):
    """Every position's logits of `tokens` from an empty cache."""
    return engine.step(
        mx.array(tokens)[None],
        engine.step.new_cache(),
        plan_next=False,
        all_logits=True,
    )[0]


def test_float32_build_routes_like_the_served_path(fast):
    model, engine = fast
    quantized = (nn.QuantizedLinear, nn.QuantizedEmbedding, QuantizedSwitchLinear)
    assert not [p for p, m in engine.model.named_modules() if isinstance(m, quantized)]
    served = Engine.load(model, SERVED)
    try:
        docs = _docs(served)
        ref = run_documents(served, docs)
        tokens = docs[0][:16]
        want = np.array(_logits(served, tokens))
    finally:
        served.close()
    result = compare(ref, run_documents(engine, docs), list(engine.moe_layers))
    assert result["ok"] and result["tokens"] == sum(map(len, docs))
    assert min(result["agreement"]) >= 0.98
    assert result["feature_max_rel_diff"] < 1e-2
    got = np.array(_logits(engine, tokens))
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3)


def test_check_refuses_a_build_that_routes_otherwise(fast):
    model, engine = fast
    docs = _docs(engine)
    assert check_float32(model, SERVED, engine, docs)["ok"]
    layer = engine.moe_layers[-1]
    linear = engine.blocks[layer].router
    kept = linear.weight
    linear.weight = -kept  # injected fault: one layer's router flipped
    try:
        with pytest.raises(
            CheckpointError, match=f"routes layer {layer} like the served"
        ):
            check_float32(model, SERVED, engine, docs)
    finally:
        linear.weight = kept


def test_set_agreement_counts_shared_experts():
    a = np.array([[[0, 1], [2, 3]], [[4, 5], [6, 7]]])  # [T=2, M=2, K=2]
    b = np.array([[[1, 0], [2, 9]], [[4, 5], [8, 9]]])
    assert set_agreement(a, b).tolist() == [1.0, 0.25]


def test_collector_never_loads_an_adapter(tmp_path):
    opts = options(tmp_path, tmp_path / "h.safetensors")
    assert collector_options(opts, 4).no_lora


def test_train_prerouter_collects_in_float32(tmp_path_factory, capsys):
    model = converted_model(tmp_path_factory, "qwen2_moe")
    out = tmp_path_factory.mktemp("fp32_heads") / "heads.safetensors"
    served = train_prerouter(options(model, out, steps=5, check_tokens=64))
    assert (
        served["collection"]["path"] == "served" and "check" not in served["collection"]
    )
    capsys.readouterr()
    report = train_prerouter(
        options(model, out, steps=5, check_tokens=64, collect="float32", fresh=True)
    )
    said = capsys.readouterr().out
    assert (
        "collecting again" in said and "float32 collector vs served int4 path" in said
    )
    c = report["collection"]
    assert c["path"] == "float32" and c["check"]["ok"] and c["check"]["tokens"] == 64
    assert (
        c["runs"][0]["tokens"] == report["data"]["tokens"] and c["runs"][0]["tok_s"] > 0
    )
    store = FeatureStore(Path(f"{out}.ckpt") / "features")
    assert (
        json.loads((store.dir / "data.json").read_text())["fingerprint"]["collect"]
        == "float32"
    )
    md = report_paths(out)[1].read_text()
    assert "Collected with the float32 path" in md and "Float32 check against" in md
    with pytest.raises(ConfigError, match="--collect"):
        train_prerouter(options(model, out, collect="int8"))


def test_subset_documents_is_seeded_whole_documents():
    lengths = [10, 20, 30, 40, 50, 60]
    got = subset_documents([0, 2, 3, 5], lengths, 70, seed=1)
    assert got == sorted(got) and set(got) <= {0, 2, 3, 5}
    total = sum(lengths[i] for i in got)
    assert total >= 70 and total - max(lengths[i] for i in got) < 70
    assert got == subset_documents([0, 2, 3, 5], lengths, 70, seed=1)
    assert subset_documents([0, 2, 3, 5], lengths, 10_000, seed=1) == [0, 2, 3, 5]


def test_train_tokens_cuts_the_training_documents_only(tmp_path_factory):
    model = converted_model(tmp_path_factory, "qwen2_moe")
    out = tmp_path_factory.mktemp("subset_heads") / "heads.safetensors"
    full = train_prerouter(options(model, out, steps=3))
    cut = train_prerouter(options(model, out, steps=3, train_tokens=200, fresh=True))
    assert cut["data"]["samples_heldout"] == full["data"]["samples_heldout"]
    assert cut["data"]["docs_heldout"] == full["data"]["docs_heldout"]
    assert cut["data"]["docs_train"] < full["data"]["docs_train"]
    assert (
        200 - cut["data"]["docs_train"]
        <= cut["data"]["samples_train"]
        < full["data"]["samples_train"]
    )
    assert cut["data"]["train_tokens_cap"] == 200
