"""Mixed prerouter heads: next-token heads whose first consuming layers keep context features
(`context_consumers`) and are planned after the step's last layer, before the LM head; the rest
plan once the token is known. Also the store's read order: queued prefetches by layer."""

from __future__ import annotations

import threading
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from decode_parity import (assert_batch_rows_equal_solo, assert_discovery_equals_decode,
                           served_path_engine)

from edge0_eval.engine.engine import Engine
from edge0_eval.engine.heads_file import load_heads, read_metadata, save_heads
from edge0_eval.engine.options import EngineOptions
from edge0_eval.engine.prerouter import (build_features, consumer_rule, default_owners,
                                         init_heads_from_routers)
from edge0_eval.engine.store import DEMAND, ExpertStore
from edge0_eval.errors import CheckpointError, ConfigError
from edge0_eval.training.prerouter import train_prerouter

from test_prerouter import converted_model
from test_train_prerouter import options

PROMPT = "def add(a, b):\n    return a + b\n# The quick brown fox"


def mixed_heads(converted, path, start_layer=0, context_layers=2):
    """Untrained mixed heads made to depend on the token where they may: random fc2, and
    random embedding columns on the next-token part only."""
    engine = Engine.load(converted, EngineOptions(mode="reactive", no_lora=True))
    try:
        owners = default_owners(start_layer, len(engine.family.layers(engine.model)),
                                engine.moe_layers)
        heads = init_heads_from_routers(engine, owners, width=32, seed=0, next_token=True,
                                        context_layers=context_layers)
        cfg = heads.config
        assert len(cfg.context_consumers) == context_layers
        heads.fc2 = mx.random.normal(heads.fc2.shape, key=mx.random.key(1)) * 0.5
        d = cfg.context_dim
        uses = mx.array([c not in cfg.context_consumers for c in cfg.consumers])[:, None, None]
        rand = mx.random.normal(heads.linear[:, :, d:].shape, key=mx.random.key(2)) * 2.0
        heads.linear = mx.concatenate([heads.linear[:, :, :d], mx.where(uses, rand, 0.0)],
                                      axis=-1)
        return save_heads(path, heads), engine.moe_layers, cfg.context_consumers
    finally:
        engine.close()


@pytest.fixture(scope="module", params=["qwen", "bailing"])
def mixed(request, tmp_path_factory):
    converted = request.getfixturevalue(f"edge0_{request.param}")
    path, moe, context = mixed_heads(converted, tmp_path_factory.mktemp("mix") / "h.safetensors")
    return converted, path, moe, context


def _load(path):
    meta = read_metadata(path)
    return meta, dict(hidden=int(meta["hidden"]), num_experts=int(meta["num_experts"]),
                      top_k=int(meta["K"]))


def test_file_round_trip_and_inconsistent_files(mixed, tmp_path):
    converted, path, moe, context = mixed
    meta, dims = _load(path)
    assert meta["features"] == "next_token" and meta["context_consumers"] == str(context)
    heads = load_heads(path, **dims)
    assert heads.config.context_consumers == context
    part = heads.select_owners(heads.config.owners[:2])
    assert part.config.context_consumers == [c for c in context if c in part.config.consumers]
    weights = mx.load(str(path))
    bad = tmp_path / "bad.safetensors"
    owner = heads.config.owners[heads.config.consumers.index(context[0])]
    # A context consumer's head that reads the embedding after all: refused, not served.
    key = f"layers.{owner}.fc1.weight"
    w = weights[key]
    mx.save_safetensors(str(bad), weights | {key: w.at[:, -1].add(1.0)}, metadata=meta)
    with pytest.raises(CheckpointError, match=rf"bad.safetensors.*owner layer\(s\) \[{owner}\]"
                                              r".*not zero"):
        load_heads(bad, **dims)
    for extra, pattern in ((meta | {"context_consumers": "[99]"}, r"\[99\] that no head"),
                           (meta | {"context_consumers": "first"}, "not a JSON list")):
        mx.save_safetensors(str(bad), weights, metadata=extra)
        with pytest.raises(CheckpointError, match=rf"bad.safetensors.*{pattern}"):
            load_heads(bad, **dims)


def test_context_consumers_on_context_heads_is_refused(edge0_qwen, tmp_path):
    engine = Engine.load(edge0_qwen, EngineOptions(mode="reactive", no_lora=True))
    try:
        heads = init_heads_from_routers(engine, engine.moe_layers[:-1], width=8)
    finally:
        engine.close()
    path = save_heads(tmp_path / "ctx.safetensors", heads)
    meta, dims = _load(path)
    mx.save_safetensors(str(path), mx.load(str(path)),
                        metadata=meta | {"context_consumers": f"[{heads.config.consumers[0]}]"})
    with pytest.raises(CheckpointError, match=r"ctx.safetensors.*holds context heads"):
        load_heads(path, **dims)


def test_init_prerouter_context_layers(edge0_qwen, tmp_path, capsys):
    from edge0_eval import cli

    out = tmp_path / "h.safetensors"
    assert cli.main(["init-prerouter", str(edge0_qwen), "--start-layer", "0", "--width", "8",
                     "--next-token", "--context-layers", "1", "--out", str(out)]) == 0
    assert "except layers [0]" in capsys.readouterr().out
    assert read_metadata(out)["context_consumers"] == "[0]"
    assert cli.main(["init-prerouter", str(edge0_qwen), "--start-layer", "0", "--width", "8",
                     "--context-layers", "1", "--out", str(tmp_path / "x.safetensors")]) == 2
    assert "add --next-token" in capsys.readouterr().err


def test_two_phase_plan_staged_equals_routed(mixed):
    """The context consumers are planned inside the step, before its token exists, from the
    context features alone; the others from those features plus the token's embedding. Every
    executed set is that plan, with nothing read on demand."""
    converted, path, moe, context = mixed
    engine = Engine.load(converted, EngineOptions(mode="prerouted", prerouter_path=str(path),
                                                  no_lora=True))
    try:
        pr = engine.prerouter
        for layer in moe:
            engine.blocks[layer].set_capture(True)
        rule = consumer_rule(engine, pr.consumers)
        embed = engine.family.embedding(engine.model)
        h, e = pr.config.hidden, pr.config.num_experts
        full = load_heads(path, **_load(path)[1])      # the file, not the engine's split
        logits = engine.prefill(engine.tokenizer.encode(PROMPT))
        blocked = engine.counters.blocked_loads
        token_moves = 0

        def want(feats, t):
            # the embedding columns of the context part are zero: the full heads on zeros
            # there are what the context part computes
            emb = embed(mx.array([t]))
            x = build_features(feats[..., :h], feats[..., h:h + e], feats[..., h + e:], emb)
            ctx = mx.array([c in context for c in pr.consumers])[:, None, None]
            x = mx.where(ctx & (mx.arange(x.shape[-1]) >= h + 2 * e), 0.0, x)
            inds, _ = rule.select(full(x), engine.top_k)
            return {c: sorted(np.array(inds[o]).reshape(-1).tolist())
                    for o, c in enumerate(pr.consumers)}

        for _ in range(8):
            assert sorted(pr._plans) == context and pr._awaiting_tokens
            feats = pr._feats
            token = int(mx.argmax(logits).item())
            expect, other = want(feats, token), want(feats, (token + 7) % embed.weight.shape[0])
            assert all(expect[c] == other[c] for c in context)
            token_moves += any(expect[c] != other[c] for c in pr.consumers if c not in context)
            logits = engine.step(token)
            for layer in moe:
                executed = np.array(engine.blocks[layer].captured()[1]).reshape(-1).tolist()
                assert sorted(executed) == expect[layer], f"layer {layer}"
        assert token_moves >= 4
        assert engine.counters.blocked_loads == blocked
        stats = engine.stats()
        assert stats["dropped_experts"] == 0
        assert stats["prerouter_features"] == "mixed"
        assert stats["prerouter_context_consumers"] == context
    finally:
        engine.close()


def test_batched_rows_equal_solo_runs(mixed):
    converted, path, _, _ = mixed
    assert_batch_rows_equal_solo(converted, path)


@pytest.mark.parametrize("start_layer", [0, None])
def test_served_path_equals_engine_decode(edge0_qwen, tmp_path, start_layer):
    engine, moe = served_path_engine(edge0_qwen, mixed_heads, tmp_path / "h.safetensors",
                                     start_layer)
    try:
        served_path, _, _ = assert_discovery_equals_decode(engine, moe)
        served_path.close()
    finally:
        engine.close()


def test_stage1_mixed_is_the_two_feature_sets_side_by_side(tmp_path_factory, tmp_path):
    """--context-layers 2: the first two consumers' heads train without the embedding (its
    columns stay zero in the file), the rest exactly as next-token heads do (same start, same
    batches: heads train independently)."""
    model = converted_model(tmp_path_factory, "qwen3_5_moe")
    kw = dict(steps=30, start_layer=0)
    nt = train_prerouter(options(model, tmp_path / "nt.safetensors", next_token=True, **kw))
    out = tmp_path / "mix.safetensors"
    mix = train_prerouter(options(model, out, next_token=True, context_layers=2, **kw))
    context = sorted(mix["consumers"])[:2]
    assert mix["features"] == "mixed" and mix["context_consumers"] == context
    meta, dims = _load(out)
    assert meta["context_consumers"] == str(context)
    heads = load_heads(out, **dims)           # refuses nonzero embedding columns
    assert all(z == (c in context) for z, c in zip(heads.embedding_columns_zero(),
                                                   heads.config.consumers))
    for row, n_row in zip(mix["layers"], nt["layers"]):
        is_context = row["consumer"] in context
        assert row.get("context_features", False) == is_context
        assert ("recall_token_router" in row) == (not is_context)
        if is_context:
            assert row["recall_heads"] > row["recall_untrained_heads"], row
        else:
            assert row["recall_heads"] == pytest.approx(n_row["recall_heads"], abs=1e-6), row
    with pytest.raises(Exception, match="add --next-token"):
        train_prerouter(options(model, tmp_path / "x.safetensors", context_layers=1, **kw))
    # a split beyond the heads is refused before any feature is collected
    with pytest.raises(ConfigError, match="--context-layers 99"):
        train_prerouter(options(model, tmp_path / "y.safetensors", next_token=True,
                                context_layers=99, **kw))
    assert not Path(f"{tmp_path / 'y.safetensors'}.ckpt").exists()


def test_store_serves_queued_prefetches_in_layer_order(edge0_qwen):
    """A prefetch for an earlier layer, queued last, is read before queued later layers'
    (a next-token plan's first layers behind a context plan's), and DEMAND before all."""
    store = ExpertStore(edge0_qwen, io_workers=1)
    try:
        layers = list(store.index.moe_layers)
        assert len(layers) >= 3
        gate, order = threading.Event(), []
        hold = store.submit(layers[0], 0, DEMAND, prepare=lambda buf: gate.wait(10))

        def note(tag):
            return lambda buf: order.append(tag)
        futures = [store.submit(layers[2], 1, prepare=note(2)),
                   store.submit(layers[1], 1, prepare=note(1)),
                   store.submit(layers[0], 1, prepare=note(0)),
                   store.submit(layers[2], 2, DEMAND, prepare=note("demand"))]
        gate.set()
        for f in [hold] + futures:
            f.result(timeout=10)
        assert order == ["demand", 0, 1, 2]
    finally:
        store.close()
