"""OpenCompass's batch in both wrappers: every row equals its prompt run alone (batch_size 1).

The teacher decodes a batch with mlx-lm's BatchGenerator, the student with Engine.generate_batch;
both sample each row from its own key (chat.row_seed), so greedy and sampled rows alike must
equal their solo runs, and per-sample stats stay one entry per sample. Fault injections show
the identity check fails when rows share a random stream or come back out of order.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.generate import BatchGenerator, stream_generate
from mlx_lm.sample_utils import make_sampler

from edge0_eval.demo import TINY_DATASETS, offline_env
from edge0_eval.engine.batch import stop_token_ids
from edge0_eval.engine.inputs import row_seed
from model_wrappers.models import mlx_lm_model
from model_wrappers.models.edge0_model import Edge0Model
from model_wrappers.models.mlx_lm_model import MLXLMModel

REPO = Path(__file__).resolve().parent.parent
# Different lengths (so a batch would pad), and one prompt twice (same prompt, same sample).
PROMPTS = [
    "What is 2 + 2?",
    "Tell me a long story about a dragon and a castle by the sea.",
    "Hi",
    "Explain gravity in simple words to a child of five, with an example.",
    "Hi",
]
GREEDY = dict(temperature=0.0)
SAMPLED = dict(temperature=1.0, top_p=0.9, seed=3)


def teacher(path, gen):
    return MLXLMModel(path=str(path), generation_kwargs=gen)


def student(path, gen):
    return Edge0Model(
        path=str(path),
        mode="reactive",
        no_lora=True,
        no_prerouter=True,
        experts_per_token=2,
        slots_per_layer=4,
        generation_kwargs=gen,
    )


def batch_vs_solo(model, prompts=PROMPTS, max_out_len=16, stop_ids=None, stop_words=()):
    """Rows of one batch and the same prompts one by one: (batch rows, solo rows) of
    (tokens, stats), through the wrappers' batch hook with OpenCompass's prompt handling."""
    ids = [model.encode_prompt(p) for p in prompts]
    seeds = [row_seed(model.sampling["seed"], i) for i in ids]
    stop_ids = stop_token_ids(model.tokenizer, []) if stop_ids is None else stop_ids
    batch = model._generate_batch(ids, max_out_len, stop_ids, list(stop_words), seeds)
    solo = [
        model._generate_batch([i], max_out_len, stop_ids, list(stop_words), [s])[0]
        for i, s in zip(ids, seeds)
    ]

    def rows(answers):
        return [(a.output, {**a.stats, "finish_reason": a.finish}) for a in answers]

    return rows(batch), rows(solo)


def mismatches(model, prompts=PROMPTS, max_out_len=16) -> list[int]:
    """Rows whose prediction at batch_size len(prompts) differs from batch_size 1."""
    batch = model.generate(prompts, max_out_len=max_out_len)
    solo = [model.generate([p], max_out_len=max_out_len)[0] for p in prompts]
    model.pop_sample_stats()
    return [i for i, (a, b) in enumerate(zip(batch, solo)) if a != b]


@pytest.fixture(scope="module")
def edge0_dir(edge0_qwen):
    return edge0_qwen


@pytest.mark.parametrize("gen", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("family", ["tiny_qwen", "tiny_bailing"])
def test_teacher_rows_equal_their_solo_runs(family, gen, request):
    # bailing_hybrid is the family where a batched (right-padded) prefill moves a shorter
    # row's logits: rows are prefilled alone, so they stay exact.
    model = teacher(request.getfixturevalue(family), gen)
    batch, solo = batch_vs_solo(model)
    assert [t for t, _ in batch] == [t for t, _ in solo]
    assert [s["finish_reason"] for _, s in batch] == [
        s["finish_reason"] for _, s in solo
    ]
    assert batch[2][0] == batch[4][0]  # one prompt, one sample
    if gen is SAMPLED:
        # Sampling really happened: not the greedy tokens.
        greedy = teacher(request.getfixturevalue(family), GREEDY)
        assert [t for t, _ in batch] != [t for t, _ in batch_vs_solo(greedy)[1]]


# Logits tolerance of a batched row against its solo run. On the CPU they are bit-identical
# (measured 0 for every family); a GPU's batched matmuls may round differently.
LOGPROB_TOL = 1e-4


def logprob_gap(model, gen) -> float:
    """Largest |log-prob| difference between the rows of BatchGenerator `gen` (all of PROMPTS
    at once) and each prompt's stream_generate run, over 12 greedy tokens."""
    ids = [model.encode_prompt(p) for p in PROMPTS]
    n = 12
    solo = [
        [
            r.logprobs
            for r in stream_generate(model.model, model.tokenizer, i, max_tokens=n)
        ]
        for i in ids
    ]
    try:
        uids = gen.insert(ids, [n] * len(ids))
        batch = {u: [] for u in uids}
        while responses := gen.next_generated():
            for r in responses:
                batch[r.uid].append(r.logprobs)
    finally:
        gen.close()
    assert all(len(batch[u]) == len(row) == n for u, row in zip(uids, solo))
    return max(
        float(mx.abs(a - b).max())
        for u, row in zip(uids, solo)
        for a, b in zip(batch[u], row)
    )


@pytest.mark.parametrize("family", ["tiny_qwen", "tiny_bailing", "tiny_qwen2"])
def test_teacher_batch_logits_match_solo(family, request):
    model = teacher(request.getfixturevalue(family), GREEDY)
    gap = logprob_gap(model, model._batch_generator(len(PROMPTS), 12, set()))
    assert gap <= LOGPROB_TOL
    if mx.default_device() == mx.cpu:
        assert gap == 0.0


@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="measured on the CPU kernels")
def test_logits_check_fails_for_a_batched_prefill(tiny_bailing):
    """The rejected design: mlx-lm's default batched prefill right-pads the shorter prompts,
    which moves their logits on bailing_hybrid (the check must see it)."""
    model = teacher(tiny_bailing, GREEDY)
    gen = BatchGenerator(
        model.model,
        max_tokens=12,
        completion_batch_size=len(PROMPTS),
        prefill_batch_size=len(PROMPTS),
    )
    assert logprob_gap(model, gen) > 0.0


def test_teacher_stop_ids_and_words_end_rows_as_alone(tiny_qwen):
    model = teacher(tiny_qwen, GREEDY)
    free = [t for t, _ in batch_vs_solo(model, max_out_len=16)[1]]
    # A stop id that row 1 first samples mid-way, and a multi-token stop word from row 3's text
    # before any stop id.
    cut = next(i for i in range(2, len(free[1])) if free[1][i] not in free[1][:i])
    stop_id = free[1][cut]
    row3 = free[3][: free[3].index(stop_id)] if stop_id in free[3] else free[3]
    text = model.tokenizer.decode(row3)
    word = next(
        text[i : i + 4]
        for i in range(2, len(text) - 4)
        if len(model.tokenizer.encode(text[i : i + 4], add_special_tokens=False)) > 1
        and text[i : i + 4] not in model.tokenizer.decode(free[1][:cut])
    )
    stops = stop_token_ids(model.tokenizer, []) | {stop_id}
    batch, solo = batch_vs_solo(model, stop_ids=stops, stop_words=[word])
    assert [t for t, _ in batch] == [t for t, _ in solo]
    finish = [s["finish_reason"] for _, s in batch]
    assert finish == [s["finish_reason"] for _, s in solo]
    assert finish[1] == "stop_token" and batch[1][0] == free[1][:cut]
    assert finish[3] == "stop_word" and "length" in finish
    out = model.generate(PROMPTS, max_out_len=16, stopping_criteria=[word])
    assert out == [
        model.generate([p], max_out_len=16, stopping_criteria=[word])[0]
        for p in PROMPTS
    ]
    assert word not in out[3]


@pytest.mark.parametrize("gen", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_student_rows_equal_their_solo_runs(edge0_dir, gen):
    model = student(edge0_dir, gen)
    batch, solo = batch_vs_solo(model)
    assert [t for t, _ in batch] == [t for t, _ in solo]
    assert [s["finish_reason"] for _, s in batch] == [
        s["finish_reason"] for _, s in solo
    ]
    assert batch[2][0] == batch[4][0]
    assert mismatches(model) == []


def test_student_stop_word_ends_rows_as_alone(edge0_dir):
    model = student(edge0_dir, GREEDY)
    text = model.generate([PROMPTS[3]], max_out_len=16)[0]
    word = next(
        text[i : i + 4]
        for i in range(2, len(text) - 4)
        if len(model.tokenizer.encode(text[i : i + 4], add_special_tokens=False)) > 1
    )
    model.pop_sample_stats()
    out = model.generate(PROMPTS, max_out_len=16, stopping_criteria=[word])
    batch = model.pop_sample_stats()
    assert out == [
        model.generate([p], max_out_len=16, stopping_criteria=[word])[0]
        for p in PROMPTS
    ]
    solo = model.pop_sample_stats()
    assert [s["finish_reason"] for s in batch] == [s["finish_reason"] for s in solo]
    assert batch[3]["finish_reason"] == "stop_word" and batch[3]["stop_word"] == word
    assert out[3] == text[: text.find(word)]


def test_predictions_identical_at_batch_sizes_1_and_4_for_both_arms(
    tiny_qwen, edge0_dir
):
    prompts = PROMPTS[:4]
    for model in (teacher(tiny_qwen, SAMPLED), student(edge0_dir, SAMPLED)):
        assert mismatches(model, prompts) == [], model.arm


def test_per_sample_stats_stay_per_sample(tiny_qwen, edge0_dir, tmp_path):
    prompts = PROMPTS[:4]
    for model in (teacher(tiny_qwen, GREEDY), student(edge0_dir, GREEDY)):
        model.stats_jsonl = str(tmp_path / f"{model.arm}.jsonl")
        model.pop_sample_stats()
        model.generate(prompts, max_out_len=6)
        stats = model.pop_sample_stats()
        assert len(stats) == 4 and model.pop_sample_stats() == []
        lines = [
            json.loads(x) for x in Path(model.stats_jsonl).read_text().splitlines()
        ]
        assert lines == stats
        for prompt, s in zip(prompts, stats):
            ids = model.encode_prompt(prompt)
            assert s["prompt_tokens"] == len(ids) and s["seed"] == row_seed(0, ids)
            assert s["batch_size"] == 4 and 0 < s["tokens"] <= 6
            for key in (
                "decode_tok_s",
                "prefill_tok_s",
                "wall_s",
                "batch_decode_tok_s",
                "batch_wall_s",
                "peak_memory_gib",
            ):
                assert isinstance(s[key], float) and s[key] >= 0, (model.arm, key)
            assert s["wall_s"] <= s["batch_wall_s"] + 1e-3
        # The batch's figures are shared; each row's prompt length and seed are its own.
        assert len({s["batch_decode_tok_s"] for s in stats}) == 1
        assert len({s["prompt_tokens"] for s in stats}) == 4
        model.generate(prompts[:1], max_out_len=6)
        (alone,) = model.pop_sample_stats()
        assert alone["batch_size"] == 1
        # The student's solo row is a batch of one (Engine.generate): its batch figures are
        # its own; mlx-lm's solo path (stream_generate) has none.
        assert ("batch_decode_tok_s" in alone) == (model.arm == "student")


def test_identity_check_fails_when_rows_share_the_global_random_stream(
    tiny_qwen, monkeypatch
):
    model = teacher(tiny_qwen, SAMPLED)
    assert mismatches(model) == []

    def global_stream(seed, temperature, top_p=1.0, min_p=0.0, top_k=0):
        # The old scheme: reseed MLX's global RNG per sample and sample from it. Alone a row
        # owns the stream; in a batch the rows' draws interleave.
        mx.random.seed(0)
        return make_sampler(temp=temperature, top_p=top_p)

    monkeypatch.setattr(mlx_lm_model, "row_sampler", global_stream)
    assert mismatches(model) != []


def test_identity_check_fails_when_rows_come_back_reversed(tiny_qwen, monkeypatch):
    model = teacher(tiny_qwen, GREEDY)
    original = MLXLMModel._generate_batch

    def reversed_rows(self, *args):
        return original(self, *args)[::-1]

    monkeypatch.setattr(MLXLMModel, "_generate_batch", reversed_rows)
    assert mismatches(model, PROMPTS[:4]) == [0, 1, 2, 3]


# -- the real `opencompass` command -----------------------------------------------------------


# The arms whose predictions are generated again alone: one per wrapper (MLXLMModel, Edge0Model).
ALONE = ("edge0-tiny-teacher", "edge0-tiny-int4-exact")


def test_opencompass_predictions_at_batch_size_4_equal_batch_size_1(tiny_run):
    """The shared `opencompass` run of the tiny config (conftest.tiny_run) decodes at its
    default batch_size 4; each prediction of one arm per wrapper is generated again alone by
    the model OpenCompass built from the run's own config (batch_size 1: one prompt per call)."""
    from mmengine.config import Config
    from opencompass.utils.build import build_model_from_cfg

    run = tiny_run
    (dumped,) = (run / "configs").glob("*.py")
    cfg = Config.fromfile(str(dumped))
    assert {m["abbr"] for m in cfg["models"]} >= set(ALONE)
    batched = 0
    for model_cfg in cfg["models"]:
        assert model_cfg["batch_size"] == 4
        if model_cfg["abbr"] not in ALONE:
            continue
        model = build_model_from_cfg(model_cfg)
        for dataset in TINY_DATASETS:
            preds = json.loads(
                (
                    run / "predictions" / model_cfg["abbr"] / f"{dataset}.json"
                ).read_text()
            )
            stats = json.loads(
                (
                    run
                    / "predictions"
                    / model_cfg["abbr"]
                    / f"{dataset}.engine_stats.json"
                ).read_text()
            )
            assert [s["index"] for s in stats] == list(range(len(preds)))
            assert [s["batch_size"] for s in stats] == [
                min(4, len(preds) - 4 * (i // 4)) for i in range(len(preds))
            ]
            batched += len(preds) > 1
            for key, item in preds.items():
                alone = model.generate(
                    [item["origin_prompt"]], max_out_len=model_cfg["max_out_len"]
                )
                assert alone == [item["prediction"]], (model_cfg["abbr"], dataset, key)
    assert batched >= 2  # datasets whose rows really shared a batch


def test_configs_set_batch_size_per_arm(tmp_path):
    code = (
        "import json\nfrom mmengine.config import Config\n"
        "out = {}\n"
        'for name in ("edge0_35b", "edge0_8b", "edge0_tiny", "edge0_testbed"):\n'
        f'    cfg = Config.fromfile({str(REPO / "configs")!r} + f"/{{name}}.py")\n'
        '    out[name] = {m["abbr"]: m["batch_size"] for m in cfg["models"]}\n'
        "print(json.dumps(out))\n"
    )
    env = offline_env(
        {
            k: "x"
            for k in (
                "EDGE0_35B_TEACHER",
                "EDGE0_35B_STUDENT",
                "EDGE0_8B_TEACHER",
                "EDGE0_8B_STUDENT",
                "EDGE0_TINY_TEACHER",
                "EDGE0_TINY_STUDENT",
                "EDGE0_TESTBED",
            )
        }
    )
    env.update(EDGE0_ARMS="teacher,student,int4_exact", EDGE0_TESTBED_BATCH="3")
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    sizes = json.loads(proc.stdout.strip().splitlines()[-1])
    assert sizes["edge0_35b"] == {
        "edge0-35b-teacher": 8,
        "edge0-35b-student": 8,
        "edge0-35b-int4-exact": 8,
    }
    assert set(sizes["edge0_8b"].values()) == {8}
    assert set(sizes["edge0_tiny"].values()) == {4}
    assert set(sizes["edge0_testbed"].values()) == {3}
    for variable in ("EDGE0_TINY_BATCH", "EDGE0_TESTBED_BATCH"):
        proc = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            env={**env, variable: "0"},
            timeout=300,
            cwd=tmp_path,
        )
        assert proc.returncode != 0
        assert f"{variable}='0' is not a whole number > 0" in proc.stderr


FILTERED = dict(temperature=1.0, top_p=0.95, top_k=5, min_p=0.05, seed=3)


def test_student_samples_with_top_k_and_min_p_as_the_teacher_arm(edge0_dir):
    """top_k and min_p on the student: every row equals its solo run, and each token is what
    the teacher arm's sampler (mlx-lm's filter chain on the row's own key) draws from the
    logits the engine produced it from."""
    from edge0_eval.engine.batch import row_sampler
    from edge0_eval.engine.engine import Engine
    from edge0_eval.engine.options import EngineOptions

    model = student(edge0_dir, FILTERED)
    batch, solo = batch_vs_solo(model)
    assert [t for t, _ in batch] == [t for t, _ in solo]
    engine = Engine.load(
        edge0_dir, EngineOptions(mode="reactive", no_lora=True, no_prerouter=True)
    )
    try:
        prompts = [model.encode_prompt(p) for p in PROMPTS[:3]]
        seeds = [row_seed(3, i) for i in prompts]
        trace: list = []
        rows = engine.generate_batch(
            prompts,
            12,
            temperature=1.0,
            top_p=0.95,
            top_k=5,
            min_p=0.05,
            seeds=seeds,
            stop_token_ids=set(),
            logits_trace=trace,
        )
        for row, seed, logits in zip(rows, seeds, trace):
            sample = row_sampler(seed, 1.0, top_p=0.95, min_p=0.05, top_k=5)
            want = [
                int(sample(lg - mx.logsumexp(lg, keepdims=True)).item())
                for lg in logits
            ]
            assert row.tokens == want
        unfiltered = engine.generate_batch(
            prompts, 12, temperature=1.0, top_p=0.95, seeds=seeds, stop_token_ids=set()
        )
        # the filters act
        assert [r.tokens for r in unfiltered] != [r.tokens for r in rows]
    finally:
        engine.close()
