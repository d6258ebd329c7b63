"""Draft-token hedge: next-token heads evaluated at a token drafted from a slice of the LM head
stage their sets before the LM head runs; routing stays the next-token heads' at the served
token, so logits never change, and when the served token is the draft the hedge is the
routing."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from decode_parity import assert_batch_rows_equal_solo

from edge0_eval.engine.draft import DraftHead, load_draft_vocab, row_slice, save_draft_vocab
from edge0_eval.engine.engine import Engine
from edge0_eval.engine.options import EngineOptions
from edge0_eval.errors import CheckpointError

from test_hedge import _decode_logits, _engine, context_heads
from test_next_token_heads import next_token_heads


@pytest.fixture(scope="module", params=["qwen", "bailing"])
def drafted(request, tmp_path_factory):
    """(model, next-token heads, MoE layers, vocabulary size, the greedy tokens of a plain
    decode of test_hedge's prompt, its logits)."""
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
        # the prefill's step has no draft (its LM head ran already); the 9 after it do
        assert c.draft_rows == 9 and c.hedge_staged == 9 * len(moe) * engine.top_k
        assert c.hedge_wasted == c.hedge_cancelled == 0
        assert stats["dropped_experts"] == 0 and blocked == 0
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
    ids = others[:4] + served[::2] + others[4:]            # every other served token
    probe = _engine(converted, heads)
    k = probe.top_k
    probe.close()
    options = {} if slots is None else {"slots_per_layer": k}
    engine = _engine(converted, heads, _vocab(tmp, "some.safetensors", ids, vocab), **options)
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
    for layer in (nn.Linear(64, 32), nn.QuantizedLinear(64, 32, group_size=64, bits=4),
                  LoRALinear(nn.Linear(64, 32), 4, 8.0,
                             lora_B=mx.random.normal((32, 4), key=mx.random.key(2)))):
        assert mx.allclose(row_slice(layer, ids)(x), layer(x)[:, ids], atol=1e-5).item()
    with pytest.raises(TypeError, match="cannot slice the rows of a Sequential"):
        row_slice(nn.Sequential(nn.Linear(64, 32)), ids)      # never a silently unsliced head


def test_bad_draft_vocabularies_are_refused_naming_the_file(drafted):
    converted, heads, moe, vocab, _, _, tmp = drafted
    cases = [
        (_vocab(tmp, "big.safetensors", [1, vocab], vocab), r"big.safetensors: ids for a vocab"),
        (_vocab(tmp, "dup.safetensors", [1, 2, 1], vocab), r"dup.safetensors: .*unique 2 of 3"),
        (_vocab(tmp, "other.safetensors", [1, 2], vocab + 1),
         rf"other.safetensors: .*vocabulary of {vocab + 1} tokens.*this model has {vocab}"),
    ]
    trunc = tmp / "trunc.safetensors"
    trunc.write_bytes(_vocab(tmp, "ok.safetensors", [1, 2], vocab).read_bytes()[:60])
    cases.append((trunc, r"trunc.safetensors"))
    for path, pattern in cases:
        with pytest.raises(CheckpointError, match=pattern):
            _engine(converted, heads, path)
    ctx = context_heads(converted, tmp / "ctx.safetensors")
    ok = tmp / "ok.safetensors"
    with pytest.raises(CheckpointError, match=r"ok.safetensors: a hedge serves next-token"):
        _engine(converted, ctx, ok)
    with pytest.raises(CheckpointError, match=rf"ok.safetensors: hedge_layers 99: the "
                                              rf"next-token heads plan {len(moe)} layers"):
        _engine(converted, heads, ok, hedge_layers=99)
    engine = _engine(converted, heads, ok, hedge_layers=1)
    try:
        assert engine.prerouter.draft_layers == [moe[0]]
        _decode_logits(engine, steps=4)
        c = engine.prerouter.counters              # one layer's set staged per drafted step
        assert c.draft_rows == 3 and c.hedge_staged == 3 * engine.top_k
        assert load_draft_vocab(ok, vocab).tolist() == [1, 2]
    finally:
        engine.close()


def test_draft_vocab_cli_counts_the_text(edge0_qwen, tmp_path, capsys):
    from edge0_eval import cli

    text = tmp_path / "text.jsonl"
    text.write_text('{"text": "the cat the cat the dog"}\n{"text": "the end"}\n')
    out = tmp_path / "draft.safetensors"
    assert cli.main(["draft-vocab", str(edge0_qwen), "--text", str(text), "--tokens", "16",
                     "--out", str(out)]) == 0
    engine = Engine.load(edge0_qwen, EngineOptions(mode="reactive", no_lora=True))
    try:
        tokens = [t for line in ("the cat the cat the dog", "the end")
                  for t in engine.tokenizer.encode(line)]
        vocab = engine.family.embedding(engine.model).weight.shape[0]
    finally:
        engine.close()
    ids = load_draft_vocab(out, vocab).tolist()
    counts = np.bincount(tokens, minlength=vocab)
    assert len(ids) == 16 and ids[0] == int(np.argmax(counts))
    assert [counts[i] for i in ids] == sorted((counts[i] for i in ids), reverse=True)
    assert set(np.flatnonzero(counts).tolist()) <= set(ids)
    assert "16 of" in capsys.readouterr().out
    assert cli.main(["draft-vocab", str(edge0_qwen), "--text", str(text), "--tokens",
                     str(vocab + 1), "--out", str(out)]) != 0


def test_a_sampled_draft_adds_the_samplers_noise(drafted):
    """Sampling: a whole-vocabulary draft that adds the noise each row's sampler is about to
    draw drafts every sampled token (a plain argmax would not); with top-p on, tokens stay
    those of the unhedged engine. Solo and batched rows (each with its own seed) alike."""
    converted, heads, _, vocab, _, _, tmp = drafted
    path = _vocab(tmp, "all_sampled.safetensors",
                  np.random.default_rng(1).permutation(vocab), vocab)
    plain, engine = _engine(converted, heads), _engine(converted, heads, path)
    try:
        prompt = plain.tokenizer.encode("def add(a, b):")
        for temperature, top_p in ((1.0, 1.0), (0.7, 0.9)):
            want = plain.generate(prompt, max_tokens=10, temperature=temperature, top_p=top_p,
                                  seed=5, stop_token_ids=set()).tokens
            engine.prerouter.counters.draft_rows = engine.prerouter.counters.draft_matches = 0
            got = engine.generate(prompt, max_tokens=10, temperature=temperature, top_p=top_p,
                                  seed=5, stop_token_ids=set()).tokens
            assert got == want, (temperature, top_p)
            if top_p == 1.0:
                c = engine.prerouter.counters
                assert c.draft_rows == 8 and c.draft_matches == 8
        prompts = [plain.tokenizer.encode(p) for p in ("import os", "x = 1", "# hi")]
        seeds = [3, 4, 5]
        solo = [plain.generate(p, max_tokens=6, temperature=1.0, seed=s,
                               stop_token_ids=set()).tokens for p, s in zip(prompts, seeds)]
        engine.prerouter.counters.draft_rows = engine.prerouter.counters.draft_matches = 0
        rows = engine.generate_batch(prompts, max_tokens=6, batch_size=2, temperature=1.0,
                                     seeds=seeds, stop_token_ids=set())
        assert [r.tokens for r in rows] == solo
        c = engine.prerouter.counters
        assert c.draft_rows > 0 and c.draft_matches == c.draft_rows
    finally:
        engine.close()
        plain.close()
