"""Outputs whose thinking never closed: scored as an empty answer by default, OpenCompass's
pass-through on request; the inferencer keeps the prompt's thinking opener in the prediction so
the rule can see it; the report says which rule scored each dataset."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from edge0_eval.evaluation.outputs.thinking import (
    prompt_opener,
    rule_of,
    thinking_closed,
)

REPO = Path(__file__).resolve().parents[1]
CUT = "Let me see. Perhaps ANSWER: {gold} maybe, but wait"


def test_thinking_closed_and_the_prompt_opener():
    assert thinking_closed("<think>\nhmm</think>\nANSWER: A") is True
    assert thinking_closed("hmm</think> ANSWER: A") is True  # opener in the prompt
    assert thinking_closed("<think>\n" + CUT) is False
    assert thinking_closed("<think>a</think> b <think> c") is False
    assert thinking_closed("ANSWER: A") is None and thinking_closed(None) is None
    qwen = "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n<think>\n"
    assert prompt_opener(qwen) == "<think>\n"
    off = "<|im_start|>assistant\n<think>\n\n</think>\n\n"  # enable_thinking=False
    assert (
        prompt_opener(off) == ""
        and prompt_opener("user: what is <think>? assistant:") == ""
    )


def test_answer_text_rule_and_chain():
    pytest.importorskip("opencompass")
    from model_wrappers.evaluators.benchmark_evaluators import edge0_answer_text

    pattern = dict(
        type="opencompass.utils.text_postprocessors.match_answer_pattern",
        answer_pattern=r"(?i)ANSWER\s*:\s*([A-D])",
    )
    cut = "<think>\n" + CUT.format(gold="D")
    assert edge0_answer_text(cut) == "" and edge0_answer_text(cut, then=pattern) == ""
    # OpenCompass's behaviour
    assert edge0_answer_text(cut, "pass", then=pattern) == "D"
    closed = "<think>\nANSWER: B? no</think>\nANSWER: D"
    assert edge0_answer_text(closed, then=pattern) == "D"
    assert edge0_answer_text("ANSWER: C", then=pattern) == "C"
    with pytest.raises(ValueError, match="EDGE0_OPEN_THINKING"):
        edge0_answer_text(cut, "drop")
    assert (
        rule_of(
            {
                "pred_postprocessor": {
                    "type": "model_wrappers.evaluators.benchmark_evaluators.edge0_answer_text",
                    "open_thinking": "pass",
                }
            }
        )
        == "pass"
    )
    assert (
        rule_of(
            {
                "pred_postprocessor": {
                    "type": "model_wrappers.evaluators.benchmark_evaluators.edge0_answer_text"
                }
            }
        )
        == "empty"
    )
    assert rule_of({"evaluator": {"type": "x"}}) == "pass"  # no rule: OpenCompass's


def test_inferencer_keeps_the_prompts_thinking_opener(tmp_path):
    pytest.importorskip("opencompass")
    from model_wrappers.inferencers.inferencer import store_thinking_openers

    path = tmp_path / "GPQA_diamond.json"
    preds = {
        "0": {
            "origin_prompt": [{"role": "HUMAN", "prompt": "think"}],
            "prediction": CUT.format(gold="A"),
            "gold": "A",
        },
        "1": {
            "origin_prompt": [{"role": "HUMAN", "prompt": "plain"}],
            "prediction": "ANSWER: B",
            "gold": "B",
        },
    }
    path.write_text(json.dumps(preds))

    def chat_text(prompt):  # a thinking template for the first prompt only
        opener = (
            "<think>\n" if prompt[0]["prompt"] == "think" else "<think>\n\n</think>\n\n"
        )
        return f"<|im_start|>user\n{prompt[0]['prompt']}<|im_end|>\n<|im_start|>assistant\n{opener}"

    assert store_thinking_openers(str(path), chat_text) == 1
    stored = json.loads(path.read_text())
    assert stored["0"]["prediction"] == "<think>\n" + CUT.format(gold="A")
    assert stored["1"]["prediction"] == "ANSWER: B"
    assert thinking_closed(stored["0"]["prediction"]) is False


EVAL = """
import json, os, os.path as osp, sys
from mmengine.config import Config
from opencompass.tasks.openicl_eval import OpenICLEvalTask
from opencompass.utils import build_dataset_from_cfg

cfg = Config.fromfile(sys.argv[1])
os.makedirs("run/configs", exist_ok=True)
cfg.dump("run/configs/dumped.py")          # dumped and reloaded, as `opencompass` does
cfg = Config.fromfile("run/configs/dumped.py", format_python_code=False)
d = next(d for d in cfg.edge0_datasets if d.abbr == "GPQA_diamond")
golds = build_dataset_from_cfg(d).test["answer"]
preds = {str(i): {"origin_prompt": [{"role": "HUMAN", "prompt": "q"}], "gold": g,
                  "prediction": ("<think>\\n" + sys.argv[2].format(gold=g)) if i == 0 else
                                f"<think>\\nhmm</think>\\nANSWER: {g}"}
         for i, g in enumerate(golds)}
os.makedirs("run/predictions/m", exist_ok=True)
json.dump(preds, open("run/predictions/m/GPQA_diamond.json", "w"))
OpenICLEvalTask(Config(dict(models=[dict(abbr="m", type="x", path="x")], datasets=[[d]],
                            work_dir="run", eval=dict(runner=dict(task=dict(dump_details=True))))
                       )).run()
res = json.load(open("run/results/m/GPQA_diamond.json"))
print(json.dumps([x["correct"] for x in res["details"]]))
"""


@pytest.mark.parametrize("rule,first", [(None, False), ("pass", True)])
def test_an_output_cut_inside_think_scores_empty_by_default(rule, first, tmp_path):
    """The shipped bundle's GPQA scoring, through OpenCompass's own eval task: an output cut
    inside its thinking block whose text holds 'ANSWER: <gold>' is wrong unless the
    pass-through is asked for; a closed one is scored on its answer."""
    pytest.importorskip("opencompass")
    from edge0_eval.evaluation.data.fixtures import write_fixtures

    write_fixtures(tmp_path / "data_root", with_nltk=False)
    (tmp_path / "eval.py").write_text(EVAL)
    env = {
        **os.environ,
        "COMPASS_DATA_CACHE": str(tmp_path / "data_root"),
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    env.pop("EDGE0_OPEN_THINKING", None)
    if rule:
        env["EDGE0_OPEN_THINKING"] = rule
    proc = subprocess.run(
        [
            sys.executable,
            "eval.py",
            str(REPO / "configs" / "datasets" / "edge0_bundle.py"),
            CUT,
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    correct = json.loads(proc.stdout.strip().splitlines()[-1])
    assert correct[0] == [first] and all(c == [True] for c in correct[1:])


def test_a_bad_rule_stops_the_config(tmp_path):
    pytest.importorskip("opencompass")
    env = {
        **os.environ,
        "EDGE0_OPEN_THINKING": "drop",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "from mmengine.config import Config; "
            f"Config.fromfile({str(REPO / 'configs/datasets/edge0_bundle.py')!r})",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0 and "EDGE0_OPEN_THINKING='drop'" in proc.stderr
