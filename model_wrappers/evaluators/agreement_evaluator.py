"""Evaluator for the agreement set: an item passes when the arm's answer is exactly the
teacher's greedy answer (edge0_eval/evaluation/agreement.py)."""

from __future__ import annotations

from opencompass.openicl.icl_evaluator import BaseEvaluator
from opencompass.registry import ICL_EVALUATORS

from edge0_eval.evaluation.agreement import agrees


@ICL_EVALUATORS.register_module()
class AgreementEvaluator(BaseEvaluator):
    def score(self, predictions, references):
        if len(predictions) != len(references):
            return {"error": "preds and refrs have different length"}
        details = [
            {"pred": pred, "answer": ref, "correct": agrees(pred, ref)}
            for pred, ref in zip(predictions, references)
        ]
        return {
            "accuracy": 100.0
            * sum(d["correct"] for d in details)
            / max(len(details), 1),
            "details": details,
        }
