"""Inferencer for the fidelity dataset: each arm's teacher-forced log-probs, not generations.

It hands the rows' items (prompt ids, tokens, top-k ids and the set's scorer), ITEMS_PER_CALL
at a time, to the model's `fidelity_logprobs` (MLXLMModel and Edge0Model have one: their served
path, the items scored together layer by layer, evaluation/fidelity/scoring.py) and writes
each result as its row's prediction (JSON), in OpenCompass's predictions file, plus the
per-item stats side file the other datasets have (predictions/<model>/<dataset>.engine_stats.json;
a call's items share its wall time as batch_wall_s, with batch_size, as the planner reads
batched calls).
"""

from __future__ import annotations

import json
import os
import time
from typing import Optional

from opencompass.openicl.icl_inferencer.icl_base_inferencer import BaseInferencer
from opencompass.registry import ICL_INFERENCERS
from opencompass.utils.logging import get_logger

from edge0_eval.errors import ConfigError
from edge0_eval.evaluation.fidelity.sets import item_digest
from edge0_eval.evaluation.plan.progress import Progress

from ..datasets.fidelity_dataset import teacher_problem
from .inferencer import stats_path

# Items one call scores together: the scorer splits them further by its memory bound; the
# progress and ETA move a call at a time.
ITEMS_PER_CALL = 64


@ICL_INFERENCERS.register_module()
class FidelityInferencer(BaseInferencer):
    def __init__(
        self,
        model,
        max_out_len=None,
        min_out_len=None,
        progress: Optional[dict] = None,
        **kwargs,
    ):
        # max/min_out_len come from the model config for every dataset; the set fixes the length.
        # progress: the arm's progress spec (edge0_eval/evaluation/plan/progress.py), set by the
        # project's partitioners: a long set moves the arm's progress and ETA a call at a time.
        super().__init__(model=model, **kwargs)
        self.progress = progress

    def inference(
        self,
        retriever,
        ice_template=None,
        prompt_template=None,
        output_json_filepath=None,
        output_json_filename=None,
    ):
        out_dir = output_json_filepath or self.output_json_filepath
        out_file = output_json_filename or self.output_json_filename
        score = getattr(self.model, "fidelity_logprobs", None)
        if score is None:
            raise ConfigError(
                f"{type(self.model).__name__} has no fidelity_logprobs; the "
                f"fidelity dataset runs on MLXLMModel and Edge0Model arms"
            )
        _check_teacher(self.model, retriever.test_ds)
        preds, stats = {}, []
        progress = (
            Progress(self.progress, get_logger().info)
            if self.progress and self.is_main_process
            else None
        )
        rows = list(retriever.test_ds)
        for start in range(0, len(rows), ITEMS_PER_CALL):
            call = rows[start : start + ITEMS_PER_CALL]
            items = [json.loads(row["item"]) for row in call]
            began = time.perf_counter()
            outs = score(items)
            wall = time.perf_counter() - began
            for index, row, item, out in zip(
                range(start, start + len(call)), call, items, outs
            ):
                out["item"] = item_digest(item)
                preds[str(index)] = {
                    "origin_prompt": row["prompt"],
                    "prediction": json.dumps(out),
                    "gold": item["id"],
                }
                stats.append(
                    {
                        "index": index,
                        "arm": getattr(self.model, "arm", None),
                        "prompt_tokens": len(item["prompt_ids"]),
                        "tokens": len(item["tokens"]),
                        "scorer": item.get("scorer"),
                        "batch_size": len(call),
                        "batch_wall_s": round(wall, 4),
                        "wall_s": round(wall, 4),
                        # The call's rate: its items' tokens over its time.
                        "tok_s": round(sum(len(i["tokens"]) for i in items) / wall, 2)
                        if wall > 0
                        else None,
                    }
                )
            if progress is not None:
                progress.add(len(call))
        if self.is_main_process:
            os.makedirs(out_dir, exist_ok=True)
            with open(os.path.join(out_dir, out_file), "w", encoding="utf-8") as f:
                json.dump(preds, f, indent=1)
            with open(stats_path(out_dir, out_file), "w", encoding="utf-8") as f:
                json.dump(stats, f, indent=1)
        return [p["prediction"] for p in preds.values()]


def _check_teacher(model, rows) -> None:
    """A teacher arm (an mlx-lm checkpoint: no engine options) scores only a set made from it,
    checked here as well as at the preflight: a set staged since, or a run partitioned without
    Edge0Partitioner, is refused before its first item, not scored against another teacher."""
    path = getattr(model, "path", None)
    if getattr(model, "engine_options", None) is not None or not (
        isinstance(path, str) and os.path.isdir(path)
    ):
        return
    for made_by in {row["teacher"] for row in rows}:
        problem = teacher_problem(json.loads(made_by), path)
        if problem:
            raise ConfigError(f"the fidelity set of this task {problem}")
