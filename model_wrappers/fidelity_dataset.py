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

from edge0_eval.errors import ConfigError
from edge0_eval.evaluation.data_paths import data_root
from edge0_eval.evaluation.fidelity_set import DATASET_ABBR, SET_PATH, read_set


def set_file(path: str | None = None) -> Path:
    """The set a dataset config reads: `path` relative to the data root ($COMPASS_DATA_CACHE)
    unless absolute; default the place `edge0-eval data stage --fidelity FILE` lays it."""
    file = Path(path or SET_PATH)
    return file if file.is_absolute() else data_root() / file


def preflight_problems(datasets) -> list[str]:
    """What is wrong with the sets of the fidelity datasets among `datasets` (before any task)."""
    problems = []
    for d in datasets:
        if str(d.get('abbr', '')).startswith(DATASET_ABBR):
            try:
                read_set(set_file(d.get('path')))
            except ConfigError as exc:
                problems.append(str(exc))
    return problems


@LOAD_DATASET.register_module()
class FidelityDataset(BaseDataset):

    @staticmethod
    def load(path: str | None = None, limit: int | None = None):
        """path: see set_file."""
        fset = read_set(set_file(path))
        items = fset['items'][:limit]
        return Dataset.from_list([{'id': it['id'], 'source': it['source'],
                                   'prompt': it.get('prompt', ''), 'item': json.dumps(it)}
                                  for it in items])
