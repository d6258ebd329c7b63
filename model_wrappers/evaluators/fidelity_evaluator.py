"""Evaluator for the fidelity dataset: an arm's log-probs against the teacher's, per item.

Metrics (edge0_eval/evaluation/fidelity/scoring.py): kl (nats, KL(teacher || arm) over the
top-k plus a tail bucket), agreement (share of positions whose argmax is the teacher's token),
nll (of the teacher's tokens), greedy_match (positions before the first disagreement); each per
item in `details` (with the item's id and source) and averaged over items.
"""

from __future__ import annotations

import json

from opencompass.openicl.icl_evaluator import BaseEvaluator
from opencompass.registry import ICL_EVALUATORS

from edge0_eval.evaluation.fidelity.sets import item_digest, mean_metrics, score_item


@ICL_EVALUATORS.register_module()
class FidelityEvaluator(BaseEvaluator):
    def score(self, predictions, references):
        if len(predictions) != len(references):
            return {"error": "preds and refrs have different length"}
        details = []
        for pred, ref in zip(predictions, references):
            item, out = json.loads(ref), json.loads(pred)
            # Predictions pair with the set by position; the digest says it is the same item
            # (predictions made before it was recorded carry none).
            if "item" in out and out["item"] != item_digest(item):
                return {
                    "error": f"the prediction for set item {item['id']} was made on another "
                    f"item (another fidelity set staged since?); delete this "
                    f"dataset's predictions and run it again"
                }
            details.append(
                {
                    "id": item["id"],
                    "source": item["source"],
                    **score_item(item, out["logprobs"], out["argmax"]),
                }
            )
        return {**mean_metrics(details), "items": len(details), "details": details}
