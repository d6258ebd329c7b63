"""OpenCompass loader for the agreement set (edge0_eval/evaluation/agreement.py): one row per
prompt line, its reference the teacher's greedy answer. A missing or malformed set is one clear
error naming the file and how to make it."""

from __future__ import annotations

from pathlib import Path

from datasets import Dataset
from opencompass.datasets.base import BaseDataset
from opencompass.registry import LOAD_DATASET

from edge0_eval.evaluation.agreement import SET_PATH, read_set
from edge0_eval.evaluation.data_paths import data_root


@LOAD_DATASET.register_module()
class AgreementDataset(BaseDataset):
    @staticmethod
    def load(path: str | None = None):
        """path: relative to the data root ($COMPASS_DATA_CACHE) unless absolute."""
        file = Path(path or SET_PATH)
        _, rows = read_set(file if file.is_absolute() else data_root() / file)
        return Dataset.from_list(rows)
