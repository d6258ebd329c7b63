"""Teacher-forced scoring in pieces (prefill-shaped) against decode one step at a time, for every
family and mode: the log-probs the fidelity scorer computes are those `Engine.generate` would
compute at each position.

Tolerance: bit-identical for qwen3_5_moe and qwen2_moe (their layers compute a position's bits
whatever piece it sits in). bailing_hybrid runs different algorithms for one position and for a
piece (mlx-lm: GLA's recurrent step vs its block-parallel form, MLA's absorbed query vs its
expanded keys), equal in exact arithmetic and apart by float32 rounding: at most 7.3e-5 nats on
a log-prob here (150 positions, every mode), so the bound is BAILING_TOL = 1e-3 with the same
argmax at every position and the same routing (near-tie flips would move far more).
"""

from __future__ import annotations

import numpy as np
import pytest

from edge0_eval.engine.engine import Engine, EngineOptions
from edge0_eval.evaluation.fidelity import scoring as fid

PROMPT = "def add(a, b):\n    return a + b\n# The quick brown fox"
BAILING_TOL = 1e-3
# (mode, heads): every mode the engine serves, and every kind of prerouter head.
CASES = [
    ("resident", None),
    ("reactive", None),
    ("prerouted", "context"),
    ("prerouted", "next_token"),
    ("prerouted", "wrap"),
]


def _engine(forced_student, mode, heads):
    _, converted, files, lora = forced_student
    # 6 slots of 16 experts at K=4: a piece's union overflows them (read in slot-fulls).
    return Engine.load(
        converted,
        EngineOptions(
            mode=mode,
            slots_per_layer=None if mode == "resident" else 6,
            prerouter_path=str(files[heads]) if heads else None,
            lora_path=str(lora),
        ),
    )


def _decoded(runner, prompt, tokens):
    """generate's loop written out: prefill, then one step per token."""
    rows = [runner.start(prompt)]
    return np.stack(rows + [runner.advance(t) for t in tokens[:-1]])


def _assert_same(family, got, want):
    if family == "bailing":
        assert np.abs(got - want).max() <= BAILING_TOL
        assert np.array_equal(got.argmax(axis=-1), want.argmax(axis=-1))
    else:
        assert np.array_equal(got, want)


@pytest.mark.parametrize("mode,heads", CASES)
def test_forced_pieces_equal_decode_steps(forced_student, mode, heads):
    family = forced_student[0]
    engine = _engine(forced_student, mode, heads)
    try:
        runner = fid.EngineRunner(engine)
        prompt = engine.tokenizer.encode(PROMPT)
        tokens = [int(t) for t in np.random.default_rng(0).integers(3, 400, size=40)]
        want = _decoded(runner, prompt, tokens)
        for chunk in (7, fid.SCORE_CHUNK):  # pieces cut mid-way, and one piece
            rows = [runner.start(prompt)]
            rows += [
                lp
                for logits in runner.sequence.forced(tokens[:-1], chunk)
                for lp in fid._logprobs(logits)
            ]
            _assert_same(family, np.stack(rows), want)
            assert runner.sequence.steps == -(-(len(tokens) - 1) // chunk)
        if mode == "prerouted":
            assert (
                engine.stats()["prerouted_steps"] > 0
                and engine.counters.dropped_experts == 0
            )
        if heads == "wrap":  # pieces ran to a fixed point, in more than one pass each
            c = engine.counters
            assert c.wrap_chunks > 0 and c.wrap_passes > c.wrap_chunks
        # The scorer returns the same rows at the ids asked for, and the argmax (a wrap
        # student on the CPU: one position a piece, where a fixed point's passes cost more).
        ids = [[t, *range(5)] for t in tokens]
        lp, argmax = fid.teacher_forced(runner, prompt, tokens, ids)
        _assert_same(
            family, lp, np.stack([w[np.asarray(r)] for w, r in zip(want, ids)])
        )
        assert argmax.tolist() == want.argmax(axis=-1).tolist()
        assert runner.sequence.steps == (len(tokens) - 1 if heads == "wrap" else 1)
    finally:
        engine.close()


@pytest.mark.parametrize("family", ["qwen", "bailing", "qwen2"])
def test_teacher_forced_pieces_equal_mlx_lm_steps(family, request):
    """The teacher arm (mlx-lm, resident): pieces against mlx-lm's own one-token steps."""
    model, tokenizer = fid.load_teacher(request.getfixturevalue(f"tiny_{family}"))
    runner = fid.MLXRunner(model)
    prompt = tokenizer.encode(PROMPT)
    tokens = [int(t) for t in np.random.default_rng(1).integers(3, 400, size=40)]
    want = _decoded(runner, prompt, tokens)
    for chunk in (7, fid.SCORE_CHUNK):
        _assert_same(
            family,
            np.stack(list(fid.forced_logprobs(runner, prompt, tokens, chunk))),
            want,
        )


def test_a_piece_reads_and_computes_each_expert_pair_once(forced_student, monkeypatch):
    """A piece whose union overflows the slots: every (layer, expert) is read once, and each
    (position, k) pair runs through the experts once (not once per slot-full)."""
    from mlx_lm.models.switch_layers import SwitchGLU

    engine = _engine(forced_student, "reactive", None)
    try:
        reads, pairs = [], {}
        read_many = engine.store.read_many

        def spy_reads(keys, sink, chunks=None):
            reads.extend(keys)
            return read_many(keys, sink, chunks)

        layer_of = {id(b.switch_mlp.glu): layer for layer, b in engine.blocks.items()}
        call = SwitchGLU.__call__

        def spy_glu(self, x, idx):
            layer = layer_of[id(self)]
            pairs[layer] = pairs.get(layer, 0) + idx.size
            return call(self, x, idx)

        engine.store.read_many = spy_reads
        monkeypatch.setattr(SwitchGLU, "__call__", spy_glu)
        sequence = engine.sequence()
        sequence.prefill(engine.tokenizer.encode(PROMPT))
        reads.clear()
        pairs.clear()
        tokens = [int(t) for t in np.random.default_rng(2).integers(3, 400, size=32)]
        list(sequence.forced(tokens, 32))
        assert len(reads) == len(set(reads)) > 6 * len(engine.blocks) // 2
        assert pairs == {
            layer: 32 * engine.experts_per_token for layer in engine.blocks
        }
    finally:
        engine.close()


@pytest.mark.parametrize("teacher", [False, True])
def test_fidelity_bench_scores_both_arms_alike(
    teacher, edge0_qwen, tiny_qwen_q4, tmp_path
):
    """`fidelity bench` (the fidelity verb's second action) runs every scorer on the student
    and on an mlx-lm teacher, layer-major over 3 prompts, and finds their log-prob rows
    bit-identical to steps' on the 2 that steps score (qwen3_5_moe)."""
    import json

    from edge0_eval.cli import main

    out = tmp_path / "bench.json"
    model = tiny_qwen_q4 if teacher else edge0_qwen
    argv = ["fidelity", "bench", str(model), "--positions", "6", "--rounds", "2"]
    argv += ["--prompts", "3", "--steps-prompts", "2"]
    assert main(argv + ["--json", str(out)] + (["--teacher"] if teacher else [])) == 0
    got = json.loads(out.read_text())
    assert got["bit_identical"] == {"pieces": True, "layer-major": True}
    assert len(got["rounds"]) == 2
    assert set(got["positions_per_s"]) == {"steps", "pieces", "layer-major"}
    assert got["rounds"][1]["layer-major"]["scored_positions"] == 3 * 6
    assert got["rounds"][1]["steps"]["scored_positions"] == 2 * 6
    assert got["layer_major"]["batches"] == 1 and got["rates"]["layer-major"]
    assert ("engine" in got) is not teacher
    if not teacher:  # the store's bytes per scored position, by arm
        assert set(got["bytes_ratio_steps_over"]) == {"pieces", "layer-major"}
