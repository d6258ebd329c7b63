"""A fidelity set's header around the tests' own items (evaluation/fidelity/sets.py's format)."""

from __future__ import annotations

from edge0_eval.evaluation.fidelity.sets import FORMAT


def fidelity_set(
    items: list[dict],
    *,
    fingerprint: str = "0" * 64,
    dtype: str | None = "float32",
    max_new: int = 8,
    min_new: int = 2,
) -> dict:
    """A set of `items` from teacher "t" (`dtype` None: a set that records none)."""
    teacher = {"name": "t", "fingerprint": fingerprint}
    if dtype is not None:
        teacher["dtype"] = dtype
    return {
        "format": FORMAT,
        "teacher": teacher,
        "max_new": max_new,
        "min_new": min_new,
        "top_k": 2,
        "thinking": False,
        "thinking_in_template": False,
        "left_out": {"shorter_than_min_new": []},
        "sources": {"text": {}},
        "items": items,
    }
