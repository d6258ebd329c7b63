"""Per-sample records, and what the report computes from them.

OpenCompass's dataset `n` concatenates the dataset n times (opencompass/datasets/base.py: each
row keeps its `idx`), and its BaseEvaluator groups the n replications of a row into one
details entry whose keys list a value per replica. So with N items, prediction (and engine
stats entry) r * N + k is sample r of the k-th details entry. Each sample's record:
  score            the evaluator's verdict on that sample, in [0, 1]
  finish_reason    eos | stop_token | stop_word | length (engine stats; None without them)
  thinking_closed  True, False (a `<think>` block never closed) or None (no thinking block)
  output_tokens    tokens generated (engine stats)

Definitions, with n samples per item (n = 1: one sample):
  avg@n     the mean over items of each item's mean over its samples (the headline)
  pass@k    where the benchmark defines it (HumanEval): per item the unbiased estimator
            1 - C(n - c, k) / C(n, k) of c correct among n (Chen et al. 2021), then the mean
Intervals are clustered by item: an item's samples share its difficulty, so the unit is the
item (its mean over samples), never the n x items samples as if independent. Their quantile is
Student's t with items - 1 degrees of freedom (t95): at 14 items the normal 1.96 covered 92%.
"""

from __future__ import annotations

import math

from scipy import stats

from edge0_eval.evaluation.significance.paired import graded_change

Z95 = 1.96  # the normal quantile, for intervals over thousands of values (positions)
FLAG_ALPHA = 0.05  # two-sided, for the truncation flag
RECORD_KEYS = ("score", "finish_reason", "thinking_closed", "output_tokens")


def record(
    score: float | None, pred: dict | None, stats: dict | None, thinking_closed
) -> dict:
    tokens = (stats or {}).get("tokens")
    return {
        "score": score,
        "finish_reason": (stats or {}).get("finish_reason"),
        "thinking_closed": thinking_closed(pred.get("prediction")) if pred else None,
        "output_tokens": int(tokens)
        if isinstance(tokens, (int, float)) and not isinstance(tokens, bool)
        else None,
    }


def samples_per_item(samples: dict[str, list[dict]]) -> int | None:
    """n when every item has n samples; None when they differ (or there are none)."""
    counts = {len(rs) for rs in samples.values()}
    return counts.pop() if len(counts) == 1 else None


def t95(df: float) -> float:
    """The two-sided 95% quantile of Student's t with df degrees of freedom."""
    return float(stats.t.ppf(0.975, df))


def mean_half_width(values: list[float]) -> tuple[float, float | None]:
    """(mean, 95% half-width) of per-item values: t with n - 1 degrees of freedom."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, None
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, t95(n - 1) * math.sqrt(var / n)


def pass_at_k(
    samples: dict[str, list[dict]], ks: tuple[int, ...] | None = None
) -> dict:
    """{"pass@k": {"score", "half_width"}} in points, per k <= n (1, powers of 2, and n), for
    items whose samples are 0/1; {} when any is graded or the counts differ."""
    n = samples_per_item(samples)
    scores = [s["score"] for rs in samples.values() for s in rs]
    if n is None or any(s not in (0.0, 1.0) for s in scores):
        return {}
    ks = ks or tuple(
        sorted({1, n, *(2**i for i in range(1, n.bit_length()) if 2**i <= n)})
    )
    out = {}
    for k in ks:
        per_item = [
            1.0 - math.comb(n - int(sum(s["score"] for s in rs)), k) / math.comb(n, k)
            for rs in samples.values()
        ]
        mean, half = mean_half_width([100.0 * v for v in per_item])
        out[f"pass@{k}"] = {"score": mean, "half_width": half}
    return out


def truncation(samples: dict[str, list[dict]]) -> dict | None:
    """{outputs, length, open_thinking}: samples that stopped at the length limit, and of
    those the ones still inside their thinking block; None when any sample has no finish
    reason (an arm without engine stats: nothing to count from)."""
    flat = [s for rs in samples.values() for s in rs]
    if not flat or any(s["finish_reason"] is None for s in flat):
        return None
    cut = [s for s in flat if s["finish_reason"] == "length"]
    return {
        "outputs": len(flat),
        "length": len(cut),
        "open_thinking": sum(s["thinking_closed"] is False for s in cut),
    }


def truncation_shares(samples: dict[str, list[dict]]) -> dict[str, float] | None:
    """Per item, the share of its samples cut at the length limit (None without reasons)."""
    if truncation(samples) is None:
        return None
    return {
        i: sum(s["finish_reason"] == "length" for s in rs) / len(rs)
        for i, rs in samples.items()
    }


def truncation_difference(
    arm: dict[str, list[dict]], teacher: dict[str, list[dict]]
) -> dict | None:
    """An arm's truncation rate minus the teacher's, paired on shared items (clustered by item),
    in points with its 95% half-width, and `flag` when a two-sided paired sign-flip test of the
    per-item differences rejects equal rates at 5% (`p_value`): the rates differ beyond their
    noise, so the gap mixes quality with cut-off outputs. The test, not the normal interval,
    decides: a few items that all differ one way have an interval of width 0, yet 4 of 4 is
    still a coin's 1 in 16."""
    a, t = truncation_shares(arm), truncation_shares(teacher)
    if a is None or t is None or set(a) != set(t) or not a:
        return None
    diffs = [100.0 * (a[i] - t[i]) for i in sorted(a)]
    mean, half = mean_half_width(diffs)
    p = min(1.0, 2 * min(graded_change(t, a).p_value, graded_change(a, t).p_value))
    rates = {
        "arm": 100.0 * sum(a.values()) / len(a),
        "teacher": 100.0 * sum(t.values()) / len(t),
    }
    return {
        "difference": mean,
        "half_width": half,
        "p_value": p,
        "flag": p < FLAG_ALPHA,
        **rates,
    }
