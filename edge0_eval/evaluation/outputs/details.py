"""Per-item, per-sample verdicts from a results file's `details`, whatever evaluator wrote them.

OpenCompass 0.5.4's BaseEvaluator regroups an evaluator's details per example
({"example_abbr": "<abbr>_<idx>", key: [value per replica]}); evaluators that return no details
(AccEvaluator) get OpenICLEvalTask.format_details ({"type": "GEN", "0": {...}, ...}: one entry
per prediction, holding the processed prediction and reference).
"""

from __future__ import annotations

import math
import re


def _replicas(value) -> list:
    # OpenCompass 0.5.4 regroups details per example and lists each key over the n replicas;
    # older trees (and format_details) hold plain values.
    return value if isinstance(value, list) else [value]


def _verdicts(values) -> list[float] | None:
    """Per-replica verdicts in [0, 1]; None (not scorable) for empty, non-numeric or NaN ones."""
    try:
        values = [float(v) for v in values]
    except (TypeError, ValueError):
        return None
    if not values or not all(math.isfinite(v) and 0.0 <= v <= 1.0 for v in values):
        return None
    return values


def replica_scores(detail: dict, key: str | None = None) -> list[float] | None:
    """Each sample's correctness in [0, 1] from one `details` entry, whatever evaluator wrote
    it (one value per replica of the item)."""
    if key is not None:
        return _verdicts(_replicas(detail[key])) if key in detail else None
    # CascadeEvaluator: cascade_correct when the LLM judge ran, else the rule verdict.
    # HumanEval/IFBench/AccwithDetails: is_correct. GPQA/MATHVerify/PPL: correct.
    for k in ("cascade_correct", "is_correct", "correct"):
        if k in detail:
            return _verdicts(_replicas(detail[k]))
    if "rule_evaluation" in detail:
        return _verdicts(
            r.get("correct", False) if isinstance(r, dict) else None
            for r in _replicas(detail["rule_evaluation"])
        )
    # AccEvaluator gives no details; OpenCompass's format_details then stores the processed
    # prediction and reference as strings, and AccEvaluator's verdict is their equality.
    if "predictions" in detail and "references" in detail:
        return [float(str(detail["predictions"]) == str(detail["references"]))]
    return None


def item_correctness(detail: dict, key: str | None = None) -> float | None:
    """Per-item correctness in [0, 1]: the mean over the item's samples."""
    scores = replica_scores(detail, key)
    return None if scores is None else sum(scores) / len(scores)


def detail_items(details, n: int) -> list[tuple[str, list[dict]]]:
    """(item id, [detail]) pairs in the dataset's order; the id is the example index within
    the dataset. A regrouped entry (list form) holds its n replicas itself; format_details
    (dict form) has one entry per prediction, so with n > 1 entry r * N + k is replica r of
    item k."""
    if isinstance(details, dict):  # format_details: {"type": "GEN", "0": {...}, ...}
        pairs = [
            (k, v) for k, v in details.items() if k != "type" and isinstance(v, dict)
        ]
        pairs.sort(key=lambda kv: int(kv[0]) if kv[0].isdigit() else kv[0])
        if n > 1 and len(pairs) % n == 0:
            size = len(pairs) // n
            return [
                (pairs[k][0], [pairs[r * size + k][1] for r in range(n)])
                for k in range(size)
            ]
        return [(k, [v]) for k, v in pairs]
    out = []
    for pos, detail in enumerate(details):
        m = re.search(r"_(\d+)$", str(detail.get("example_abbr", "")))
        out.append((m[1] if m else str(pos), [detail]))
    return out
