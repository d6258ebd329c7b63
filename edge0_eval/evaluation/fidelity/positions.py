"""Fidelity by position: does an arm's divergence from the teacher grow along a long
continuation, and how heavy is its tail?

From every item's per-position KL and argmax agreement (sets.score_item records them),
pooled over an arm's items:
  by_position   per bucket of continuation positions (0-63, 64-127, ..., 2048-4095, 4096+): the
                positions' mean KL and agreement, with a 95% interval clustered by item (a
                ratio estimator: an item's positions are one observation, not independent)
  quantiles     median, 99th and 99.9th percentile of per-position KL
  share_above   the share of positions whose KL exceeds each of KL_THRESHOLDS
as llama.cpp's `llama-perplexity --kl-divergence` reports for a quantized model (its mean,
median, 99th / 99.9th percentile KL and "same top" share). The teacher's own KL is 0 and its
agreement 100 at every position, so these intervals are those of the paired change too.

Later buckets hold only the items whose continuation reaches them: a curve that rises or falls
there may come from which prompts are long, so each bucket shows its item count.

numpy only: the report and the gate read this without MLX.
"""

from __future__ import annotations

import math

import numpy as np

from edge0_eval.evaluation.outputs.samples import Z95

# First position of each bucket; the last bucket is open-ended.
POSITION_BUCKETS = (0, 64, 128, 256, 512, 1024, 2048, 4096)
KL_QUANTILES = (0.5, 0.99, 0.999)
KL_THRESHOLDS = (0.1, 1.0)  # nats


def bucket_label(i: int) -> str:
    lo = POSITION_BUCKETS[i]
    if i + 1 == len(POSITION_BUCKETS):
        return f"{lo}+"
    return f"{lo}-{POSITION_BUCKETS[i + 1] - 1}"


def clustered_se(sums: np.ndarray, counts: np.ndarray) -> tuple[float, float | None]:
    """(sum(sums) / sum(counts), its standard error with each item one cluster (a ratio
    estimator: an item's positions are one observation); None below two items)."""
    total = float(counts.sum())
    mean = float(sums.sum()) / total
    n = len(sums)
    if n < 2:
        return mean, None
    resid = sums - mean * counts
    return mean, math.sqrt(n / (n - 1) * float((resid * resid).sum()) / total**2)


def clustered_mean(sums: np.ndarray, counts: np.ndarray) -> tuple[float, float | None]:
    """(sum(sums) / sum(counts), its 95% half-width with each item one cluster)."""
    mean, se = clustered_se(sums, counts)
    return mean, None if se is None else Z95 * se


# llama.cpp's `llama-perplexity --kl-divergence` figures, pooled over positions (figures()).
FIGURE_QUANTILES = {"median": 0.5, "p90": 0.9, "p95": 0.95, "p99": 0.99, "p99.9": 0.999}
DP_QUANTILES = {"p1": 0.01, "p5": 0.05, "p10": 0.1, "median": 0.5, "p90": 0.9}
DP_QUANTILES.update({"p95": 0.95, "p99": 0.99})
DP_LARGE = 0.1  # |change of the teacher token's probability| counted as large
FIGURE_KEYS = ("kl_positions", "rkl_positions", "dp_positions", "agree_positions")


def _divergence(per_item: list[np.ndarray]) -> dict:
    """Mean with its standard error clustered by prompt, quantiles and max of a per-position
    divergence."""
    every = np.concatenate(per_item)
    counts = np.array([len(v) for v in per_item], dtype=np.float64)
    mean, se = clustered_se(np.array([v.sum() for v in per_item]), counts)
    out = {"mean": mean, "se": se}
    out.update({k: float(np.quantile(every, q)) for k, q in FIGURE_QUANTILES.items()})
    return {**out, "max": float(every.max())}


def _interval(mean: float, se: float | None, transform=float) -> list | None:
    return (
        None if se is None else [transform(mean - Z95 * se), transform(mean + Z95 * se)]
    )


def figures(rows: list[dict], teacher_rows: list[dict] | None) -> dict | None:
    """One arm's figures pooled over every position of every prompt, from its items (sets'
    score_item fields, and `nll` and `positions`) paired with the teacher's; None when its
    results lack the per-position fields (made before they were recorded)."""
    if not rows or any(r.get(k) is None for r in rows for k in FIGURE_KEYS):
        return None
    arrays = {
        k: [np.asarray(r[k], dtype=np.float64) for r in rows] for k in FIGURE_KEYS
    }
    counts = np.array([len(v) for v in arrays["kl_positions"]], dtype=np.float64)
    dp = np.concatenate(arrays["dp_positions"])
    agree, agree_se = clustered_se(
        np.array([v.sum() for v in arrays["agree_positions"]]), counts
    )
    out = {
        "positions": int(counts.sum()),
        "kl": _divergence(arrays["kl_positions"]),
        "reverse_kl": _divergence(arrays["rkl_positions"]),
        "delta_p": {
            "mean": float(dp.mean()),
            "rms": float(np.sqrt((dp * dp).mean())),
            "min": float(dp.min()),
            **{k: float(np.quantile(dp, q)) for k, q in DP_QUANTILES.items()},
            "max": float(dp.max()),
            "share_large": float((np.abs(dp) > DP_LARGE).mean()),
        },
        "agreement": {
            "value": 100 * agree,
            "ci95": _interval(agree, agree_se, lambda v: 100 * v),
        },
        "ppl_ratio": None,
    }
    if teacher_rows is not None:
        # log(ppl arm / ppl teacher) = the positions' mean NLL difference, clustered by prompt
        sums = np.array(
            [(r["nll"] - t["nll"]) * n for r, t, n in zip(rows, teacher_rows, counts)]
        )
        log_ratio, se = clustered_se(sums, counts)
        out["ppl_ratio"] = {
            "value": math.exp(log_ratio),
            "ci95": _interval(log_ratio, se, math.exp),
        }
    return out


def profile(items: list[tuple[list[float], list[int]]]) -> dict | None:
    """The position view of one arm from its items' (per-position KL, per-position agreement
    0/1); None without any position."""
    items = [
        (np.asarray(k, dtype=np.float64), np.asarray(a, dtype=np.float64))
        for k, a in items
        if len(k)
    ]
    if not items:
        return None
    buckets = []
    for b, lo in enumerate(POSITION_BUCKETS):
        hi = POSITION_BUCKETS[b + 1] if b + 1 < len(POSITION_BUCKETS) else None
        parts = [(k[lo:hi], a[lo:hi]) for k, a in items if len(k) > lo]
        if not parts:
            continue
        counts = np.array([len(k) for k, _ in parts], dtype=np.float64)
        kl, kl_hw = clustered_mean(np.array([k.sum() for k, _ in parts]), counts)
        agree, agree_hw = clustered_mean(np.array([a.sum() for _, a in parts]), counts)
        buckets.append(
            {
                "bucket": bucket_label(b),
                "start": lo,
                "items": len(parts),
                "positions": int(counts.sum()),
                "kl": kl,
                "kl_half_width": kl_hw,
                "agreement": 100.0 * agree,
                "agreement_half_width": None if agree_hw is None else 100.0 * agree_hw,
            }
        )
    every = np.concatenate([k for k, _ in items])
    return {
        "positions": int(every.size),
        "kl_mean": float(every.mean()),
        "quantiles": {f"{q:g}": float(np.quantile(every, q)) for q in KL_QUANTILES},
        "share_above": {f"{t:g}": float((every > t).mean()) for t in KL_THRESHOLDS},
        "by_position": buckets,
    }


def _f(value, digits: int) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _pm(value, hw, digits: int) -> str:
    return _f(value, digits) + ("" if hw is None else f" \u00b1{hw:.{digits}f}")


def markdown(arms: dict) -> str:
    """The section's position tables from arm -> its entry (with a `positions` profile)."""
    have = {a: e["positions"] for a, e in arms.items() if e.get("positions")}
    if not have:
        return ""
    qs = [f"{q:g}" for q in KL_QUANTILES]
    ts = [f"{t:g}" for t in KL_THRESHOLDS]
    lines = [
        "Per-position KL, pooled over every position of every prompt (llama.cpp's "
        "`--kl-divergence` figures):\n",
        "| arm | positions | mean KL | "
        + " | ".join(f"KL p{float(q) * 100:g}" for q in qs)
        + " | "
        + " | ".join(f"share KL > {t}" for t in ts)
        + " |",
        "|" + "---|" * (3 + len(qs) + len(ts)),
    ]
    for arm, p in have.items():
        lines.append(
            f"| {arm} | {p['positions']} | {p['kl_mean']:.4f} | "
            + " | ".join(f"{p['quantiles'][q]:.4f}" for q in qs)
            + " | "
            + " | ".join(f"{100 * p['share_above'][t]:.2f}%" for t in ts)
            + " |"
        )
    labels = []
    for p in have.values():
        labels += [b["bucket"] for b in p["by_position"] if b["bucket"] not in labels]
    lines += [
        "",
        "KL (nats) and agreement (%) by continuation position, each bucket's mean over "
        "its positions with a 95% interval clustered by prompt; `n`: prompts reaching the "
        "bucket (later buckets hold only the long continuations):\n",
        "| positions | "
        + " | ".join(f"{a} KL | {a} agreement" for a in have)
        + " | n |",
        "|" + "---|" * (2 + 2 * len(have)),
    ]
    for label in labels:
        cells, n = [], None
        for p in have.values():
            b = next((x for x in p["by_position"] if x["bucket"] == label), None)
            cells += [
                "" if b is None else _pm(b["kl"], b["kl_half_width"], 4),
                "" if b is None else _pm(b["agreement"], b["agreement_half_width"], 1),
            ]
            n = n if b is None else b["items"]
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {n} |")
    return "\n".join(lines) + "\n"


def plot(ax, arms: dict) -> bool:
    """KL by position bucket, one line per arm, on `ax`; False when no arm has positions."""
    drawn = False
    for arm, entry in arms.items():
        p = entry.get("positions")
        if not p or not p["by_position"]:
            continue
        b = p["by_position"]
        xs = [x["start"] + 1 for x in b]  # log axis: position 0 drawn at 1
        ax.errorbar(
            xs,
            [x["kl"] for x in b],
            yerr=[x["kl_half_width"] or 0.0 for x in b],
            marker="o",
            capsize=3,
            label=arm,
        )
        drawn = True
    if drawn:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("continuation position (bucket start + 1)", fontsize=8)
        ax.set_title(
            "KL by position, nats (95% interval clustered by prompt)", fontsize=9
        )
        ax.legend(fontsize=8)
    return drawn
