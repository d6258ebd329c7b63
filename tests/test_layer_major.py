"""Layer-major teacher-forced scoring (engine/layer_major.py) against decode one step at a time,
for every family and mode, with the LoRA on and off, and the teacher arm against mlx-lm's own
steps: float32 on the CPU, bit-identical (bailing_hybrid included: its pieces are cut as the
steps cut them). Batches split by the memory bound, sequences in several windows, the
wrap-around head's fixed point, and each layer pass reading an expert at most once.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from test_forced import CASES, PROMPT

from edge0_eval.engine.engine import Engine, EngineOptions
from edge0_eval.engine.layer_major import Forced, LayerMajor
from edge0_eval.evaluation.fidelity import scoring as fid

# Prompts of other lengths, continuations of other lengths (one of a single token).
LENGTHS = [(0, 23), (9, 1), (4, 17)]


def _items(tokenizer, seed: int) -> list[Forced]:
    rng = np.random.default_rng(seed)
    base = tokenizer.encode(PROMPT)
    return [
        Forced(base[: len(base) - cut], [int(t) for t in rng.integers(3, 400, size=n)])
        for cut, n in LENGTHS
    ]


def _stepped(runner, items: list[Forced]) -> list[np.ndarray]:
    """generate's loop written out: prefill, then one step per token, per item."""
    out = []
    for item in items:
        rows = [runner.start(item.prompt)]
        rows += [runner.advance(t) for t in item.tokens[:-1]]
        out.append(np.stack(rows))
    return out


def _layer_major(scorer: LayerMajor, items: list[Forced]) -> list[np.ndarray]:
    rows = [dict() for _ in items]
    for index, first, lp in scorer.rows(items):
        for r, row in enumerate(lp):
            assert first + r not in rows[index]
            rows[index][first + r] = row
    return [np.stack([got[r] for r in range(len(got))]) for got in rows]


def _engine(forced_student, mode, heads, lora=True, prefill_chunk=512):
    _, converted, files, lora_file = forced_student
    return Engine.load(
        converted,
        EngineOptions(
            mode=mode,
            slots_per_layer=None if mode == "resident" else 6,
            prerouter_path=str(files[heads]) if heads else None,
            lora_path=str(lora_file) if lora else None,
            no_lora=not lora,
            prefill_chunk=prefill_chunk,
        ),
    )


def _assert_equal(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        assert np.array_equal(g, w), float(np.abs(g - w).max())


@pytest.mark.parametrize("mode,heads", CASES)
def test_layer_major_equals_decode_steps(forced_student, mode, heads):
    """Every family x mode (LoRA on): bit-identical to prefill + one step per token, with the
    batch split by a small memory bound and sequences cut in windows."""
    engine = _engine(forced_student, mode, heads)
    try:
        items = _items(engine.tokenizer, 0)
        want = _stepped(fid.EngineRunner(engine), items)
        # One batch, one window; then a bound that splits the batch and windows of 8.
        for memory_mib, window in ((64.0, 1024), (None, 8)):
            scorer = LayerMajor.for_engine(engine, window=window)
            if memory_mib is None:  # room for ~20 positions a round: 2+ batches
                scorer = LayerMajor.for_engine(
                    engine,
                    window=window,
                    memory_mib=20 * scorer.bytes_per_position / 2**20,
                )
            else:
                scorer = LayerMajor.for_engine(
                    engine, window=window, memory_mib=memory_mib
                )
            _assert_equal(_layer_major(scorer, items), want)
            st = scorer.stats
            assert st.scored == sum(len(i.tokens) for i in items)
            if memory_mib is None:
                # bailing_hybrid's prompt pieces are the engine's prefill pieces whatever
                # the bound (its cuts change the bits): up to a whole prompt here.
                bound = (
                    20
                    if forced_student[0] != "bailing"
                    else max(len(i.prompt) for i in items)
                )
                assert st.batches >= 2 and st.max_round_positions <= bound
            if heads == "wrap":
                # Untrained heads that disagree with the router: more than one pass a round
                # (bailing_hybrid's continuation rounds hold one position each: one pass).
                assert st.wrap_rounds > 0
                if forced_student[0] != "bailing":
                    assert st.wrap_passes > st.wrap_rounds
        if mode == "prerouted":
            assert engine.counters.dropped_experts == 0
    finally:
        engine.close()


@pytest.mark.parametrize(
    "mode,heads,chunk",
    [("reactive", None, 512), ("prerouted", "context", 512), ("prerouted", "wrap", 1)],
)
def test_layer_major_without_lora(forced_student, mode, heads, chunk):
    """LoRA off; and a prefill of one token a piece, whose first plan sees no t-1 ids."""
    engine = _engine(forced_student, mode, heads, lora=False, prefill_chunk=chunk)
    try:
        assert engine.lora is None
        items = _items(engine.tokenizer, 1)
        want = _stepped(fid.EngineRunner(engine), items)
        _assert_equal(_layer_major(LayerMajor.for_engine(engine), items), want)
    finally:
        engine.close()


@pytest.mark.parametrize("family", ["qwen", "bailing", "qwen2"])
def test_teacher_layer_major_equals_mlx_lm_steps(family, request):
    """The teacher arm (mlx-lm, resident): layer-major against mlx-lm's own one-token steps."""
    model, tokenizer = fid.load_teacher(request.getfixturevalue(f"tiny_{family}"))
    items = _items(tokenizer, 2)
    want = _stepped(fid.MLXRunner(model), items)
    for window in (1024, 5):
        scorer = LayerMajor.for_mlx_lm(model, cuts=fid.MLXRunner.cuts, window=window)
        _assert_equal(_layer_major(scorer, items), want)


def test_a_layer_pass_reads_each_expert_once(forced_student, monkeypatch):
    """Reactive, slots far fewer than the batch's union: within each layer pass (a round's
    MoE call over the batch) every expert is read at most once, and the batch reads less
    than stepping does (qwen families: one round for the whole batch)."""
    engine = _engine(forced_student, "reactive", None)
    try:
        passes = []  # per layer pass (a layer over the batch): the (layer, expert) reads
        read_many = engine.store.read_many
        layer_pass = LayerMajor._layer

        def spy_reads(keys, sink, chunks=None):
            passes[-1].extend(keys)
            return read_many(keys, sink, chunks)

        def spy_pass(self, i, *args):
            passes.append([])
            return layer_pass(self, i, *args)

        engine.store.read_many = spy_reads
        monkeypatch.setattr(LayerMajor, "_layer", spy_pass)
        items = _items(engine.tokenizer, 3)
        scorer = LayerMajor.for_engine(engine)
        _layer_major(scorer, items)
        monkeypatch.undo()
        st = scorer.stats
        assert len(passes) == st.rounds * len(engine.family.layers(engine.model))
        if forced_student[0] != "bailing":
            assert st.rounds == 1
        for keys in passes:
            assert len(keys) == len(set(keys)) and len({k[0] for k in keys}) <= 1
        batch = sum(map(len, passes))
        assert batch > 6 * len(engine.blocks)
        passes.append([])
        _stepped(fid.EngineRunner(engine), items)
        # bailing_hybrid's rounds hold one continuation position per sequence: a round
        # reads the union of 3 rows' experts, not the whole batch's.
        assert len(passes[-1]) > (1 if forced_student[0] == "bailing" else 2) * batch
    finally:
        engine.close()


def test_a_non_finite_position_is_an_error_naming_the_item(forced_student, monkeypatch):
    """Every scored row is checked: a NaN in one item's logits stops the batch naming it."""
    from edge0_eval.engine.step import NonFiniteError

    if forced_student[0] == "bailing":
        pytest.skip("its rounds hold one continuation position: no item's rows at once")
    engine = _engine(forced_student, "reactive", None)
    try:
        logits = engine.step.logits

        def nan_in_item_2(h):
            out = logits(h)
            return mx.where(mx.array(h.shape[1] == 17), mx.nan, out)

        monkeypatch.setattr(engine.step, "logits", nan_in_item_2)
        items = _items(engine.tokenizer, 4)  # one round: item 2's 17 rows at once
        with pytest.raises(NonFiniteError, match="of item 2"):
            _layer_major(LayerMajor.for_engine(engine), items)
    finally:
        engine.close()


def test_a_half_precision_set_is_reproduced_by_its_own_scorer(tiny_qwen):
    """In bfloat16 the scorers may round apart, so the set records its dtype and scorer, and
    the teacher arm scored by that scorer reproduces it exactly (KL 0, agreement 1)."""
    from edge0_eval.evaluation.fidelity import sets as fs

    model, tokenizer = fid.load_teacher(tiny_qwen, "bfloat16")
    prompts = [
        fid.Prompt(f"text/{i}", "ifbench", t)
        for i, t in enumerate(["What is 2 + 2?", "Name three primary colours."])
    ]
    fset = fid.make_set(
        tiny_qwen,
        prompts,
        {},
        max_new=12,
        top_k=8,
        compute_dtype="bfloat16",
        loaded=(model, tokenizer),
    )
    assert fset["teacher"]["dtype"] == "bfloat16"
    assert fs.scorer_of(fset) == fs.LAYER_MAJOR
    rows = fid.score_model(model, fset)
    assert all(r["kl"] == 0.0 and r["agreement"] == 1.0 for r in rows)
