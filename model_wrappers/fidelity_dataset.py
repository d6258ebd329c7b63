"""OpenCompass loader for a fidelity set (edge0_eval/evaluation/fidelity.py): one row per prompt.

Each row holds the prompt text (`prompt`, for the predictions file) and the whole teacher item as
JSON (`item`): the inferencer forces its tokens through the arm and the evaluator compares the
arm's log-probs with the teacher's. The set is validated on load (a bad or missing file is one
clear error naming it and how to make one).
"""

from __future__ import annotations

import json
from pathlib import Path

from datasets import Dataset
from opencompass.datasets.base import BaseDataset
from opencompass.registry import LOAD_DATASET

from edge0_eval.evaluation.data import data_root
from edge0_eval.evaluation.fidelity_set import SET_PATH, read_set


@LOAD_DATASET.register_module()
class FidelityDataset(BaseDataset):

    @staticmethod
    def load(path: str | None = None, limit: int | None = None):
        """path: the set, relative to the data root ($COMPASS_DATA_CACHE) unless absolute
        (default: the place `edge0-eval data stage --fidelity FILE` lays it)."""
        file = Path(path or SET_PATH)
        if not file.is_absolute():
            file = data_root() / file
        fset = read_set(file)
        items = fset['items'][:limit]
        return Dataset.from_list([{'id': it['id'], 'source': it['source'],
                                   'prompt': it.get('prompt', ''), 'item': json.dumps(it)}
                                  for it in items])
