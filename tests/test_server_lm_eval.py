"""lm-evaluation-harness (`lm_eval`, from PyPI) scores a tiny student through `edge0-eval serve`,
offline: a multiple-choice task by log-likelihood (`local-completions`: echo + logprobs over
lists of prompts) and a `generate_until` task (`local-chat-completions`), each from a jsonl this
test writes. Its per-sample log-likelihoods equal the engine's own teacher-forced scores of
the same tokens, and its answers and accuracies the ones this test computes with the engine.
About 30 s on a 2-core machine (two `lm_eval` processes: imports are most of it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import lm_eval  # noqa: F401 - the test extra (pip install -e '.[test]'): fail, not skip
import pytest
from live_server import LiveServer

from edge0_eval import Engine, EngineOptions
from edge0_eval.engine.inputs import chat_ids
from edge0_eval.evaluation.fidelity.scoring import EngineRunner, forced_logprobs

NAME = "tiny"
# (context, choices, gold): lm-eval scores " " + choice after the context (its default
# target_delimiter), so contexts end without a space and choices start without one.
QUESTIONS = [
    ("Disks hold", ["experts", "tokens", "layers"], 0),
    ("A batch decodes", ["rows", "disks"], 1),
    ("The prerouter predicts", ["experts", "answers", "caches", "slots"], 2),
    ("Stream the", ["tokens", "layers"], 0),
]
GENERATE = ["Name a disk.", "Say hello.", "Count to three."]
MC_TASK = """task: edge0_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: gold
metric_list:
  - metric: acc
"""
GEN_TASK = """task: edge0_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
"""


@pytest.fixture(scope="module")
def served(edge0_qwen):
    server = LiveServer(
        edge0_qwen, EngineOptions(mode="reactive"), name=NAME, max_tokens=8
    )
    solo = Engine.load(edge0_qwen, EngineOptions(mode="reactive"))
    yield server, solo
    server.close()
    solo.close()


def _lm_eval(tmp: Path, model: str, task: str, model_args: str, *more: str) -> dict:
    """`lm_eval` offline against the server: its per-sample records of `task`."""
    env = dict(
        os.environ,
        HF_DATASETS_OFFLINE="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_DATASETS_CACHE=str(tmp / "hf"),
        OPENAI_API_KEY="none",
    )
    out = tmp / "out"
    cmd = [sys.executable, "-m", "lm_eval", "--model", model, "--tasks", task]
    cmd += ["--include_path", str(tmp), "--model_args", model_args, *more]
    cmd += ["--output_path", str(out), "--log_samples"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    samples = sorted(out.rglob(f"samples_{task}_*.jsonl"))
    results = sorted(out.rglob("results_*.json"))
    return dict(
        samples=[json.loads(line) for line in samples[-1].read_text().splitlines()],
        results=json.loads(results[-1].read_text())["results"][task],
    )


def _loglikelihood(engine, context: str, continuation: str) -> float:
    """The engine's teacher-forced log-likelihood of the continuation's tokens after the
    context's, the whole scored from its first token (as an echoed prompt is)."""
    tok = engine.tokenizer
    ctx, whole = tok.encode(context), tok.encode(context + continuation)
    assert whole[: len(ctx)] == ctx
    lp = list(forced_logprobs(EngineRunner(engine), whole[:1], whole[1:]))
    return sum(float(lp[i - 1][whole[i]]) for i in range(len(ctx), len(whole)))


def test_lm_eval_scores_a_multiple_choice_task_by_log_likelihood(
    served, edge0_qwen, tmp_path
):
    server, engine = served
    data = tmp_path / "mc.jsonl"
    data.write_text(
        "".join(
            json.dumps(dict(context=c, choices=ch, gold=g)) + "\n"
            for c, ch, g in QUESTIONS
        )
    )
    (tmp_path / "mc.yaml").write_text(MC_TASK.format(data=data))
    args = (
        f"model={NAME},base_url={server.base}/completions,tokenizer_backend="
        f"huggingface,tokenizer={edge0_qwen},num_concurrent=1,max_retries=1"
    )
    run = _lm_eval(tmp_path, "local-completions", "edge0_mc", args, "--batch_size", "4")
    right = 0
    for sample in sorted(run["samples"], key=lambda s: s["doc_id"]):
        context, choices, gold = QUESTIONS[sample["doc_id"]]
        ours = [_loglikelihood(engine, context, " " + c) for c in choices]
        theirs = [float(r[0][0]) for r in sample["resps"]]
        assert theirs == ours  # the same float32 log-probs, summed in the same order
        right += int(max(range(len(ours)), key=ours.__getitem__) == gold)
    assert len(run["samples"]) == len(QUESTIONS)
    assert run["results"]["acc,none"] == pytest.approx(right / len(QUESTIONS))


def test_lm_eval_generates_through_chat_completions(served, tmp_path):
    server, engine = served
    data = tmp_path / "gen.jsonl"
    answers = []
    for q in GENERATE:
        ids = chat_ids(engine.tokenizer, [{"role": "user", "content": q}], {})
        answers.append(engine.generate(ids, 8, stop_words=["\n"]).text)
    # the first question's gold is the engine's answer: exact_match 1/3 at least
    golds = [answers[0], "-", "-"]
    data.write_text(
        "".join(
            json.dumps(dict(question=q, answer=a)) + "\n"
            for q, a in zip(GENERATE, golds)
        )
    )
    (tmp_path / "gen.yaml").write_text(GEN_TASK.format(data=data))
    args = f"model={NAME},base_url={server.base}/chat/completions,num_concurrent=1"
    run = _lm_eval(
        tmp_path,
        "local-chat-completions",
        "edge0_gen",
        args,
        "--apply_chat_template",
    )
    got = {s["doc_id"]: s["resps"][0][0] for s in run["samples"]}
    assert [got[i] for i in range(len(GENERATE))] == answers
    right = sum(a == g for a, g in zip(answers, golds))
    assert run["results"]["exact_match,none"] == pytest.approx(right / len(GENERATE))
