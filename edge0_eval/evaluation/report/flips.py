"""Flips: the items an arm scores differently from the teacher, not only by how much (equal
accuracy can hide many: Dutta et al. 2024). Per benchmark and non-teacher arm, paired on the
teacher's items, d = arm - teacher of an item's score in [0, 1]: right_to_wrong d <= -FLIP_SIZE,
wrong_to_right d >= FLIP_SIZE, the flip rate with its Wilson interval, net = mean d in points
(the delta). docs/gate.md defines each; the page shows PAGE_ITEMS flipped items' texts."""

from __future__ import annotations

import math

from edge0_eval.evaluation.outputs.predictions import load_predictions
from edge0_eval.evaluation.outputs.samples import Z95

FLIP_SIZE = 0.5  # a per-item score change this large (of 1) counts as a flip
PAGE_ITEMS = 50  # flipped items per benchmark and arm whose texts the report keeps
TEXT_CHARS = 4000  # of a question or an answer kept for the page


def wilson(k: int, n: int) -> list[float]:
    """The 95% Wilson score interval of k successes in n, in %."""
    p, z2 = k / n, Z95 * Z95
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = Z95 * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return [100 * max(0.0, centre - half), 100 * min(1.0, centre + half)]


def count(teacher: dict[str, float], arm: dict[str, float]) -> dict:
    """The flips of `arm` against `teacher` (item id -> score in [0, 1], the same ids)."""
    ids = sorted(teacher)
    d = {i: arm[i] - teacher[i] for i in ids}
    down = [i for i in ids if d[i] <= -FLIP_SIZE]
    up = [i for i in ids if d[i] >= FLIP_SIZE]
    return {
        "items": len(ids),
        "right_to_wrong": len(down),
        "wrong_to_right": len(up),
        "flip_rate": 100 * (len(down) + len(up)) / len(ids),
        "flip_rate_ci95": wilson(len(down) + len(up), len(ids)),
        "net": 100 * sum(d.values()) / len(ids),
        "right_to_wrong_ids": down,
        "wrong_to_right_ids": up,
    }


def _text(value) -> str:
    """A prompt or answer as text: chat turns joined, cut to TEXT_CHARS."""
    if isinstance(value, list):
        value = "\n\n".join(
            str(t.get("prompt", t)) if isinstance(t, dict) else str(t) for t in value
        )
    text = "" if value is None else str(value)
    return text if len(text) <= TEXT_CHARS else text[:TEXT_CHARS] + " [...]"


def _prediction(run, abbr: str, item: str, datasets: list[str], cache: dict):
    """The first sample's prediction record of `item` (`dataset/k` when pooled)."""
    dataset, _, k = item.rpartition("/")
    dataset = dataset or datasets[0]
    key = (str(run.path), abbr, dataset)  # arms may share an abbr across runs
    if key not in cache:
        folder = run.path / "predictions" / abbr
        cache[key] = load_predictions(folder, dataset) if folder.is_dir() else None
    preds = cache[key]
    return preds[int(k)] if preds and k.isdigit() and int(k) < len(preds) else None


def add_flips(row: dict, per_arm: dict, runs: dict) -> None:
    """row["flips"]: per non-teacher arm scored on the teacher's items, its flips and the
    texts of its flipped items (per_arm: arm -> ArmBench; runs: arm -> (abbr, run))."""
    teacher = per_arm["teacher"]
    row["flips"], cache = {}, {}
    for arm, ab in per_arm.items():
        if (
            arm == "teacher"
            or ab.status != "ok"
            or set(ab.scores) != set(teacher.scores)
        ):
            continue
        flips = row["flips"][arm] = count(teacher.scores, ab.scores)
        shown = (flips["right_to_wrong_ids"] + flips["wrong_to_right_ids"])[:PAGE_ITEMS]
        flips["texts"] = {}
        for item in shown:
            t_pred, a_pred = (
                _prediction(runs[a][1], runs[a][0], item, per_arm[a].datasets, cache)
                or {}
                for a in ("teacher", arm)
            )
            flips["texts"][item] = {
                "question": _text(t_pred.get("origin_prompt")),
                "teacher": _text(t_pred.get("prediction")),
                "arm": _text(a_pred.get("prediction")),
                "scores": [teacher.scores[item], ab.scores[item]],
            }
