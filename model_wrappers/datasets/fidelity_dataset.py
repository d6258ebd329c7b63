"""OpenCompass loader for a fidelity set (edge0_eval/evaluation/fidelity/scoring.py): one row
per prompt.

Each row holds the prompt text (`prompt`, for the predictions file) and the whole teacher item as
JSON (`item`): the inferencer forces its tokens through the arm and the evaluator compares the
arm's log-probs with the teacher's. The set is validated on load (a bad or missing file is one
clear error naming it and how to make one).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from datasets import Dataset
from opencompass.datasets.base import BaseDataset
from opencompass.registry import LOAD_DATASET

from edge0_eval.engine.mlx_compat import activation_dtype
from edge0_eval.errors import ConfigError, Edge0Error
from edge0_eval.evaluation.data_paths import data_root
from edge0_eval.evaluation.fidelity.sets import (
    DATASET_ABBR,
    SET_PATH,
    fingerprint,
    read_set,
    scorer_of,
    vocab_problem,
)


def set_file(path: str | None = None) -> Path:
    """The set a dataset config reads: `path` relative to the data root ($COMPASS_DATA_CACHE)
    unless absolute; default the place `edge0-eval data stage --fidelity FILE` lays it."""
    file = Path(path or SET_PATH)
    return file if file.is_absolute() else data_root() / file


def _vocab_size(model_dir: str) -> int | None:
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
        size = cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")
    except (OSError, ValueError, AttributeError):
        return None  # the model checks name an unreadable config
    return size if isinstance(size, int) and not isinstance(size, bool) else None


def preflight_problems(datasets, arms=()) -> list[str]:
    """What is wrong with the sets of the fidelity datasets among `datasets` (before any task):
    the file itself, token ids beyond an arm's vocabulary, and a set made from another teacher
    than the run's, which would score every arm against the wrong model.

    arms: (name, model directory, is the teacher, compute_dtype) per arm of the run."""
    problems = []
    for d in datasets:
        if not str(d.get("abbr", "")).startswith(DATASET_ABBR):
            continue
        file = set_file(d.get("path"))
        try:
            fset = read_set(file)
        except ConfigError as exc:
            problems.append(str(exc))
            continue
        for name, path, is_teacher, compute_dtype in arms:
            size = _vocab_size(path)
            problem = vocab_problem(fset, size) if size else None
            if problem:
                problems.append(
                    f"fidelity set {file}: {problem} (arm {name}, {path}); make the "
                    f"set from this run's teacher with `edge0-eval fidelity make`"
                )
            other = (
                teacher_problem(fset["teacher"], path)
                if is_teacher and os.path.isdir(path)
                else None
            )
            if other:
                problems.append(f"fidelity set {file} {other}")
            elif is_teacher and os.path.isdir(path):
                problems += _dtype_problem(file, fset["teacher"], path, compute_dtype)
    return problems


def teacher_problem(made_by: dict, path: str) -> str | None:
    """Why a set whose `teacher` entry is `made_by` was not made from the teacher checkpoint at
    `path` (None: it was): scored against another model than the one it records."""
    if fingerprint(path) == made_by.get("fingerprint"):
        return None
    return (
        f"was made from teacher {made_by.get('name')!r} (fingerprint "
        f"{str(made_by.get('fingerprint'))[:12]}), not this run's teacher {path} (their "
        f"fingerprints differ); make it again with `edge0-eval fidelity make {path} --out "
        f"FILE` and stage it"
    )


def _dtype_problem(
    file: Path, teacher: dict, path: str, compute_dtype: str
) -> list[str]:
    """The set's teacher ran in another dtype than this run's teacher arm will (a set made on
    Metal in bfloat16, scored on the CPU in float32): the teacher would fail its own set's exact
    check after the whole run, and every arm's KL would hold the dtype's rounding."""
    made_in = teacher.get("dtype")  # absent in sets made before it was recorded
    try:
        runs_in = activation_dtype(compute_dtype, path)
    except (ValueError, Edge0Error):
        return []  # the model checks name a bad dtype or checkpoint
    if made_in is None or runs_in is None or made_in == runs_in:
        return []
    return [
        f"fidelity set {file} was made with its teacher computing in {made_in}, but this "
        f"run's teacher arm {path} computes in {runs_in} (compute_dtype "
        f"{compute_dtype!r} on this device), so it cannot reproduce its own set; give the "
        f"teacher arm compute_dtype='{made_in}' or make the set on this machine with "
        f"`edge0-eval fidelity make {path} --compute-dtype {compute_dtype} --out FILE`"
    ]


@LOAD_DATASET.register_module()
class FidelityDataset(BaseDataset):
    @staticmethod
    def load(path: str | None = None, limit: int | None = None):
        """path: see set_file."""
        fset = read_set(set_file(path))
        items = fset["items"][:limit]
        # Each item carries the set's scorer: every arm is scored by the one that made it.
        scorer = scorer_of(fset)
        return Dataset.from_list(
            [
                {
                    "id": it["id"],
                    "source": it["source"],
                    "prompt": it.get("prompt", ""),
                    "item": json.dumps(dict(it, scorer=scorer)),
                    # The inferencer compares it with a teacher arm's own (teacher_problem).
                    "teacher": json.dumps(fset["teacher"]),
                }
                for it in items
            ]
        )
