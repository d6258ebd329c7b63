"""Paired tests of a change between two runs on the same items: the gate's statistics.

A run that changes anything on the served path redraws its samples, so the gate compares runs
item by item. For 0/1 outcomes: the discordant items (passed before and failed now, c; failed
before and passed now, b) decide; under "no change" each discordant item is a fair coin, so c
given m = b + c is Binomial(m, 1/2) (McNemar's exact conditional test). The decision is the
randomized exact test: P(X > c) + u P(X = c) with u a uniform draw fixed by the outcomes
themselves (the same runs give the same verdict), which fails an unchanged student with
probability exactly its level; the exact p (P(X >= c), conservative) and the mid-p (u = 1/2)
are printed beside it, so a FAIL that rests on the draw at the boundary can be seen as such
(Fagerland et al. 2013). Items that agree carry no evidence, so a run whose items all agree
with the baseline passes: no interval of width 0 to fail on noise.

Graded outcomes (an item's mean over several samples, a share of instructions, the gap per
item) use the paired sign-flip test of the per-item changes, mid-p: exact (the sign-flip
distribution by its characteristic function and an inverse FFT) when the changes lie on a grid
of at most GRID steps per point, which every mean over n <= GRID samples does; else by seeded
Monte Carlo flips.

Power: the smallest drop (in points) the test detects with probability >= POWER at this run's
discordance. For 0/1 outcomes it is exact at every size (summed over the discordant count).
For graded outcomes it is simulated with a fixed seed from the run's own changes (their
magnitudes with random signs: the sign-flip null), with the drop placed two ways, spread over
every item and concentrated in whole items lost (_GradedPower), each simulated run judged by
the gate's own exact test; the figure is the larger, so it holds wherever the drop sits
(tests/test_paired_gate.py injects it, spread and concentrated, and counts).

A baseline made from several runs (`gate-baseline`): per item the mean of its R runs, tested
by baseline_change (below), which also bounds the false-fail rate of each baseline, not only
the average over baselines.
"""

from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np
from scipy import stats

DEFAULT_ALPHA = 0.05
POWER = 0.8
PERMUTATIONS = 20000  # Monte Carlo sign flips for changes on no grid
GRID = 64  # exact sign-flip distribution for changes on a grid of 1/L, L <= GRID
SIMULATED_VALUES = 2_000_000  # runs x items behind one graded power figure
# A multi-run baseline: the share of baselines whose own luck may push a CI run's false-fail
# rate above alpha (baseline_change).
BASELINE_RISK = 0.01


@dataclass
class PairedChange:
    """now - baseline on shared items, as a drop (positive: worse now)."""

    items: int
    drop: float  # points, baseline mean - current mean
    p_value: float  # one-sided, the decision's: evidence that the drop is > 0
    detectable: float | None  # drop detected with probability POWER; None: none can be
    discordant: int | None = None  # 0/1 outcomes: items whose outcome changed
    test: str = "mcnemar-randomized"
    exact_p: float | None = None  # 0/1: P(X >= c), the conservative exact p
    mid_p: float | None = None  # 0/1: P(X > c) + P(X = c) / 2

    def p_text(self, named: bool = True) -> str:
        """The decision's p, with the exact and mid-p beside a randomized one."""
        text = f"{self.test} p={self.p_value:.3g}" if named else f"{self.p_value:.3g}"
        if self.exact_p is not None:
            text += f" (exact {self.exact_p:.3g}, mid-p {self.mid_p:.3g})"
        return text


# --------------------------------------------------------------------------- 0/1 outcomes


def randomized_p(m, c, u):
    """One-sided randomized p of c worsened items among m discordant (each 1/2 under no
    change): P(X > c) + u P(X = c), uniform on (0, 1) under no change for u uniform; 1 where
    m = 0 (no discordant item: no evidence). Arrays broadcast."""
    m, c, u = np.asarray(m), np.asarray(c), np.asarray(u)
    p = stats.binom.sf(c, m, 0.5) + u * stats.binom.pmf(c, m, 0.5)
    return np.where(m > 0, p, 1.0)


def _rejection(m: np.ndarray, alpha: float) -> tuple[np.ndarray, np.ndarray]:
    """(k, gamma) per discordant count m: the size-alpha randomized test rejects c > k, and
    c = k with probability gamma."""
    k = stats.binom.isf(alpha, m, 0.5)  # smallest k with P(X > k) <= alpha
    # isf works in floating point: step to the exact boundary either way.
    k = np.where(stats.binom.sf(k, m, 0.5) > alpha, k + 1, k)
    k = np.where((k > 0) & (stats.binom.sf(k - 1, m, 0.5) <= alpha), k - 1, k)
    gamma = (alpha - stats.binom.sf(k, m, 0.5)) / stats.binom.pmf(k, m, 0.5)
    return k, np.clip(gamma, 0.0, 1.0)


def binary_power(n: int, churn: float, drop: float, alpha: float) -> float:
    """P(fail) of the randomized test on n items when each improves with probability churn/2
    and worsens with churn/2 + drop: exact, summed over the discordant count m."""
    v, w = churn / 2, churn / 2 + drop
    if w <= 0:
        return 0.0
    if w + v >= 1:
        return 1.0
    q = w / (w + v)
    lo = max(1, int(stats.binom.ppf(1e-13, n, w + v)))
    hi = int(stats.binom.isf(1e-13, n, w + v))
    m = np.arange(lo, max(lo, hi) + 1)
    k, gamma = _rejection(m, alpha)
    caught = stats.binom.sf(k, m, q) + gamma * stats.binom.pmf(k, m, q)
    return float(np.sum(stats.binom.pmf(m, n, w + v) * caught))


@functools.lru_cache(maxsize=4096)  # a pure function of its arguments; runs repeat them
def _detectable_binary(n: int, improved: int, alpha: float) -> float | None:
    """The drop (points) failed with probability >= POWER at this run's churn: items change
    both ways at the rate the improvements show (2 x improved / n; a drop adds losses, not
    improvements, so the losses would overstate it), and a drop adds losses on top."""
    if n == 0:
        return None
    churn = max(2 * improved, 1) / n  # none seen: the least churn a run of n can show
    hi = 1.0 - churn / 2
    if binary_power(n, churn, hi, alpha) < POWER:
        return None
    lo = 0.0
    for _ in range(30):
        mid = (lo + hi) / 2
        if binary_power(n, churn, mid, alpha) >= POWER:
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
    `churn` changes between two runs of unchanged quality (the power tables)."""
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
    p = float(randomized_p(m, c, _uniform(base, now, ids))) if m else 1.0
    exact = float(randomized_p(m, c, 1.0)) if m else 1.0
    mid = float(randomized_p(m, c, 0.5)) if m else 1.0
    return PairedChange(
        n, drop, p, _detectable_binary(n, b, alpha), m, exact_p=exact, mid_p=mid
    )


# --------------------------------------------------------------------------- graded outcomes


def _grid(magnitudes: np.ndarray) -> int | None:
    """The smallest L <= GRID with every magnitude a whole multiple of 1/L (None: none)."""
    for steps in range(1, GRID + 1):
        scaled = magnitudes * steps
        if np.all(np.abs(scaled - np.round(scaled)) < 1e-7):
            return steps
    return None


def _exact_mid_p(units: np.ndarray, positive: np.ndarray) -> np.ndarray:
    """Per row of `units` (runs, items; whole magnitudes |d| x L) the exact one-sided mid-p of
    the sign-flip test: under random signs the positive part S of sum(d) is the sum over items
    of a_i x Bernoulli(1/2), whose characteristic function is the product over distinct
    magnitudes a of ((1 + e^(-i w a)) / 2)^(count of a); an inverse FFT gives its pmf.
    `positive`: (runs, items), which changes are > 0 (their units sum to the observed S)."""
    units = np.asarray(units, dtype=np.int64)
    observed = np.where(positive, units, 0).sum(axis=1)
    size = 1 << int(units.sum(axis=1).max() + 1).bit_length()
    w = 2 * np.pi * np.arange(size // 2 + 1) / size
    mag = np.ones((len(units), len(w)))
    phase = np.zeros((len(units), len(w)))
    top = int(units.max())
    rows = np.arange(len(units))[:, None] * (top + 1)
    counts = np.bincount((units + rows).ravel(), minlength=len(units) * (top + 1))
    counts = counts.reshape(len(units), top + 1).astype(np.float64)
    for value in np.flatnonzero(counts[:, 1:].any(axis=0)) + 1:
        count = counts[:, value : value + 1]
        # (1 + e^(-i w a)) / 2 = e^(-i w a / 2) cos(w a / 2)
        half = np.cos(w * value / 2)
        mag *= np.abs(half)[None, :] ** count
        phase += count * (-w * value / 2 + np.pi * (half < 0))[None, :]
    pmf = np.clip(np.fft.irfft(mag * np.exp(1j * phase), n=size, axis=1), 0.0, None)
    above = np.cumsum(pmf[:, ::-1], axis=1)[:, ::-1]  # P(S >= s)
    at = np.take_along_axis(pmf, observed[:, None], axis=1)[:, 0]
    beyond = np.take_along_axis(above, observed[:, None], axis=1)[:, 0] - at
    return np.clip(beyond + 0.5 * at, 0.0, 1.0)


def _exact_in_chunks(units: np.ndarray, positive: np.ndarray) -> np.ndarray:
    """_exact_mid_p over row chunks of at most ~4M spectrum values each (memory)."""
    size = 1 << int(units.sum(axis=1).max() + 1).bit_length()
    rows = max(1, 4_000_000 // size)
    return np.concatenate(
        [
            _exact_mid_p(units[i : i + rows], positive[i : i + rows])
            for i in range(0, len(units), rows)
        ]
    )


def sign_flip_ps(d: np.ndarray) -> np.ndarray:
    """The exact sign-flip mid-p of every row of d (runs, items), changes on a common grid of
    at most GRID steps (a ValueError otherwise); 1 for a row of zeros. sign_flip_p's."""
    d = np.atleast_2d(np.asarray(d, dtype=np.float64))
    steps = _grid(np.abs(d))
    if steps is None:
        raise ValueError(f"changes on no grid of at most {GRID} steps per point")
    p = np.ones(len(d))
    live = np.any(d, axis=1)
    if live.any():
        units = np.round(np.abs(d[live]) * steps)
        p[live] = _exact_in_chunks(units, d[live] > 0)
    return p


def sign_flip_p(d: np.ndarray, seed: int = 0) -> float:
    """One-sided mid-p of the paired sign-flip test that mean(d) > 0: exact on a grid (see
    the module docstring), else seeded Monte Carlo flips."""
    d = np.asarray(d, dtype=np.float64)
    if not np.any(d):
        return 1.0
    if _grid(np.abs(d)) is not None:
        return float(sign_flip_ps(d)[0])
    signs = np.random.default_rng(seed).choice([-1.0, 1.0], size=(PERMUTATIONS, len(d)))
    means = (signs * d).mean(axis=1)
    observed = d.mean()
    return float((means > observed).mean() + 0.5 * (means == observed).mean())


# Simulated runs with more nonzero changes than this are judged by the normal approximation of
# the sign-flip statistic, close to exact there (and the exact spectra cost time in proportion).
EXACT_NONZERO = 150


def _rejects(x: np.ndarray, steps: int | None, alpha: float) -> np.ndarray:
    """Per simulated run (rows of x, changes on the grid 1/steps when steps is given): does the
    gate's sign-flip test fail it at level alpha?"""
    if steps is not None and (x != 0).sum(axis=1).max() <= EXACT_NONZERO:
        units = np.round(np.abs(x) * steps)
        return _exact_in_chunks(units, x > 0) < alpha
    s1, s2 = x.sum(axis=1), (x**2).sum(axis=1)
    z = np.where(s2 > 0, s1 / np.sqrt(np.where(s2 > 0, s2, 1.0)), 0.0)
    return z > NormalDist().inv_cdf(1 - alpha)


def _simulated_runs(n: int) -> int:
    return int(np.clip(SIMULATED_VALUES // max(n, 1), 400, 1000))


def _power_bar(n: int) -> float:
    """POWER plus two simulation standard errors: the smallest drop that clears POWER on one
    seeded simulation would otherwise be caught less often than POWER on fresh draws."""
    return POWER + 2 * math.sqrt(POWER * (1 - POWER) / _simulated_runs(n))


class _GradedPower:
    """The power of the sign-flip test on runs like one observed run (its changes d, shares):
    the null is its magnitudes, resampled, with random signs (the sign-flip null itself); a
    drop (a share) is placed
      spread        every item's change raised by Binomial(L, drop) / L (each of an item's
                    L grid steps, its samples, lost with probability drop): a shift by drop
                    on average; by drop itself off any grid
      concentrated  floor(drop x n) items lose a whole point (an item always passed and now
                    always fails), one more its remainder rounded down to the grid
    Simulated with a fixed seed and common draws for every drop, so power grows with it."""

    def __init__(self, d: np.ndarray, alpha: float, seed: int = 0):
        d = np.asarray(d, dtype=np.float64)
        n = len(d)
        pool = np.abs(d)
        if not pool.any():
            pool = pool.copy()
            pool[0] = 1.0  # none seen: the least churn a run can show, one item
        self.steps = _grid(pool)
        self.alpha, self.n = alpha, n
        self.high = max(1.0, float(pool.max()))  # the gap's changes reach 2
        rng = np.random.default_rng(seed)
        runs = _simulated_runs(n)
        self.null = pool[rng.integers(0, n, (runs, n))] * rng.choice(
            [-1.0, 1.0], (runs, n)
        )
        self.lose = rng.random((runs, n, self.steps or 1))

    def __call__(self, drop: float, placement: str) -> float:
        x = self.null.copy()
        if placement == "spread":
            if self.steps is None:
                raised = drop
            else:
                raised = (self.lose < drop).sum(axis=2) / self.steps
            x = np.clip(x + raised, -self.high, self.high)
        else:
            whole, rest = divmod(drop * self.n, 1.0)
            x[:, : int(whole)] = 1.0
            if self.steps is not None:
                rest = math.floor(rest * self.steps) / self.steps
            if rest > 0 and int(whole) < self.n:
                x[:, int(whole)] = rest
        return float(_rejects(x, self.steps, self.alpha).mean())


def graded_detectable(d: np.ndarray, alpha: float) -> float | None:
    """The drop (points) caught with probability >= POWER however it is placed (the larger of
    spread and concentrated; _GradedPower), from a run's changes d (shares). It depends on
    the magnitudes only, as a multiset."""
    return _graded_detectable(tuple(sorted(np.abs(np.asarray(d, float)))), alpha)


@functools.lru_cache(maxsize=1024)  # a pure function of its arguments; runs repeat them
def _graded_detectable(magnitudes: tuple, alpha: float) -> float | None:
    n = len(magnitudes)
    if n == 0:
        return None
    power, bar = _GradedPower(np.array(magnitudes), alpha), _power_bar(n)
    worst = 0.0
    for placement in ("concentrated", "spread"):
        if power(1.0, placement) < bar:
            return None
        lo, hi = worst, 1.0
        if power(lo, placement) >= bar:
            continue
        for _ in range(11):  # to 0.05 points
            mid = (lo + hi) / 2
            if power(mid, placement) >= bar:
                hi = mid
            else:
                lo = mid
        worst = hi
    return 100.0 * worst


def graded_change(
    base: dict[str, float],
    now: dict[str, float],
    alpha: float = DEFAULT_ALPHA,
    seed: int = 0,
) -> PairedChange:
    """Sign-flip test of the per-item changes (outcomes in [0, 1])."""
    ids = sorted(set(base) & set(now))
    d = np.array([base[i] - now[i] for i in ids], dtype=np.float64)
    n = len(d)
    if n == 0:
        return PairedChange(0, 0.0, 1.0, None, test="sign-flip-midp")
    return PairedChange(
        n,
        100.0 * float(d.mean()),
        sign_flip_p(d, seed),
        graded_detectable(d, alpha),
        test="sign-flip-midp",
    )


def change(
    base: dict[str, float], now: dict[str, float], alpha: float = DEFAULT_ALPHA
) -> PairedChange:
    """The test the outcomes call for: exact for 0/1, sign-flip for graded scores."""
    values = set(base.values()) | set(now.values())
    if values <= {0.0, 1.0}:
        return binary_change(base, now, alpha)
    return graded_change(base, now, alpha)


# --------------------------------------------------------------------------- several runs


def baseline_p(runs: np.ndarray, now: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(drop, p) of current runs `now` (..., items) against a baseline of R >= 2 runs `runs`
    (items, R), vectorised over the leading axes of `now`; drop a share (baseline_change)."""
    r = runs.shape[1]
    n = runs.shape[0]
    now = np.asarray(now, dtype=np.float64)
    # Each item's variance over its R + 1 scores, from the sums (no (..., items, R+1) copy).
    total = runs.sum(axis=1) + now
    square = (runs**2).sum(axis=1) + now**2
    var = np.clip((square - total**2 / (r + 1)) / r, 0.0, None)
    v = np.maximum(var.sum(axis=-1), 1.0 / (r + 1))
    drop = (runs.mean(axis=1) - now).mean(axis=-1)
    df = np.maximum(1, r * (var > 1e-12).sum(axis=-1))
    margin = NormalDist().inv_cdf(1 - BASELINE_RISK) / math.sqrt(r)
    return drop, stats.t.sf(drop / (np.sqrt(v) / n) - margin, df)


def baseline_change(
    runs: dict[str, list[float]], now: dict[str, float], alpha: float = DEFAULT_ALPHA
) -> PairedChange:
    """The current run against a baseline of R >= 2 runs (per item its R scores), on the
    items both hold. The drop D is the mean over items of (baseline mean - current). Under no
    change the current run is one more draw like the baseline's, so each item's run-to-run
    variance is estimated from its R + 1 scores together, and V = sum of them. Given the
    baseline, D has spread sqrt(V) / n around the baseline's own error, whose spread is
    sqrt(V / R) / n: the test fails when

        D > (t_(1 - alpha) + z_(1 - BASELINE_RISK) / sqrt(R)) x sqrt(V) / n

    so a run of unchanged quality fails with probability at most alpha for all but a share
    BASELINE_RISK of baselines (one run of luck in the baseline no longer fails every CI run
    that is compared with it). t has R x (items that vary) degrees of freedom. V is at least
    one item that differs once (the least churn R + 1 runs can show)."""
    ids = sorted(set(runs) & set(now))
    n = len(ids)
    r = min((len(runs[i]) for i in ids), default=0)
    if n == 0 or r < 2:
        return PairedChange(n, 0.0, 1.0, None, test="baseline-runs")
    y = np.array([runs[i][:r] for i in ids], dtype=np.float64)  # (items, R)
    x = np.array([now[i] for i in ids], dtype=np.float64)
    drop, p = baseline_p(y, x)
    var = np.column_stack([y, x]).var(axis=1, ddof=1)
    v = max(float(var.sum()), 1.0 / (r + 1))
    df = max(1, r * int((var > 1e-12).sum()))
    # Power: a drop of delta lost on whole items raises V by delta x n / (R + 1) (an item
    # that always passed and now fails has variance 1 / (R + 1) over the R + 1 runs).
    crit = stats.t.ppf(1 - alpha, df) + NormalDist().inv_cdf(
        1 - BASELINE_RISK
    ) / math.sqrt(r)
    z_power = NormalDist().inv_cdf(POWER)
    delta = 0.0
    for _ in range(50):
        inflated = math.sqrt(v + delta * n / (r + 1)) / n
        delta = crit * inflated + z_power * math.sqrt(v) / n
    detectable = 100.0 * delta if delta <= 1.0 else None
    return PairedChange(
        n, 100.0 * float(drop), float(p), detectable, test="baseline-runs"
    )


# Below this many items a mean of paired 0/1 differences wants the exact interval: the t
# interval covered 64.5% at 3 items and 82.7% at 5 (width 0 whenever every item agrees).
EXACT_BELOW = 50


def exact_interval(
    values: list[float], unit: float = 1.0, level: float = 0.95
) -> tuple[float, float] | None:
    """An exact interval for the mean of paired 0/1 changes, each in {-unit, 0, unit} (points:
    unit 100): the shares p+ and p- of +unit and -unit each get a Clopper-Pearson interval at
    (1 + level) / 2, and the mean unit (p+ - p-) lies in [unit (L+ - U-), unit (U+ - L-)] with
    probability >= level at every n (a union bound; tests/test_gate_intervals.py), of width > 0
    when every item agrees. None when a value is off that grid."""
    if not values or any(v not in (-unit, 0.0, unit) for v in values):
        return None
    n, a = len(values), (1 - level) / 2

    def clopper_pearson(k: int) -> tuple[float, float]:
        low = stats.beta.ppf(a / 2, k, n - k + 1) if k else 0.0
        high = stats.beta.ppf(1 - a / 2, k + 1, n - k) if k < n else 1.0
        return float(low), float(high)

    up = clopper_pearson(sum(v == unit for v in values))
    down = clopper_pearson(sum(v == -unit for v in values))
    return unit * (up[0] - down[1]), unit * (up[1] - down[0])
