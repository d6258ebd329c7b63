"""Draft-token hedge: next-token heads evaluated at a token drafted from a slice of the LM head
stage their sets before the LM head runs; routing stays the next-token heads' at the served
token, so logits never change, and when the served token is the draft the hedge is the
routing. Also the hedge's options and files, and how a routed set takes over a hedge's reads."""

from __future__ import annotations

import shutil
import time

import mlx.core as mx
import numpy as np
import pytest
from decode_parity import assert_batch_rows_equal_solo
from test_next_token_heads import next_token_heads

from edge0_eval.engine import batch, experts, routing, step
from edge0_eval.engine.draft import DraftHead, row_slice
from edge0_eval.engine.engine import Engine
from edge0_eval.engine.heads import default_owners, init_heads_from_routers, save_heads
from edge0_eval.engine.options import HEDGE_FILE, EngineOptions, MissingAdapterError
from edge0_eval.errors import CheckpointError, ConfigError
from edge0_eval.formats.draft_file import load_draft_vocab, save_draft_vocab

PROMPT = "def add(a, b):\n    return a + b\n# The quick brown fox"


def context_heads(converted, path, start_layer=0, key: int | None = 3, owners=None):
    """Untrained context heads (= the next routers); `key`: a random fc2, so their sets differ
    from any other heads' (None keeps the routers' sets)."""
    engine = Engine.load(converted, EngineOptions(mode="reactive", no_lora=True))
    try:
        if owners is None:
            owners = default_owners(
                start_layer, len(engine.family.layers(engine.model)), engine.moe_layers
            )
        heads = init_heads_from_routers(engine, owners, width=32, seed=0)
        if key is not None:
            heads.fc2 = mx.random.normal(heads.fc2.shape, key=mx.random.key(key)) * 0.5
        return save_heads(path, heads)
    finally:
        engine.close()


def _engine(converted, heads, hedge=None, **options):
    extra = {"hedge_path": str(hedge)} if hedge is not None else {"no_hedge": True}
    return Engine.load(
        converted,
        EngineOptions(
            mode="prerouted",
            prerouter_path=str(heads),
            no_lora=True,
            **extra,
            **options,
        ),
    )


def _decode_logits(engine, steps: int = 10) -> tuple[list[mx.array], int]:
    """Greedy prefill + decode: every step's logits (the token fed back is the argmax), and
    the loads the decode steps blocked on."""
    sequence = engine.sequence()
    logits = sequence.prefill(engine.tokenizer.encode(PROMPT))
    out, blocked = [logits], engine.counters.blocked_loads
    for _ in range(steps):
        logits = sequence.step(int(mx.argmax(logits).item()))
        out.append(logits)
    return out, engine.counters.blocked_loads - blocked


@pytest.fixture(scope="module", params=["qwen", "bailing"])
def drafted(request, tmp_path_factory):
    """(model, next-token heads, MoE layers, vocabulary size, the greedy tokens of a plain
    decode of PROMPT, its logits)."""
    converted = request.getfixturevalue(f"edge0_{request.param}")
    tmp = tmp_path_factory.mktemp("draft")
    heads, moe = next_token_heads(converted, tmp / "nt.safetensors")
    plain = _engine(converted, heads)
    try:
        logits, _ = _decode_logits(plain)
        vocab = plain.family.embedding(plain.model).weight.shape[0]
    finally:
        plain.close()
    greedy = [int(mx.argmax(x).item()) for x in logits]
    return converted, heads, moe, vocab, greedy, logits, tmp


def _vocab(tmp, name, ids, vocab):
    return save_draft_vocab(tmp / name, np.asarray(ids), vocab, {"source": "test"})


def test_a_whole_vocabulary_draft_is_the_routing(drafted):
    """Drafting from every row of the LM head (in a shuffled order) drafts the greedy token
    every step: the hedge is the routing (precision 1), its plans are the ones used, every
    logit equals the unhedged engine's, and no read waits for the token."""
    converted, heads, moe, vocab, greedy, want, tmp = drafted
    order = np.random.default_rng(0).permutation(vocab)
    engine = _engine(converted, heads, _vocab(tmp, "all.safetensors", order, vocab))
    try:
        got, blocked = _decode_logits(engine)
        for step, (a, b) in enumerate(zip(want, got)):
            assert mx.array_equal(a, b).item(), step
        stats = engine.stats()
        assert stats["draft_match_rate"] == 1.0 and stats["hedge_precision"] == 1.0
        assert stats["hedge_layers"] == sorted(engine.prerouter.consumers)
        assert stats["hedge_kind"] == f"draft token ({vocab} ids)"
        c = engine.prerouter.counters
        # the prefill's last step drafts for the first decode step, as each step for the next
        assert (
            c.draft_rows == 10
            and c.hedge_staged == 10 * len(moe) * engine.experts_per_token
        )
        assert c.hedge_wasted == c.hedge_cancelled == 0
        assert stats["dropped_experts"] == 0 and blocked == 0
    finally:
        engine.close()


def test_heads_host_time_leaves_out_the_steps_compute(drafted, monkeypatch):
    """The heads' and the hedge's host figures are their graph building and selection, not
    the wait for the step's layers (their features' inputs): with every evaluation slowed by
    0.1 s, they stay under half of that a step (counting the wait they would exceed it)."""
    converted, heads, _, vocab, _, _, tmp = drafted
    engine = _engine(
        converted, heads, _vocab(tmp, "slow.safetensors", range(vocab), vocab)
    )
    slow, real = 0.1, experts.evaluate

    def slowed(counters, *arrays, wait=mx.eval):
        real(counters, *arrays, wait=lambda *a: (wait(*a), time.sleep(slow)))

    for module in (batch, step, routing, experts):  # every module that waits
        monkeypatch.setattr(module, "evaluate", slowed)
    try:
        waits = engine.counters.eval_wait_seconds
        _decode_logits(engine, steps=3)
        stats, c = engine.stats(), engine.counters
        steps = stats["prerouted_steps"]
        assert steps == 3 and c.eval_wait_seconds - waits >= 2 * slow * (steps + 1)
        assert 0 < stats["head_host_ms_per_step"] < 1000 * slow / 2
        assert 0 < stats["hedge_host_ms_per_step"] < 1000 * slow / 2
    finally:
        engine.close()


@pytest.mark.parametrize("slots", [None, "top_k"])
def test_a_draft_that_misses_changes_no_logit(drafted, slots):
    """A slice that holds some of the greedy tokens and not others: the steps whose draft
    missed route at the served token (reusing the draft's plans there would change the
    logits), and nothing else changes either, at 2K slots and at K."""
    converted, heads, moe, vocab, greedy, want, tmp = drafted
    served = list(dict.fromkeys(greedy[1:]))
    others = [i for i in range(vocab) if i not in served][:8]
    ids = others[:4] + served[::2] + others[4:]  # every other served token
    probe = _engine(converted, heads)
    k = probe.experts_per_token
    probe.close()
    options = {} if slots is None else {"slots_per_layer": k}
    engine = _engine(
        converted, heads, _vocab(tmp, "some.safetensors", ids, vocab), **options
    )
    try:
        got, blocked = _decode_logits(engine)
        for step, (a, b) in enumerate(zip(want, got)):
            assert mx.array_equal(a, b).item(), step
        stats = engine.stats()
        assert 0 < stats["draft_match_rate"] < 1
        assert stats["dropped_experts"] == 0 and blocked == 0
    finally:
        engine.close()


def test_draft_hedged_batch_rows_equal_solo(drafted):
    converted, heads, _, vocab, _, _, tmp = drafted
    path = _vocab(tmp, "batch.safetensors", np.arange(0, vocab, 3), vocab)
    assert_batch_rows_equal_solo(converted, heads, hedge_path=str(path))


def test_draft_head_is_the_lm_head_on_its_rows(edge0_qwen):
    """The slice's logits are the LM head's at those rows, for a quantized head, a float one
    and one with a LoRA path."""
    import mlx.nn as nn

    from edge0_eval.engine.lora import LoRALinear

    engine = Engine.load(edge0_qwen, EngineOptions(mode="reactive", no_lora=True))
    try:
        norm, head, tied = engine.family.output_head(engine.model)
        # a norm weight far from ones: without the norm the argmax would differ
        norm.weight = mx.random.uniform(-2, 2, norm.weight.shape, key=mx.random.key(3))
        h = mx.random.normal((64, 3, norm.weight.shape[0]), key=mx.random.key(0))
        ids = mx.array([7, 2, 11, 5])
        full = head.as_linear(norm(h[:, -1])) if tied else head(norm(h[:, -1]))
        drafted = DraftHead(norm, head, tied, ids)(h)
        assert mx.array_equal(drafted, ids[mx.argmax(full[:, ids], axis=-1)]).item()
    finally:
        engine.close()
    x = mx.random.normal((2, 64), key=mx.random.key(1))
    for layer in (
        nn.Linear(64, 32),
        nn.QuantizedLinear(64, 32, group_size=64, bits=4),
        LoRALinear(
            nn.Linear(64, 32),
            4,
            8.0,
            lora_B=mx.random.normal((32, 4), key=mx.random.key(2)),
        ),
    ):
        assert mx.allclose(row_slice(layer, ids)(x), layer(x)[:, ids], atol=1e-5).item()
    with pytest.raises(TypeError, match="cannot slice the rows of a Sequential"):
        # never a silently unsliced head
        row_slice(nn.Sequential(nn.Linear(64, 32)), ids)


def test_bad_draft_vocabularies_are_refused_naming_the_file(drafted):
    converted, heads, moe, vocab, _, _, tmp = drafted
    cases = [
        (
            _vocab(tmp, "big.safetensors", [1, vocab], vocab),
            r"big.safetensors: ids for a vocab",
        ),
        (
            _vocab(tmp, "dup.safetensors", [1, 2, 1], vocab),
            r"dup.safetensors: .*unique 2 of 3",
        ),
        (
            _vocab(tmp, "other.safetensors", [1, 2], vocab + 1),
            rf"other.safetensors: .*vocabulary of {vocab + 1} tokens.*this model has {vocab}",
        ),
    ]
    trunc = tmp / "trunc.safetensors"
    trunc.write_bytes(_vocab(tmp, "ok.safetensors", [1, 2], vocab).read_bytes()[:60])
    cases.append((trunc, r"trunc.safetensors"))
    for path, pattern in cases:
        with pytest.raises(CheckpointError, match=pattern):
            _engine(converted, heads, path)
    ctx = context_heads(converted, tmp / "ctx.safetensors")
    ok = tmp / "ok.safetensors"
    with pytest.raises(
        CheckpointError, match=r"ok.safetensors: a hedge serves next-token"
    ):
        _engine(converted, ctx, ok)
    # a context-heads file as the hedge: no longer served, one error naming it
    with pytest.raises(
        CheckpointError,
        match=r"ctx.safetensors holds prerouter heads: hedges "
        r"of context heads are no longer served",
    ):
        _engine(converted, heads, ctx)
    with pytest.raises(
        CheckpointError,
        match=rf"ok.safetensors: hedge_layers 99: the "
        rf"next-token heads plan {len(moe)} layers",
    ):
        _engine(converted, heads, ok, hedge_layers=99)
    engine = _engine(converted, heads, ok, hedge_layers=1)
    try:
        assert engine.prerouter.draft_layers == [moe[0]]
        _decode_logits(engine, steps=4)
        c = engine.prerouter.counters  # one layer's set staged per drafted step
        assert c.draft_rows == 4 and c.hedge_staged == 4 * engine.experts_per_token
        assert load_draft_vocab(ok, vocab).tolist() == [1, 2]
    finally:
        engine.close()


def test_draft_vocab_cli_counts_the_text(edge0_qwen, tmp_path, capsys):
    from edge0_eval import cli

    text = tmp_path / "text.jsonl"
    text.write_text('{"text": "the cat the cat the dog"}\n{"text": "the end"}\n')
    out = tmp_path / "draft.safetensors"
    assert (
        cli.main(
            [
                "draft-vocab",
                str(edge0_qwen),
                "--text",
                str(text),
                "--tokens",
                "16",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    engine = Engine.load(edge0_qwen, EngineOptions(mode="reactive", no_lora=True))
    try:
        tokens = [
            t
            for line in ("the cat the cat the dog", "the end")
            for t in engine.tokenizer.encode(line)
        ]
        vocab = engine.family.embedding(engine.model).weight.shape[0]
    finally:
        engine.close()
    ids = load_draft_vocab(out, vocab).tolist()
    counts = np.bincount(tokens, minlength=vocab)
    assert len(ids) == 16 and ids[0] == int(np.argmax(counts))
    assert [counts[i] for i in ids] == sorted((counts[i] for i in ids), reverse=True)
    assert set(np.flatnonzero(counts).tolist()) <= set(ids)
    assert "16 of" in capsys.readouterr().out
    assert (
        cli.main(
            [
                "draft-vocab",
                str(edge0_qwen),
                "--text",
                str(text),
                "--tokens",
                str(vocab + 1),
                "--out",
                str(out),
            ]
        )
        != 0
    )


def test_a_sampled_draft_adds_the_samplers_noise(drafted):
    """Sampling: a whole-vocabulary draft that adds the noise each row's sampler is about to
    draw drafts every sampled token (a plain argmax would not); with top-p on, tokens stay
    those of the unhedged engine. Solo and batched rows (each with its own seed) alike."""
    converted, heads, _, vocab, _, _, tmp = drafted
    path = _vocab(
        tmp,
        "all_sampled.safetensors",
        np.random.default_rng(1).permutation(vocab),
        vocab,
    )
    plain, engine = _engine(converted, heads), _engine(converted, heads, path)
    try:
        prompt = plain.tokenizer.encode("def add(a, b):")
        for temperature, top_p in ((1.0, 1.0), (0.7, 0.9)):
            want = plain.generate(
                prompt,
                max_tokens=10,
                temperature=temperature,
                top_p=top_p,
                seed=5,
                stop_token_ids=set(),
            ).tokens
            engine.prerouter.counters.draft_rows = (
                engine.prerouter.counters.draft_matches
            ) = 0
            got = engine.generate(
                prompt,
                max_tokens=10,
                temperature=temperature,
                top_p=top_p,
                seed=5,
                stop_token_ids=set(),
            ).tokens
            assert got == want, (temperature, top_p)
            if top_p == 1.0:
                c = engine.prerouter.counters
                assert c.draft_rows == 9 and c.draft_matches == 9  # every decode step
        prompts = [plain.tokenizer.encode(p) for p in ("import os", "x = 1", "# hi")]
        seeds = [3, 4, 5]
        solo = [
            plain.generate(
                p, max_tokens=6, temperature=1.0, seed=s, stop_token_ids=set()
            ).tokens
            for p, s in zip(prompts, seeds)
        ]
        engine.prerouter.counters.draft_rows = (
            engine.prerouter.counters.draft_matches
        ) = 0
        rows = engine.generate_batch(
            prompts,
            max_tokens=6,
            batch_size=2,
            temperature=1.0,
            seeds=seeds,
            stop_token_ids=set(),
        )
        assert [r.tokens for r in rows] == solo
        c = engine.prerouter.counters
        assert c.draft_rows > 0 and c.draft_matches == c.draft_rows
    finally:
        engine.close()
        plain.close()


def test_hedge_file_found_beside_the_model_and_turned_off(edge0_qwen, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(edge0_qwen, model)
    heads, moe = next_token_heads(model, model / "prerouter.safetensors")
    engine = Engine.load(model, EngineOptions(mode="reactive", no_lora=True))
    vocab = engine.family.embedding(engine.model).weight.shape[0]
    engine.close()
    _vocab(model, HEDGE_FILE, [1, 2, 3], vocab)
    resolved = EngineOptions(mode="prerouted", no_lora=True).resolve(model)
    assert resolved.hedge_path == model / HEDGE_FILE
    assert (
        EngineOptions(mode="prerouted", no_hedge=True).resolve(model).hedge_path is None
    )
    assert EngineOptions(mode="reactive").resolve(model).hedge_path is None
    with pytest.raises(MissingAdapterError, match=r"nope.safetensors.*--no-hedge"):
        EngineOptions(
            mode="prerouted", hedge_path=str(tmp_path / "nope.safetensors")
        ).resolve(model)
    with pytest.raises(ConfigError, match="hedge_layers 2 without a hedge"):
        EngineOptions(mode="prerouted", no_hedge=True, hedge_layers=2).resolve(model)
    # another arm of the same command line (bench: reactive, compute-only) ignores it
    assert (
        EngineOptions(mode="reactive", hedge_layers=2).resolve(model).hedge_path is None
    )
    engine = Engine.load(
        model, EngineOptions(mode="prerouted", no_lora=True, hedge_layers=1)
    )
    try:
        assert engine.prerouter.draft_layers == [moe[0]]  # the first in step order
    finally:
        engine.close()


def test_cli_flags_reach_the_options():
    import argparse

    from edge0_eval.arguments.engine_flags import (
        add_engine_arguments,
        options_from_args,
    )

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    opts = options_from_args(
        parser.parse_args(["--hedge", "h.safetensors", "--hedge-layers", "3"])
    )
    assert (opts.hedge_path, opts.hedge_layers, opts.no_hedge) == (
        "h.safetensors",
        3,
        False,
    )
    assert options_from_args(parser.parse_args(["--no-hedge"])).no_hedge


@pytest.mark.parametrize("slots", [4, 8])
def test_routed_set_takes_over_a_hedge_in_flight(edge0_qwen, slots):
    """Storage slowed so that the hedge's reads are still queued when the routed set arrives:
    queued reads of its misses are cancelled and their slots freed, a slot the routed set
    needs is taken back, and afterwards every resident expert's slot holds its own bundle
    (no slot is written twice, nothing unwritten is trusted)."""
    from edge0_eval.formats.layout import unpack_bundle

    index_stride = Engine.load(edge0_qwen, EngineOptions(mode="reactive", no_lora=True))
    stride = index_stride.index.layout(index_stride.moe_layers[1]).bundle_stride
    index_stride.close()
    engine = Engine.load(
        edge0_qwen,
        EngineOptions(
            mode="reactive",
            no_lora=True,
            slots_per_layer=slots,
            io_workers=1,
            io_throttle_mbps=stride / 0.05 / 1e6,
        ),
    )  # 50 ms a bundle, one at a time
    try:
        switch = engine.blocks[engine.moe_layers[1]].switch_mlp
        hedge = switch.stage_begin([1, 0, 2, 3], cancellable=True)  # as Prerouter.hedge
        first = next(f for f, rows in hedge.reads if rows[0][1] == 1)  # expert 1's
        while not (first.running() or first.done()):
            time.sleep(0.001)  # expert 1's read has started: it cannot be cancelled
        routed = switch.stage_begin([0, 4, 5, 6], hedge=hedge)
        outcome = routed.hedge
        assert (outcome.staged, outcome.hits, outcome.cancelled) == (4, 1, 2)
        # expert 1 was read in vain; 4 slots: the routed set needs its slot, so its bundle is
        # never written; 8: it lands beside the routed set
        assert outcome.wasted == 1
        assert (1 in switch.slots.resident_experts) == (slots == 8)
        slots_written = [slot for _, slot in routed.loads]
        assert len(slots_written) == len(set(slots_written))
        assert all(switch.slots.slot_of(e) == slot for e, slot in routed.loads)
        waited, dropped = switch.stage_finish(routed)
        assert dropped == 0
        glu = switch.glu
        for e in switch.slots.resident_experts:
            want = unpack_bundle(
                switch._io.layout, engine.store.read(switch._io.layer, e)
            )
            slot = switch.slots.slot_of(e)
            assert mx.array_equal(
                glu.gate_proj["weight"][slot], mx.array(want["gate_proj.weight"])
            ).item(), (e, slot)
        assert set(routed.experts) <= set(switch.slots.resident_experts)
    finally:
        engine.close()


def test_preflight_stops_a_truncated_hedge(edge0_qwen, tmp_path):
    from model_wrappers.partitioners.partitioner import model_problems

    model = tmp_path / "model"
    shutil.copytree(edge0_qwen, model)
    next_token_heads(model, model / "prerouter.safetensors")
    hedge = _vocab(model, HEDGE_FILE, [1, 2, 3], 64)
    arm = {
        "abbr": "s",
        "path": str(model),
        "type": "Edge0Model",
        "mode": "prerouted",
        "no_lora": True,
    }
    assert model_problems([arm]) == []
    hedge.write_bytes(hedge.read_bytes()[:60])
    problems = model_problems([arm])
    assert len(problems) == 1 and HEDGE_FILE in problems[0] and "hedge" in problems[0]
    assert model_problems([arm | {"no_hedge": True}]) == []
