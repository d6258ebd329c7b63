"""Next-token prerouter heads: features end with the sampled next token's input embedding, so the
plan for step t+1 runs once token t+1 is known (Prerouter.plan_tokens), in serving, batched decode,
the served training path and stage 1."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from decode_parity import (
    assert_batch_rows_equal_solo,
    assert_discovery_equals_decode,
    served_path_engine,
)
from served_pass import replay_gradients
from test_prerouter import converted_model
from test_train_prerouter import options

from edge0_eval.engine.engine import Engine
from edge0_eval.engine.heads import (
    default_owners,
    init_heads_from_routers,
    load_heads,
    save_heads,
)
from edge0_eval.engine.options import EngineOptions
from edge0_eval.engine.routing import build_features, stack_rules
from edge0_eval.errors import CheckpointError
from edge0_eval.formats.heads_file import read_metadata
from edge0_eval.training.prerouter_fit import train_prerouter
from edge0_eval.training.state import report_paths

PROMPT = "def add(a, b):\n    return a + b\n# The quick brown fox"


def next_token_heads(converted, path, start_layer=0, embed_scale=2.0):
    """Untrained next-token heads made to depend on the token: random fc2 and random weights
    over the embedding columns (untrained, those columns are zero)."""
    engine = Engine.load(converted, EngineOptions(mode="reactive", no_lora=True))
    try:
        owners = default_owners(
            start_layer, len(engine.family.layers(engine.model)), engine.moe_layers
        )
        heads = init_heads_from_routers(
            engine, owners, width=32, seed=0, next_token=True
        )
        cfg = heads.config
        assert cfg.next_token and cfg.in_dim == 2 * cfg.hidden + 2 * cfg.num_experts
        heads.fc2 = mx.random.normal(heads.fc2.shape, key=mx.random.key(1)) * 0.5
        lead = cfg.hidden + 2 * cfg.num_experts
        rand = mx.random.normal(heads.linear[:, :, lead:].shape, key=mx.random.key(2))
        heads.linear = mx.concatenate(
            [heads.linear[:, :, :lead], rand * embed_scale], axis=-1
        )
        return save_heads(path, heads), engine.moe_layers
    finally:
        engine.close()


@pytest.fixture(scope="module", params=["qwen", "bailing"])
def nt(request, tmp_path_factory):
    converted = request.getfixturevalue(f"edge0_{request.param}")
    path, moe = next_token_heads(
        converted, tmp_path_factory.mktemp("nt") / "h.safetensors"
    )
    return converted, path, moe


def test_file_records_features_and_loads_back(nt, tmp_path):
    converted, path, moe = nt
    meta = read_metadata(path)
    assert meta["features"] == "next_token"
    cfg = json.loads(Path(converted, "config.json").read_text())
    text = cfg.get("text_config", cfg)
    heads = load_heads(
        path,
        hidden=text["hidden_size"],
        num_experts=text["num_experts"],
        experts_per_token=int(meta["K"]),
    )
    assert heads.config.next_token
    assert heads.select_owners(moe[:1]).config.next_token
    # An unknown feature set, or context-sized tensors labelled next_token: one clear error.
    weights = mx.load(str(path))
    bad = tmp_path / "bad.safetensors"
    mx.save_safetensors(str(bad), weights, metadata=meta | {"features": "tokens2"})
    with pytest.raises(CheckpointError, match=r"bad.safetensors.*features='tokens2'"):
        load_heads(
            bad,
            hidden=text["hidden_size"],
            num_experts=text["num_experts"],
            experts_per_token=int(meta["K"]),
        )
    unlabelled = {k: v for k, v in meta.items() if k != "features"}
    mx.save_safetensors(str(bad), weights, metadata=unlabelled)
    with pytest.raises(CheckpointError, match=r"bad.safetensors.*expected"):
        load_heads(
            bad,
            hidden=text["hidden_size"],
            num_experts=text["num_experts"],
            experts_per_token=int(meta["K"]),
        )


def test_init_prerouter_next_token(edge0_bailing, tmp_path, capsys):
    from edge0_eval import cli

    out = tmp_path / "h.safetensors"
    assert (
        cli.main(
            [
                "init-prerouter",
                str(edge0_bailing),
                "--start-layer",
                "0",
                "--width",
                "8",
                "--next-token",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert "next-token features" in capsys.readouterr().out
    assert read_metadata(out)["features"] == "next_token"
    engine = Engine.load(
        edge0_bailing, EngineOptions(mode="prerouted", prerouter_path=str(out))
    )
    try:
        # untrained: the embedding columns are zero, the plan is the context heads' plan
        assert engine.prerouter.next_token
        heads = engine.prerouter.heads
        assert not heads.linear[:, :, -heads.config.hidden :].any().item()
    finally:
        engine.close()


def test_plan_uses_the_sampled_token_and_staged_equals_routed(nt):
    """Each step's staged (= executed) sets are the heads' selection on the last step's
    features plus the embedding of the token the step consumes; another token gives other
    sets (the token is really used), and nothing is read on demand."""
    converted, path, moe = nt
    engine = Engine.load(
        converted,
        EngineOptions(mode="prerouted", prerouter_path=str(path), no_lora=True),
    )
    try:
        pr = engine.prerouter
        for layer in moe:
            engine.blocks[layer].capture = True
        rule = stack_rules([engine.blocks[c].rule for c in pr.consumers])
        embed = engine.family.embedding(engine.model)
        sequence = engine.sequence()
        logits = sequence.prefill(engine.tokenizer.encode(PROMPT))
        plans = sequence.plans
        assert not plans.layers and plans.feats is not None  # waits for the first token
        feats = plans.feats
        blocked = engine.counters.blocked_loads
        differs = 0
        h, e = pr.heads.config.hidden, pr.heads.config.num_experts

        def want(t):
            emb = embed(mx.array([t]))  # [1, H]
            x = build_features(
                feats[..., :h], feats[..., h : h + e], feats[..., h + e :], emb
            )
            inds, _ = rule.select(pr.heads(x), engine.experts_per_token)
            return {
                c: sorted(np.array(inds[o]).reshape(-1).tolist())
                for o, c in enumerate(pr.consumers)
            }

        for _ in range(8):
            token = int(mx.argmax(logits).item())
            other = (token + 7) % embed.weight.shape[0]
            expect, alternative = want(token), want(other)
            differs += expect != alternative
            logits = sequence.step(token)
            for layer in moe:
                executed = np.array(engine.blocks[layer].last[1]).reshape(-1).tolist()
                assert sorted(executed) == expect[layer], f"layer {layer}"
            feats = sequence.plans.feats
        assert differs >= 4
        assert engine.counters.blocked_loads == blocked
        assert engine.stats()["dropped_experts"] == 0
        assert engine.stats()["prerouter_features"] == "next_token"
    finally:
        engine.close()


def test_batched_rows_equal_solo_runs(nt):
    converted, path, _ = nt
    assert_batch_rows_equal_solo(converted, path)


@pytest.mark.parametrize("start_layer", [0, None])
def test_served_path_equals_engine_decode(edge0_qwen, tmp_path, start_layer):
    """Stages 2/3's served path with next-token heads (wrap head: stepwise discovery; from
    the first MoE layer + 1: the full-sequence pass) == prefill + prerouted decode."""
    engine, moe = served_path_engine(
        edge0_qwen, next_token_heads, tmp_path / "h.safetensors", start_layer
    )
    try:
        served_path, disc, tokens = assert_discovery_equals_decode(engine, moe)
        logits, grads = replay_gradients(served_path, engine, disc, tokens)
        assert mx.allclose(logits, disc.logits, atol=1e-4).item()
        assert any(mx.abs(v).max().item() > 0 for v in grads.values())
        served_path.close()
    finally:
        engine.close()


def test_stage1_trains_next_token_heads(tmp_path_factory, tmp_path):
    """train-prerouter --next-token: the store gains the embeddings, the file is labelled, the
    report adds the next-token router baseline, and the heads beat the context heads trained
    the same way (the next token is what they could not see)."""
    model = converted_model(tmp_path_factory, "qwen3_5_moe")
    ctx = train_prerouter(options(model, tmp_path / "ctx.safetensors", steps=60))
    out = tmp_path / "nt.safetensors"
    report = train_prerouter(options(model, out, steps=60, next_token=True))
    assert (Path(f"{out}.ckpt") / "features" / "emb.npy").is_file()
    assert read_metadata(out)["features"] == "next_token"
    assert report["features"] == "next_token" and ctx["features"] == "context"
    assert (
        "token_router" in report["baselines"]
        and "recall_token_router" in report["mean"]
    )
    assert "recall_token_router" not in ctx["mean"]
    md = Path(report_paths(out)[1]).read_text()
    assert "next-token router baseline" in md and "next_token features" in md
    assert report["mean"]["recall_heads"] > ctx["mean"]["recall_heads"]
    for row in report["layers"]:
        assert 0.0 <= row["recall_token_router"] <= 1.0
    # emb.npy row t is the input embedding of token t; a batch at t gets token t+1's.
    from edge0_eval.training.corpus import read_documents, tokenize_documents
    from edge0_eval.training.features import Batches, FeatureStore

    store = FeatureStore(Path(f"{out}.ckpt") / "features").open()
    engine = Engine.load(
        model, EngineOptions(mode="prerouted", prerouter_path=str(out))
    )
    try:
        opts = options(model, out)
        docs = tokenize_documents(
            engine.tokenizer,
            read_documents(opts.texts),
            opts.max_tokens,
            opts.max_doc_tokens,
        )
        _, start, length = store.meta["docs"][1]
        ids = mx.array(docs[1][1])
        want = engine.family.embedding(engine.model)(ids).astype(mx.float16)
        assert mx.array_equal(
            mx.array(np.asarray(store.emb[start : start + length])), want
        )
        t = np.array([start, start + 3])
        got = Batches(store, report["owners"], next_token=True).get(t)["next_emb"]
        assert mx.allclose(got, want[mx.array([1, 4])].astype(mx.float32)).item()
        assert engine.prerouter.next_token
        result = engine.generate(
            engine.tokenizer.encode(PROMPT), max_tokens=4, stop_token_ids=set()
        )
        assert result.stats["dropped_experts"] == 0
    finally:
        engine.close()
