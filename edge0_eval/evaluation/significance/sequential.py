"""Sequential paired gate: anytime-valid tests that may stop after any item.

Items are observed in an order that does not depend on their outcomes and is drawn afresh for
every gate run (the gate's rounds, which take the sample in the order of the run's order seed,
then a hash of the item id with that seed within a round: `order`; gate/sequential_checks.py).
Per item the paired change is d = baseline - current in [-1, 1] (points / 100; an item with
several samples is their mean). Two one-sided tests by betting (Waudby-Smith & Ramdas,
"Estimating means of bounded random variables by betting", JRSS-B 2024; Ville's inequality)
run side by side on the same items:

  regressed  H0: mean d <= 0.          wealth prod(1 + lam_i * d_i)
  within     H0: mean d >= threshold.  wealth prod(1 + lam_i * (threshold - d_i))

Each wealth is a nonnegative supermartingale under its null, so it reaches 1/alpha at ANY item
with probability <= alpha: the gate may look after every round and stop at the first crossing.
`regressed` crossing is a FAIL (false-fail rate <= alpha on a run of unchanged quality);
`within` crossing is a decided PASS (a student that dropped by the threshold or more passes
this way with probability <= alpha). Neither crossing by the last item: undecided. The bets
lam_i are predictable (from items before i only): aGRAPA, the growth-rate-adaptive plug-in of
the paper, capped at CAP of the bound that keeps every factor positive.

The model behind the guarantees: items come in a uniform random order drawn for the run (with
one fixed order for every run they would hold only on average over orders: a change that harms
the items early in it would fail every run), and each item's outcomes are random draws
(samples redrawn after a numerical change). Checked by simulation in tests/test_sequential.py,
over per-run orders with the harmed items first or last in the sample's draw.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np

from edge0_eval.evaluation.significance.paired import DEFAULT_ALPHA, POWER

CAP = 0.75  # a bet risks at most this share of the wealth on one item
# runs behind `detectable_drop` (seeded: the same answer every call)
_SIMULATED_RUNS = 2000
REGRESSED, WITHIN, UNDECIDED = "regressed", "within", "undecided"


@dataclass(frozen=True)
class Sequential:
    """One benchmark's sequential verdict; drops and bounds in points."""

    items: int  # items observed
    decided_at: int | None  # items seen when a rule fired (None: undecided)
    rule: str  # REGRESSED | WITHIN | UNDECIDED
    drop: float  # mean drop over the items up to the decision (or all)
    threshold: float
    e_regressed: float  # wealth of each test at the decision (or the last item)
    e_within: float


# A sequential gate's last round, still undecided, runs the fixed paired test over every item
# it scored at this share of the level, and the sequential tests run at the rest: together at
# most the level, and a collapse the bets are too slow to see on a small sample still fails.
FALLBACK_SHARE = 0.2


def sequential_alpha(alpha: float) -> float:
    """The level of the sequential tests beside the last round's fixed test."""
    return alpha * (1 - FALLBACK_SHARE)


def order(item_ids, seed: str = "") -> list[str]:
    """A pseudo-random order of item ids fixed by the seed, independent of their outcomes."""

    def key(item: str) -> bytes:
        return hashlib.sha256(f"{seed}\0{item}".encode()).digest()

    return sorted(item_ids, key=key)


def _log_wealth(x: np.ndarray, high: float) -> np.ndarray:
    """log prod(1 + lam_i x_i) along the last axis, lam_i aGRAPA from x_1..x_{i-1}, clipped to
    [0, CAP / high] where -high is the lowest value an x can take (so 1 + lam x >= 1 - CAP)."""
    t = np.arange(1, x.shape[-1] + 1)
    # Shrunk running moments: a prior pseudo-observation of mean 0 and variance 1/4.
    mean = np.cumsum(x, axis=-1) / (t + 1)
    var = (0.25 + np.cumsum((x - mean) ** 2, axis=-1)) / (t + 1)
    prev_mean = np.concatenate([np.zeros(x.shape[:-1] + (1,)), mean[..., :-1]], axis=-1)
    prev_var = np.concatenate(
        [np.full(x.shape[:-1] + (1,), 0.25), var[..., :-1]], axis=-1
    )
    lam = np.clip(prev_mean / (prev_var + prev_mean**2), 0.0, CAP / high)
    return np.cumsum(np.log1p(lam * x), axis=-1)


def _first(crossed: np.ndarray) -> np.ndarray:
    """Index of the first True along the last axis; the length where there is none."""
    n = crossed.shape[-1]
    return np.where(crossed.any(axis=-1), crossed.argmax(axis=-1), n)


def run_tests(
    d: np.ndarray, threshold: float, alpha: float = DEFAULT_ALPHA
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Both tests on changes d (..., items) in [-1, 1], threshold in (0, 1]: per sequence the
    first index where `regressed` and `within` cross (items if never), and both log wealths."""
    if not 0 < threshold <= 1:
        raise ValueError(f"threshold {threshold} must be in (0, 1]")
    bar = math.log(1 / alpha)
    down = _log_wealth(d, 1.0)  # d >= -1
    up = _log_wealth(threshold - d, 1.0 - threshold) if threshold < 1 else None
    if up is None:  # H0 "mean >= 1": only a change of +1 on every item could keep it
        up = np.where(np.cumsum(d < 1, axis=-1) > 0, np.inf, 0.0)
    return _first(down >= bar), _first(up >= bar), down, up


def sequential_change(
    changes: list[float], threshold_points: float, alpha: float = DEFAULT_ALPHA
) -> Sequential:
    """The verdict on per-item changes (baseline - current, each in [-1, 1]) in their order."""
    n = len(changes)
    threshold = threshold_points / 100.0
    if n == 0:
        return Sequential(0, None, UNDECIDED, 0.0, threshold_points, 1.0, 1.0)
    d = np.asarray(changes, dtype=np.float64)
    fail, ok, down, up = run_tests(d, threshold, alpha)
    fail, ok = int(fail), int(ok)
    if fail < n and fail <= ok:  # both at once: the failure stands
        rule, at = REGRESSED, fail
    elif ok < n:
        rule, at = WITHIN, ok
    else:
        rule, at = UNDECIDED, n - 1
    return Sequential(
        n,
        at + 1 if rule != UNDECIDED else None,
        rule,
        100.0 * float(d[: at + 1].mean()),
        threshold_points,
        float(np.exp(min(down[at], 700.0))),
        float(np.exp(min(up[at], 700.0))),
    )


def simulate(
    items: int,
    churn: float,
    drop: float,
    threshold: float,
    alpha: float = DEFAULT_ALPHA,
    runs: int = _SIMULATED_RUNS,
    seed: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """(first `regressed` crossing, first `within` crossing) per run of `items` 0/1 items of
    which a share churn/2 improves and churn/2 + drop worsens (the paired module's model of
    a change; drop, churn and threshold as shares)."""
    rng = np.random.default_rng(seed)
    u = rng.random((runs, items))
    worse, better = churn / 2 + drop, churn / 2
    d = np.where(u < worse, 1.0, np.where(u < worse + better, -1.0, 0.0))
    fail, ok, _, _ = run_tests(d, threshold, alpha)
    return fail, ok


def detectable_drop(
    items: int,
    churn: float,
    threshold_points: float | None,
    alpha: float = DEFAULT_ALPHA,
) -> float | None:
    """The drop (points) the `regressed` rule catches within `items` 0/1 items with
    probability >= POWER at this churn, by seeded simulation, with the `within` rule running
    beside it at `threshold_points` (it can stop a run first); None when no drop is.
    threshold_points None: the `within` rule at the drop itself, as a gate sized by
    `plan --size-gate` runs (each benchmark's threshold is its sized drop)."""
    if items == 0:
        return None

    def power(drop: float) -> float:
        threshold = drop if threshold_points is None else threshold_points / 100.0
        fail, ok = simulate(items, churn, drop, threshold, alpha)
        return float(((fail < items) & (fail <= ok)).mean())

    # Two simulation standard errors above POWER: the smallest drop that clears the bar on one
    # seeded simulation would otherwise be caught less often than POWER on fresh draws.
    bar = POWER + 2 * math.sqrt(POWER * (1 - POWER) / _SIMULATED_RUNS)
    hi = 1.0 - churn / 2
    if power(hi) < bar:
        return None
    lo = 0.0
    for _ in range(14):
        mid = (lo + hi) / 2
        if power(mid) >= bar:
            hi = mid
        else:
            lo = mid
    return 100.0 * hi
