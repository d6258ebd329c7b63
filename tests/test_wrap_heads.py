"""Wrap-around heads: the last MoE layer's head predicts the first MoE layer of the next token, so
with start layer 0 every MoE layer of every decode step is prerouted."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from served_pass import (
    CONTINUATION_IDS,
    PROMPT_IDS,
    lora_engine_decode,
    replay_gradients,
)

from edge0_eval import cli
from edge0_eval.engine.engine import Engine
from edge0_eval.engine.heads import (
    check_owners,
    default_consumers,
    default_owners,
    init_heads_from_routers,
    load_heads,
    save_heads,
)
from edge0_eval.engine.options import EngineOptions
from edge0_eval.engine.routing import build_features, onehot
from edge0_eval.errors import CheckpointError, ConfigError
from edge0_eval.formats.heads_file import PrerouterConfig, read_metadata

PROMPT = "def add(a, b):\n    return a + b\n# The quick brown fox"
STEPS = 10


def wrap_heads_file(converted, path, perturb=True):
    engine = Engine.load(converted, EngineOptions(mode="reactive", no_lora=True))
    try:
        owners = default_owners(
            0, len(engine.family.layers(engine.model)), engine.moe_layers
        )
        heads = init_heads_from_routers(engine, owners, width=32, seed=0)
        if (
            perturb
        ):  # not the plain router baseline: predictions differ from true routing
            heads.fc2 = mx.random.normal(heads.fc2.shape, key=mx.random.key(1)) * 0.5
        return save_heads(path, heads), engine.moe_layers
    finally:
        engine.close()


@pytest.fixture(scope="module", params=["qwen", "bailing", "qwen2"])
def wrapped(request, tmp_path_factory):
    converted = request.getfixturevalue(f"edge0_{request.param}")
    path, moe = wrap_heads_file(
        converted, tmp_path_factory.mktemp("wrap") / "h.safetensors"
    )
    return converted, path, moe


def test_default_owners_with_start_layer_zero_add_the_wrap_head():
    assert default_owners(0, 4, [0, 1, 2, 3]) == [0, 1, 2, 3]
    assert default_owners(1, 4, [0, 1, 2, 3]) == [0, 1, 2]  # start 1: no wrap
    assert default_owners(0, 4, [1, 2, 3]) == [1, 2, 3]  # bailing: layer 0 dense
    assert default_owners(1, 4, [1, 2, 3]) == [1, 2, 3]  # 1 = its first MoE layer
    assert default_consumers([1, 2, 3], [1, 2, 3]) == [2, 3, 1]
    assert default_consumers([0, 1, 2, 3], [0, 1, 2, 3]) == [1, 2, 3, 0]
    assert check_owners([3, 1, 2], [1, 2, 3], consumers=[1, 2, 3]) == [1, 2, 3]
    with pytest.raises(ConfigError, match=r"owner 2 -> layer 0"):
        check_owners([2], [0, 1, 2, 3], consumers=[0])  # only the last layer wraps
    with pytest.raises(ConfigError, match="must both be MoE"):
        check_owners([3], [1, 2, 3], consumers=[0])  # layer 0 is dense


def test_every_layer_prerouted_staged_equals_routed_and_nothing_blocks(wrapped):
    converted, path, moe = wrapped
    meta = read_metadata(path)
    assert json.loads(meta["owners"]) == moe
    assert json.loads(meta["consumers"]) == moe[1:] + moe[:1]
    assert meta["start_layer"] == str(moe[0])
    probe = Engine.load(converted, EngineOptions(mode="reactive", no_lora=True))
    k = probe.experts_per_token
    probe.close()
    engine = Engine.load(
        converted,
        EngineOptions(
            mode="prerouted", prerouter_path=str(path), no_lora=True, slots_per_layer=k
        ),
    )
    try:
        pr = engine.prerouter
        assert sorted(pr.consumers) == moe  # every MoE layer consumes a head
        for layer in moe:
            engine.blocks[layer].capture = True
        engine.store.evict_page_cache()
        sequence = engine.sequence()
        logits = sequence.prefill(engine.tokenizer.encode(PROMPT))
        blocked_before = engine.counters.blocked_loads
        token = int(mx.argmax(logits).item())
        for _ in range(STEPS):
            planned = {
                layer: sorted(staged.experts)
                for layer, (_, staged) in sequence.plans.layers.items()
            }
            # step 0 too (planned after prefill); reads queued in execution order, first MoE
            # layer first (the queue is FIFO), though the wrap head that plans it runs last
            assert list(planned) == moe
            logits = sequence.step(token)
            for layer in moe:
                executed = np.array(engine.blocks[layer].last[1]).reshape(-1).tolist()
                assert sorted(executed) == planned[layer], f"layer {layer}"
            token = int(mx.argmax(logits).item())
        # No layer read an expert on demand during decode: every read was staged.
        assert engine.counters.blocked_loads == blocked_before
        stats = engine.stats()
        assert stats["dropped_experts"] == 0 and stats["prerouter_wrap_around"]
        assert stats["prerouted_steps"] == STEPS
        # slots == K: the staged reads were real
        assert stats["staged_loads_per_step"] > 0
    finally:
        engine.close()


def test_generate_with_wrap_heads_reports_zero_blocked_loads(wrapped):
    converted, path, _ = wrapped
    engine = Engine.load(
        converted,
        EngineOptions(mode="prerouted", prerouter_path=str(path), no_lora=True),
    )
    try:
        result = engine.generate(
            engine.tokenizer.encode(PROMPT), max_tokens=8, stop_token_ids=set()
        )
        assert result.stats["blocked_loads_per_step"] == 0
        assert result.stats["dropped_experts"] == 0
    finally:
        engine.close()


def test_untrained_wrap_head_is_first_router_on_last_layer_input(
    edge0_bailing, edge0_qwen
):
    for converted in (edge0_bailing, edge0_qwen):
        engine = Engine.load(converted, EngineOptions(mode="reactive", no_lora=True))
        try:
            moe = engine.moe_layers
            heads = init_heads_from_routers(engine, moe, width=16, seed=0)
            cfg = heads.config
            assert cfg.owners == moe and cfg.consumers == moe[1:] + moe[:1]
            assert cfg.start_layer == moe[0]
            assert not heads.fc2.any().item()
            x = mx.random.normal((len(moe), 5, cfg.hidden), key=mx.random.key(1))
            oh = onehot(
                mx.random.randint(
                    0, cfg.num_experts, (len(moe), 5, cfg.experts_per_token)
                ),
                cfg.num_experts,
            )
            logits = heads(build_features(x, oh, oh))
            wrap = moe.index(moe[-1])
            want = engine.blocks[moe[0]].router(x[wrap])  # first router, last input
            np.testing.assert_allclose(
                np.array(logits[wrap]), np.array(want), rtol=1e-4, atol=1e-4
            )
            other = engine.blocks[moe[-1]].router(x[wrap])  # not its own router
            assert not np.allclose(np.array(logits[wrap]), np.array(other), atol=1e-3)
        finally:
            engine.close()


def _rewrite(path, out, **meta_changes):
    arrays = mx.load(str(path))
    meta = read_metadata(path)
    for key, value in meta_changes.items():
        if value is None:
            meta.pop(key, None)
        else:
            meta[key] = value
    mx.save_safetensors(str(out), arrays, metadata=meta)
    return out


def test_file_without_consumers_loads_as_before(edge0_qwen, tmp_path):
    engine = Engine.load(edge0_qwen, EngineOptions(mode="reactive", no_lora=True))
    try:
        heads = init_heads_from_routers(engine, [0, 1, 2], width=8, seed=0)
    finally:
        engine.close()
    path = save_heads(tmp_path / "h.safetensors", heads, dtype=mx.float32)
    # a pre-wrap file
    old = _rewrite(path, tmp_path / "old.safetensors", consumers=None)
    assert "consumers" not in read_metadata(old)
    a = load_heads(
        path, hidden=heads.config.hidden, num_experts=16, experts_per_token=4
    )
    b = load_heads(
        old,
        hidden=heads.config.hidden,
        num_experts=16,
        experts_per_token=4,
        moe_layers=[0, 1, 2, 3],
    )
    assert (
        a.config
        == b.config
        == PrerouterConfig(
            owners=[0, 1, 2],
            width=8,
            experts_per_token=4,
            hidden=heads.config.hidden,
            num_experts=16,
        )
    )
    assert b.config.consumers == [1, 2, 3]
    for name in ("fc1", "fc2", "linear"):
        assert mx.array_equal(getattr(a, name), getattr(b, name))


def test_old_file_owning_the_last_layer_is_refused_by_the_model(edge0_qwen, tmp_path):
    path, moe = wrap_heads_file(edge0_qwen, tmp_path / "w.safetensors", perturb=False)
    old = _rewrite(path, tmp_path / "old.safetensors", consumers=None)
    with pytest.raises(
        CheckpointError, match=r"owner 3 -> layer 4: they must both be MoE"
    ) as err:
        Engine.load(
            edge0_qwen,
            EngineOptions(mode="prerouted", prerouter_path=str(old), no_lora=True),
        )
    assert str(old) in str(err.value)


@pytest.mark.parametrize(
    "consumers,match",
    [
        (
            "[1, 2, 3]",
            "not a JSON list of layer numbers, one per owner",
        ),  # 3 for 4 owners
        ("not json", "not a JSON list"),
        ('[1, 2, 3, "0"]', "not a JSON list"),
        ("[1, 2, 3, 7]", r"3 -> 7"),  # beyond owner + 1
        ("[1, 2, 3, 1]", "a layer twice"),
    ],
)
def test_bad_consumers_entry_is_one_clear_error(edge0_qwen, tmp_path, consumers, match):
    path, moe = wrap_heads_file(edge0_qwen, tmp_path / "w.safetensors", perturb=False)
    bad = _rewrite(path, tmp_path / "bad.safetensors", consumers=consumers)
    with pytest.raises(CheckpointError, match=match) as err:
        load_heads(
            bad, hidden=read_int(bad, "hidden"), num_experts=16, experts_per_token=4
        )
    assert str(bad) in str(err.value) and "consumers" in str(err.value)


def test_consumer_that_does_not_fit_the_model_names_the_file(edge0_qwen, tmp_path):
    path, _ = wrap_heads_file(edge0_qwen, tmp_path / "w.safetensors", perturb=False)
    bad = _rewrite(path, tmp_path / "bad.safetensors", consumers="[1, 2, 0, 3]")
    hidden = read_int(bad, "hidden")
    load_heads(
        bad, hidden=hidden, num_experts=16, experts_per_token=4
    )  # well-formed on its own
    with pytest.raises(CheckpointError, match=r"owner 2 -> layer 0") as err:
        load_heads(
            bad,
            hidden=hidden,
            num_experts=16,
            experts_per_token=4,
            moe_layers=[0, 1, 2, 3],
        )
    assert str(bad) in str(err.value)
    with pytest.raises(CheckpointError, match=str(bad)):
        Engine.load(
            edge0_qwen,
            EngineOptions(mode="prerouted", prerouter_path=str(bad), no_lora=True),
        )


def read_int(path, key):
    return int(read_metadata(path)[key])


def test_init_prerouter_start_layer_zero(edge0_bailing, tmp_path, capsys):
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
                "--out",
                str(out),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "wrap-around" in printed
    meta = read_metadata(out)
    assert json.loads(meta["owners"]) == [1, 2, 3]
    assert json.loads(meta["consumers"]) == [2, 3, 1]


# -- stages 2/3: the served path with a wrap-around head ----------------------------------------


@pytest.mark.parametrize("family", ["qwen", "bailing"])
def test_served_path_with_wrap_head_equals_engine_decode(family, request, tmp_path):
    """discover() with a wrap head == prefill + prerouted decode (logits and every layer's
    executed ids, the first MoE layer's included); the full-sequence gradient pass replays it;
    gradient checkpointing leaves the gradients unchanged."""
    from edge0_eval.training.served import ServedPath

    converted = request.getfixturevalue(f"edge0_{family}")
    path, moe = wrap_heads_file(converted, tmp_path / "h.safetensors")
    engine = Engine.load(
        converted,
        EngineOptions(
            mode="prerouted", prerouter_path=str(path), no_lora=True, slots_per_layer=16
        ),
    )
    try:
        prompt, cont = PROMPT_IDS, CONTINUATION_IDS
        served, executed = lora_engine_decode(engine, moe)
        assert engine.counters.prerouted_steps == len(cont)
        tokens = np.array([prompt + cont])
        valid = np.ones_like(tokens, bool)
        grads = {}
        for ckpt in (False, True):
            served_path = ServedPath(engine, grad_checkpoint=ckpt)
            assert served_path.wrap == (moe[-1], moe[0])
            disc = served_path.discover(
                tokens, valid, np.array([len(prompt)]), keep_logits=True
            )
            assert sorted(disc.planned_layers) == moe
            got = disc.logits[0, len(prompt) - 1 :]
            assert mx.allclose(got, served, atol=1e-4).item()
            for s, want in enumerate(executed):
                p = len(prompt) + s
                for n in moe:
                    assert sorted(disc.inds[n][0, p].tolist()) == want[n], (n, p)
            logits, grads[ckpt] = replay_gradients(served_path, engine, disc, tokens)
            assert mx.allclose(logits, disc.logits, atol=1e-4).item()
            served_path.close()
        assert any(mx.abs(v).max().item() > 0 for v in grads[False].values())
        for k, v in grads[False].items():
            assert mx.allclose(v, grads[True][k], atol=1e-6).item(), k
    finally:
        engine.close()
