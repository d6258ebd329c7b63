"""Paired tests of a change between two runs on the same items: the gate's statistics.

A run that changes anything on the served path redraws its samples, so the gate compares runs
item by item. For 0/1 outcomes: the discordant items (passed before and failed now, c; failed
before and passed now, b) decide; under "no change" each discordant item is a fair coin, so c
given m = b + c is Binomial(m, 1/2) (McNemar's exact conditional test). The one-sided mid-p
value keeps the false-fail rate near alpha rather than far below it (an exact test on a few
discordant items would almost never fail). Items that agree carry no evidence, so a run whose
items all agree with the baseline passes: no interval of width 0 to fail on noise.

Graded outcomes (a mean over instructions, a pass@k) use a paired sign-flip permutation test of
the per-item changes, seeded, with the same one-sided mid-p convention.

Power: the smallest drop (in points) the test detects with probability >= 0.8 at this run's
discordance. A gate whose detectable drop is larger than the drop it is asked to catch says so.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

DEFAULT_ALPHA = 0.05
POWER = 0.8
_PERMUTATIONS = 20000


@dataclass
class PairedChange:
    """now - baseline on shared items, as a drop (positive: worse now)."""

    items: int
    drop: float  # points, baseline mean - current mean
    p_value: float  # one-sided: evidence that the drop is > 0
    detectable: float | None  # drop detected with probability POWER; None: none can be
    discordant: int | None = None  # 0/1 outcomes: items whose outcome changed
    test: str = "mcnemar-randomized"


_EXACT_ITEMS = 400  # power summed exactly up to this many items, normal beyond


def _log_factorials(n: int) -> np.ndarray:
    return np.concatenate([[0.0], np.cumsum(np.log(np.arange(1, n + 1)))])


def _binom_pmf(m: int, q: float, logf: np.ndarray | None = None) -> np.ndarray:
    k = np.arange(m + 1)
    if q <= 0 or q >= 1:
        return (k == (m if q >= 1 else 0)).astype(float)
    logf = _log_factorials(m) if logf is None else logf
    return np.exp(
        logf[m] - logf[k] - logf[m - k] + k * math.log(q) + (m - k) * math.log1p(-q)
    )


def _randomized_upper(m: int, c: int, u: float) -> float:
    """One-sided randomized p of c worsened items among m discordant (each 1/2 under no
    change): P(X > c) + u P(X = c), uniform on (0, 1) under no change for u uniform."""
    pmf = _binom_pmf(m, 0.5)
    return float(pmf[c + 1 :].sum() + u * pmf[c])


def _region(m: int, alpha: float, logf: np.ndarray) -> tuple[int, float]:
    """(k, gamma): the size-alpha randomized test rejects c > k, and c = k with prob gamma."""
    pmf = _binom_pmf(m, 0.5, logf)
    tail = np.cumsum(pmf[::-1])[::-1]  # P(X >= c)
    k = int(np.argmax(tail <= alpha)) - 1 if (tail <= alpha).any() else m
    above = tail[k + 1] if k + 1 <= m else 0.0
    return k, float((alpha - above) / pmf[k])


def _power_binary(
    n: int, churn: float, drop: float, alpha: float, regions, logf
) -> float:
    """P(fail) when each item improves with prob churn/2 and worsens with churn/2 + drop."""
    v, w = churn / 2, churn / 2 + drop
    if w + v >= 1:
        return 1.0
    q = w / (w + v)
    if n > _EXACT_ITEMS:  # normal approximation of c - b
        mean, var = n * (w - v), n * ((w + v) - (w - v) ** 2)
        crit = NormalDist().inv_cdf(1 - alpha) * math.sqrt(n * churn)
        return 1 - NormalDist(mean, math.sqrt(var)).cdf(crit)
    pm = _binom_pmf(n, w + v, logf)
    total = 0.0
    for m in range(1, n + 1):
        if pm[m] < 1e-12:
            continue
        k, gamma = regions[m]
        pc = _binom_pmf(m, q, logf)
        total += pm[m] * float(pc[k + 1 :].sum() + gamma * pc[k])
    return total


def _detectable_binary(n: int, improved: int, alpha: float) -> float | None:
    """The drop (points) failed with probability >= POWER at this run's churn: items change
    both ways at the rate the improvements show (2 x improved / n; a drop adds losses, not
    improvements, so the losses would overstate it), and a drop adds losses on top."""
    if n == 0:
        return None
    churn = max(2 * improved, 1) / n  # none seen: the least churn a run of n can show
    logf = _log_factorials(n)
    regions = {
        mm: _region(mm, alpha, logf) for mm in range(1, min(n, _EXACT_ITEMS) + 1)
    }
    hi = 1.0 - churn / 2
    if _power_binary(n, churn, hi, alpha, regions, logf) < POWER:
        return None
    lo = 0.0
    for _ in range(40):
        mid = (lo + hi) / 2
        if _power_binary(n, churn, mid, alpha, regions, logf) >= POWER:
            hi = mid
        else:
            lo = mid
    return 100.0 * hi


def per_test_alpha(alpha: float, benchmarks: int) -> float:
    """The level of each paired test in a gate of `benchmarks` benchmarks, two tests each
    (student drop, gap widening), so that the gate as a whole fails a run of unchanged quality
    with probability at most alpha (Bonferroni; the two tests of a benchmark are correlated,
    so the gate-wide rate lies below alpha)."""
    return alpha / (2 * max(benchmarks, 1))


def detectable_drop(
    items: int, churn: float, alpha: float = DEFAULT_ALPHA
) -> float | None:
    """The drop (points) the exact test catches at POWER on `items` 0/1 items of which a share
    `churn` changes between two runs of unchanged quality (the README's power table)."""
    return _detectable_binary(items, round(churn / 2 * items), alpha)


def _uniform(base: dict, now: dict, ids: list[str]) -> float:
    """A uniform draw fixed by the outcomes themselves: the same runs give the same verdict."""
    key = "".join(f"{i}:{base[i]:g}:{now[i]:g};" for i in ids).encode()
    return (int.from_bytes(hashlib.sha256(key).digest()[:8], "little") + 0.5) / 2.0**64


def binary_change(
    base: dict[str, float], now: dict[str, float], alpha: float = DEFAULT_ALPHA
) -> PairedChange:
    """McNemar-type exact test on the items both runs scored (outcomes 0 or 1)."""
    ids = sorted(set(base) & set(now))
    n = len(ids)
    c = sum(1 for i in ids if base[i] > now[i])  # passed before, failed now
    b = sum(1 for i in ids if base[i] < now[i])
    m = b + c
    drop = 100.0 * (c - b) / n if n else 0.0
    # No discordant item is no evidence of a change: never a failure.
    p = _randomized_upper(m, c, _uniform(base, now, ids)) if m else 1.0
    return PairedChange(n, drop, p, _detectable_binary(n, b, alpha), m)


def graded_change(
    base: dict[str, float],
    now: dict[str, float],
    alpha: float = DEFAULT_ALPHA,
    seed: int = 0,
) -> PairedChange:
    """Sign-flip permutation test of the per-item changes (outcomes in [0, 1])."""
    ids = sorted(set(base) & set(now))
    d = np.array([base[i] - now[i] for i in ids], dtype=np.float64) * 100.0
    n = len(d)
    if n == 0:
        return PairedChange(0, 0.0, 1.0, None, test="permutation-midp")
    # Normal approximation for power: one-sided z at alpha plus z at POWER, times the se of the
    # permutation distribution, with at least one item's full change (the churn floor of
    # binary_change), so items that all agree still state what they can see.
    se = float(np.sqrt(max((d**2).mean(), 100.0**2 / n) / n))
    detectable = (NormalDist().inv_cdf(1 - alpha) + NormalDist().inv_cdf(POWER)) * se
    if not np.any(d):
        return PairedChange(n, 0.0, 1.0, detectable, test="permutation-midp")
    observed = d.mean()
    signs = np.random.default_rng(seed).choice([-1.0, 1.0], size=(_PERMUTATIONS, n))
    means = (signs * d).mean(axis=1)
    p = float((means > observed).mean() + 0.5 * (means == observed).mean())
    return PairedChange(n, float(observed), p, detectable, test="permutation-midp")


def change(
    base: dict[str, float], now: dict[str, float], alpha: float = DEFAULT_ALPHA
) -> PairedChange:
    """The test the outcomes call for: exact for 0/1, permutation for graded scores."""
    values = set(base.values()) | set(now.values())
    if values <= {0.0, 1.0}:
        return binary_change(base, now, alpha)
    return graded_change(base, now, alpha)
