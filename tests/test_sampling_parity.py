"""Both arms draw mlx-lm's sampler's tokens: filters and penalties, solo and batched.

The reference is mlx-lm itself: `make_logits_processors` on the row's prompt and the tokens
drawn so far, then `make_sampler`'s chain drawing from MLX's global stream seeded with the row's
seed (a row's key is `mx.random.key(seed)`, split once per token, which is what the global
stream does after `mx.random.seed(seed)`). Each arm's tokens are replayed from the logits the
model actually produced: the student's from `Engine.generate_batch`'s trace, the teacher's from a
recording logits processor placed ahead of mlx-lm's own. A fault injection shows the replay
sees a penalty that forgets the prompt.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.sample_utils import make_logits_processors, make_sampler

from edge0_eval.cli import main
from edge0_eval.demo import offline_env
from edge0_eval.engine import batch as batch_module
from edge0_eval.engine.batch import RowSampler, greedy_tokens, stop_token_ids
from edge0_eval.engine.inputs import penalties_of, row_seed
from model_wrappers.models.edge0_model import Edge0Model
from model_wrappers.models.mlx_lm_model import MLXLMModel

PROMPTS = [
    "What is 2 + 2?",
    "Tell me a long story about a dragon and a castle by the sea.",
    "Hi",
    "Explain gravity in simple words to a child of five, with an example.",
]
# The model card's thinking settings plus the other filter and penalty (tiny vocabulary: a
# short presence window so the prompt's tokens leave it while the row runs).
CARD = dict(temperature=1.0, top_p=0.95, top_k=20, presence_penalty=1.5, seed=3)
ALL = dict(
    CARD,
    min_p=0.02,
    repetition_penalty=1.3,
    presence_context_size=12,
    frequency_penalty=0.4,
)
N = 16


def mlx_lm_tokens(
    prompt: list[int], logits: list[mx.array], seed: int, gen: dict
) -> list[int]:
    """mlx-lm's draw, token by token, from the model's logits [V] of one row."""
    processors = make_logits_processors(**penalties_of(gen))
    mx.random.seed(seed)
    sampler = make_sampler(
        temp=gen["temperature"],
        top_p=gen.get("top_p", 0.0),
        min_p=gen.get("min_p", 0.0),
        top_k=gen.get("top_k", 0),
    )
    history, out = list(prompt), []
    for row in logits:
        x = row.reshape(1, -1)
        for processor in processors:
            x = processor(mx.array(history), x)
        x = x.reshape(-1)  # a row is drawn as a [V] vector (engine/batch.py says why)
        token = int(sampler(x - mx.logsumexp(x, keepdims=True)).item())
        out.append(token)
        history.append(token)
    return out


@pytest.fixture(scope="module")
def student_model(edge0_qwen):
    return Edge0Model(
        path=str(edge0_qwen),
        mode="reactive",
        no_lora=True,
        no_prerouter=True,
        experts_per_token=2,
        slots_per_layer=4,
        generation_kwargs=ALL,
    )


def student_rows(model, gen: dict, trace: list | None = None, seeds=None):
    prompts = [model.encode_prompt(p) for p in PROMPTS]
    seeds = seeds or [row_seed(gen["seed"], p) for p in prompts]
    rows = model.engine.generate_batch(
        prompts,
        N,
        temperature=gen["temperature"],
        top_p=gen.get("top_p", 1.0),
        top_k=gen.get("top_k", 0),
        min_p=gen.get("min_p", 0.0),
        penalties=penalties_of(gen),
        seeds=seeds,
        stop_token_ids=set(),
        logits_trace=trace,
        batch_size=3,
    )
    return prompts, seeds, [r.tokens for r in rows]


@pytest.mark.parametrize("gen", [CARD, ALL], ids=["card", "all"])
def test_student_draws_mlx_lm_tokens_solo_and_batched(student_model, gen):
    model = student_model
    trace: list = []
    prompts, seeds, batched = student_rows(model, gen, trace)
    for prompt, seed, tokens, logits in zip(prompts, seeds, batched, trace):
        assert tokens == mlx_lm_tokens(prompt, logits, seed, gen)
    sampling = dict(
        temperature=gen["temperature"],
        top_p=gen["top_p"],
        top_k=gen["top_k"],
        min_p=gen.get("min_p", 0.0),
        penalties=penalties_of(gen),
    )
    solo = [
        model.engine.generate(p, N, seed=s, stop_token_ids=set(), **sampling).tokens
        for p, s in zip(prompts, seeds)
    ]
    assert solo == batched
    # The penalties act: without them the same keys draw other tokens.
    plain = {k: v for k, v in gen.items() if k not in penalties_of(gen)}
    assert student_rows(model, plain, seeds=seeds)[2] != batched


def test_replay_sees_a_penalty_that_forgets_the_prompt(student_model, monkeypatch):
    model = student_model
    _, _, good = student_rows(model, ALL)

    def without_prompt(*args, prompt=(), **kwargs):
        return RowSampler(*args, **kwargs)

    monkeypatch.setattr(batch_module, "RowSampler", without_prompt)
    trace: list = []
    prompts, seeds, bad = student_rows(model, ALL, trace)
    assert bad != good
    assert any(
        t != mlx_lm_tokens(p, lg, s, ALL)
        for p, s, t, lg in zip(prompts, seeds, bad, trace)
    )


GREEDY = dict(temperature=0.0, seed=0)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_greedy_rows_drawn_together_are_each_samplers_draw(dtype):
    """`greedy_tokens` draws a batch's greedy rows at once as each row's sampler would
    alone. The last row is a near-tie that only the normalisation by the logsumexp makes a
    tie (in half precision): a draw that skipped it (argmax of the raw logits) differs."""
    logits = mx.random.normal((3, 4096), key=mx.random.key(1)) * 4
    tie = mx.zeros((1, 4096)).at[0, 5].add(1e-3)
    logits = mx.concatenate([logits, tie]).astype(dtype)
    samplers = [RowSampler(temperature=0.0, top_p=1.0, seed=j) for j in range(4)]
    assert all(s.greedy for s in samplers)
    alone = [s(logits[j]).item() for j, s in enumerate(samplers)]
    assert greedy_tokens(logits).tolist() == alone
    if dtype != mx.float32:
        assert mx.argmax(logits, axis=-1).tolist()[-1] != alone[-1]


def test_a_greedy_batch_is_drawn_at_once_and_as_mlx_lm_draws(
    student_model, monkeypatch
):
    """A batch of greedy rows is drawn by one `greedy_tokens` a step, its tokens mlx-lm's
    greedy draw of each row's logits; rows with penalties are drawn by their own samplers
    (as is every row of a step where any row has a key or penalties)."""
    calls = []

    def counted(logits):
        calls.append(logits.shape[0])
        return greedy_tokens(logits)

    monkeypatch.setattr(batch_module, "greedy_tokens", counted)
    trace: list = []
    prompts, seeds, tokens = student_rows(student_model, GREEDY, trace)
    assert calls and max(calls) > 1
    for prompt, seed, row, logits in zip(prompts, seeds, tokens, trace):
        assert row == mlx_lm_tokens(prompt, logits, seed, GREEDY)
    calls.clear()
    student_rows(student_model, dict(GREEDY, presence_penalty=1.5))
    assert not calls
    assert not RowSampler(
        temperature=0.0, top_p=1.0, seed=0, penalties={"presence_penalty": 1.5}
    ).greedy
    # Penalties that change nothing (as the served arm sends repetition 1) stay greedy.
    neutral = {
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0,
    }
    assert RowSampler(temperature=0.0, top_p=1.0, seed=0, penalties=neutral).greedy


class Recorder:
    """A logits processor ahead of the teacher's own: keeps each row's raw logits [V]."""

    def __init__(self):
        self.rows: list[list[mx.array]] = []

    def processors(self, real):
        seen: list[mx.array] = []
        self.rows.append(seen)

        def record(tokens, logits):
            # a new array: the penalties below write into `logits`
            seen.append(logits[0])
            return logits

        return [record, *real]


@pytest.mark.parametrize("gen", [CARD, ALL], ids=["card", "all"])
def test_teacher_draws_mlx_lm_tokens_solo_and_batched(tiny_qwen, monkeypatch, gen):
    model = MLXLMModel(path=str(tiny_qwen), generation_kwargs=gen)
    prompts = [model.encode_prompt(p) for p in PROMPTS]
    seeds = [row_seed(gen["seed"], p) for p in prompts]
    stops = stop_token_ids(model.tokenizer, [])
    real = MLXLMModel._processors
    for batch in (True, False):
        rec = Recorder()
        monkeypatch.setattr(
            MLXLMModel, "_processors", lambda self: rec.processors(real(self))
        )
        if batch:
            rows = model._generate_batch(prompts, N, stops, [], seeds)
        else:
            rows = [
                model._generate_batch([p], N, stops, [], [s])[0]
                for p, s in zip(prompts, seeds)
            ]
        assert len(rec.rows) == len(prompts)
        for prompt, seed, answer, logits in zip(prompts, seeds, rows, rec.rows):
            tokens = answer.output
            # mlx-lm may compute a step past a row's end; a drawn EOS ends it, not output.
            want = mlx_lm_tokens(prompt, logits, seed, gen)
            assert tokens == want[: len(tokens)]
            assert len(tokens) == N or want[len(tokens)] in stops
        if batch:
            batched = [a.output for a in rows]
        else:
            assert [a.output for a in rows] == batched
    monkeypatch.setattr(MLXLMModel, "_processors", real)
    plain = MLXLMModel(
        path=str(tiny_qwen),
        generation_kwargs={k: v for k, v in gen.items() if k not in penalties_of(gen)},
    )
    assert [a.output for a in plain._generate_batch(prompts, N, stops, [], seeds)] != (
        batched
    )


def _tier_sampling(tmp_path, sampling: str | None) -> dict:
    """Each tier config's generation_kwargs per arm (or its refusal) under EDGE0_SAMPLING."""
    configs = Path(__file__).resolve().parent.parent / "configs"
    code = (
        "import json\nfrom mmengine.config import Config\nout = {}\n"
        'for name in ("edge0_35b", "edge0_8b"):\n'
        "    try:\n"
        f'        cfg = Config.fromfile({str(configs)!r} + f"/{{name}}.py")\n'
        '        out[name] = {m["abbr"]: m["generation_kwargs"] for m in cfg["models"]}\n'
        "    except SystemExit as exc:\n"
        "        out[name] = str(exc)\n"
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
            )
        }
    )
    env.update(EDGE0_ARMS="teacher,student,int4_exact")
    env.pop("EDGE0_SAMPLING", None)
    if sampling is not None:
        env["EDGE0_SAMPLING"] = sampling
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_tier_configs_state_one_sampling_for_every_arm(tmp_path):
    default = _tier_sampling(tmp_path, None)
    for tier in ("edge0_35b", "edge0_8b"):
        assert (
            list(default[tier].values())
            == [dict(temperature=0.6, top_p=0.95, seed=0)] * 3
        )
    card = _tier_sampling(tmp_path, "card")
    assert (
        list(card["edge0_35b"].values())
        == [dict(temperature=1.0, top_p=0.95, top_k=20, presence_penalty=1.5, seed=0)]
        * 3
    )
    assert "EDGE0_SAMPLING='card' is not a sampling of the 8b tier" in card["edge0_8b"]
    assert (
        "choose from opencompass, card"
        in _tier_sampling(tmp_path, "vendor")["edge0_35b"]
    )


def test_generate_cli_samples_with_filters_and_penalties(edge0_qwen, tmp_path, capsys):
    """`generate`'s --top-k (sampling, as mlx-lm's: the routing width is
    --experts-per-token), --min-p and penalties."""

    def tokens(*argv) -> list[int]:
        out = tmp_path / "out.json"
        assert (
            main(
                [
                    "generate",
                    str(edge0_qwen),
                    "--prompt",
                    PROMPTS[1],
                    "--max-tokens",
                    "12",
                    "--json",
                    str(out),
                    *argv,
                ]
            )
            == 0
        )
        return json.loads(out.read_text())["tokens"]

    greedy = tokens("--temp", "0")
    assert tokens("--temp", "1", "--top-k", "1", "--seed", "5") == greedy
    sampled = tokens("--temp", "1", "--seed", "5")
    assert sampled != greedy  # so top-k 1 acted
    # A token of the prompt's tail that the row draws is penalized (greedy repeats none).
    assert tokens("--temp", "1", "--seed", "5", "--presence-penalty", "2") != sampled
    assert (
        tokens("--temp", "1", "--seed", "5", "--repetition-penalty", "1.0") == sampled
    )
    capsys.readouterr()
    for argv, name in (
        (["--min-p", "1"], "min_p"),
        (["--repetition-penalty", "0"], "--repetition-penalty"),
        (["--top-k", "-1"], "--top-k"),
        (["--presence-penalty", "3"], "presence_penalty must be a number in [-2, 2]"),
        (["--temp", "2.5"], "temperature must be a number in [0, 2]"),
    ):
        try:
            rc = main(["generate", str(edge0_qwen), "--prompt", "x", *argv])
        except SystemExit as exc:  # argparse
            rc = exc.code
        err = capsys.readouterr().err
        assert rc == 2 and name in err and "Traceback" not in err, err
