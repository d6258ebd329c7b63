"""The gate's paired statistics (evaluation/paired.py), checked by simulation: runs of
unchanged quality whose per-item outcomes are redrawn at known rates (as after any harmless
numerical change on the path) fail at about alpha, and an injected drop is caught at >= 80%
wherever the printed detectable drop says it will be."""

from __future__ import annotations

import math

import numpy as np
import pytest

from edge0_eval.evaluation.paired import (
    DEFAULT_ALPHA,
    POWER,
    binary_change,
    change,
    graded_change,
)

RUNS = 1000
ITEMS = 30  # AIME-sized
RATES = np.random.default_rng(1).beta(7, 1, size=ITEMS)  # item difficulties around 88%


def _as_items(values) -> dict[str, float]:
    return {f"q{i}": float(v) for i, v in enumerate(values)}


def _draw(rng, rates, drop_points: float = 0.0):
    base = (rng.random(len(rates)) < rates).astype(float)
    now = (rng.random(len(rates)) < np.clip(rates - drop_points / 100, 0, 1)).astype(
        float
    )
    return _as_items(base), _as_items(now)


def _interval(p: float, n: int, z: float = 2.576) -> tuple[float, float]:
    half = z * math.sqrt(p * (1 - p) / n)
    return p - half, p + half


def test_unchanged_quality_fails_at_alpha():
    rng = np.random.default_rng(11)
    fails = sum(
        binary_change(*_draw(rng, RATES)).p_value < DEFAULT_ALPHA for _ in range(RUNS)
    )
    low, high = _interval(DEFAULT_ALPHA, RUNS)
    assert low <= fails / RUNS <= high, fails / RUNS


def test_injected_drop_caught_where_the_printed_power_says():
    rng = np.random.default_rng(12)
    drop = 30.0
    said = [
        c
        for c in (binary_change(*_draw(rng, RATES, drop)) for _ in range(RUNS))
        if c.detectable is not None and c.detectable <= drop
    ]
    assert len(said) > RUNS // 2  # this drop is within the test's reach here
    caught = sum(c.p_value < DEFAULT_ALPHA for c in said) / len(said)
    assert caught >= _interval(POWER, len(said))[0], caught


def test_a_drop_too_small_for_the_sample_is_said_to_be():
    """A 5-point AIME drop: the printed detectable drop is far larger, never 'fine'."""
    rng = np.random.default_rng(13)
    for _ in range(50):
        c = binary_change(*_draw(rng, RATES, 5.0))
        assert c.detectable is None or c.detectable > 5.0


def test_items_that_all_agree_never_fail():
    """The old gate's half-width was 0 here and it failed on any noise."""
    same = _as_items([1, 0, 1, 1, 0, 1])
    c = binary_change(same, dict(same))
    assert (c.drop, c.p_value, c.discordant) == (0.0, 1.0, 0)


def test_verdict_is_fixed_by_the_outcomes():
    rng = np.random.default_rng(14)
    base, now = _draw(rng, RATES, 20.0)
    assert (
        binary_change(base, now).p_value == binary_change(dict(base), dict(now)).p_value
    )


def test_only_shared_items_are_paired():
    base, now = _as_items([1, 1, 1, 1]), _as_items([0, 0, 0])
    c = binary_change(base, now)
    assert c.items == 3 and c.drop == pytest.approx(100.0)


def test_graded_scores_use_the_permutation_test():
    rng = np.random.default_rng(15)
    fails = 0
    runs = 300
    for _ in range(runs):
        base = _as_items(
            rng.integers(0, 5, ITEMS) / 4
        )  # IFBench-like instruction shares
        now = _as_items(rng.integers(0, 5, ITEMS) / 4)
        c = change(base, now)
        assert c.test == "permutation-midp"
        fails += c.p_value < DEFAULT_ALPHA
    low, high = _interval(DEFAULT_ALPHA, runs)
    assert low <= fails / runs <= high
    worse = {k: max(0.0, v - 0.5) for k, v in base.items()}
    assert graded_change(base, worse).p_value < DEFAULT_ALPHA


def test_graded_drop_caught_where_the_printed_power_says():
    """The permutation test's printed detectable drop (a normal approximation) holds too:
    IFBench-like instruction shares, 60 items, a 15-point drop."""
    rng = np.random.default_rng(16)
    rates = rng.uniform(0.4, 0.9, 60)

    def draw(drop):
        base = rng.binomial(4, rates) / 4
        return _as_items(base), _as_items(
            rng.binomial(4, np.clip(rates - drop / 100, 0, 1)) / 4
        )

    runs = 300
    said = [
        c
        for c in (graded_change(*draw(15.0)) for _ in range(runs))
        if c.detectable <= 15
    ]
    assert len(said) > runs // 2
    caught = sum(c.p_value < DEFAULT_ALPHA for c in said) / len(said)
    assert caught >= _interval(POWER, len(said))[0], caught
    # Items that all agree still say what they could see (one item's change, at least).
    same = _as_items(rng.binomial(4, rates) / 4)
    assert graded_change(same, dict(same)).detectable is not None


# Several samples per item (dataset n = 4): the item is the unit. A harmless change moves each
# item's rate a little in either direction (sd 0.2 here, redrawn per run), so an item's samples
# share a shift; tests that count the 4 x 30 samples as independent items see that shared shift
# as evidence and fail too often, the item-level (clustered) test does not.
SAMPLES = 4


def _clustered_run(rng, drop_points: float = 0.0) -> np.ndarray:
    rates = np.clip(RATES + rng.normal(0, 0.2, ITEMS) - drop_points / 100, 0, 1)
    return (rng.random((ITEMS, SAMPLES)) < rates[:, None]).astype(float)


def _item_means(samples: np.ndarray) -> dict[str, float]:
    return _as_items(samples.mean(axis=1))


def _pooled_mid_p(base: np.ndarray, now: np.ndarray, u: float) -> float:
    """The control: McNemar's randomized test on the samples as if independent items."""
    c, b = int(((base == 1) & (now == 0)).sum()), int(((base == 0) & (now == 1)).sum())
    m = b + c
    if m == 0:
        return 1.0
    pmf = [math.comb(m, k) / 2**m for k in range(m + 1)]
    return sum(pmf[c + 1 :]) + u * pmf[c]


def test_clustered_samples_fail_at_alpha_where_pooled_samples_do_not():
    rng = np.random.default_rng(21)
    clustered = pooled = 0
    for _ in range(RUNS):
        base, now = _clustered_run(rng), _clustered_run(rng)
        clustered += change(_item_means(base), _item_means(now)).p_value < DEFAULT_ALPHA
        pooled += _pooled_mid_p(base, now, rng.random()) < DEFAULT_ALPHA
    low, high = _interval(DEFAULT_ALPHA, RUNS)
    assert low <= clustered / RUNS <= high, clustered / RUNS
    assert pooled / RUNS > high, pooled / RUNS  # the control sees the shared shifts


def test_clustered_drop_caught_where_the_printed_power_says():
    rng = np.random.default_rng(24)
    drop, runs = 20.0, 300
    checks = [
        change(_item_means(_clustered_run(rng)), _item_means(_clustered_run(rng, drop)))
        for _ in range(runs)
    ]
    said = [c for c in checks if c.detectable is not None and c.detectable <= drop]
    assert len(said) > runs // 2
    caught = sum(c.p_value < DEFAULT_ALPHA for c in said) / len(said)
    assert caught >= _interval(POWER, len(said))[0], caught


@pytest.mark.parametrize(
    "shift,one,four", [(0.0, (27, 35), (8, 12)), (0.2, (30, 38), (12, 17))]
)
def test_samples_per_item_lower_the_detectable_drop(shift, one, four):
    """The README's figures: AIME-sized, the median printed detectable drop over 150 simulated
    unchanged runs, with one and with four samples per item (items keep their rates, or a
    harmless change shifts each by sd `shift`)."""
    rng = np.random.default_rng(5)

    def median(samples: int) -> float:
        def run():
            rates = np.clip(RATES + rng.normal(0, shift, ITEMS), 0, 1)
            return _as_items(
                (rng.random((ITEMS, samples)) < rates[:, None]).mean(axis=1)
            )

        return float(np.median([change(run(), run()).detectable for _ in range(150)]))

    assert one[0] <= median(1) <= one[1]
    assert four[0] <= median(4) <= four[1]


def test_the_whole_gate_fails_unchanged_runs_at_most_at_alpha():
    """The gate runs two tests per benchmark; uncorrected, 3 benchmarks of 56 items at 0.05
    each failed ~25% of unchanged runs. gate.evaluate tests each at alpha / (2 x benchmarks)."""
    from edge0_eval.evaluation.gate_checks import evaluate

    rng = np.random.default_rng(7)
    benchmarks, items, runs = 3, 56, 200
    student_rates = rng.beta(0.6, 0.6, size=(benchmarks, items))
    teacher_rates = np.clip(student_rates + 0.1, 0, 1)

    def report() -> dict:
        rows = []
        for b in range(benchmarks):
            s = (rng.random(items) < student_rates[b]).astype(float)
            t = (rng.random(items) < teacher_rates[b]).astype(float)
            rows.append(
                dict(
                    benchmark=f"b{b}",
                    status="ok",
                    items=items,
                    version=None,
                    gap=100 * (t.mean() - s.mean()),
                    student=100 * s.mean(),
                    delta_half_width=1.0,
                    arms={
                        "teacher": {"status": "ok", "per_item": _as_items(t)},
                        "student": {"status": "ok", "per_item": _as_items(s)},
                    },
                )
            )
        return {"benchmarks": rows, "arms": {}}

    failed = sum(
        any(c.result == "FAIL" for c in evaluate(report(), report(), 2.0, 2.0))
        for _ in range(runs)
    )
    assert failed / runs <= _interval(DEFAULT_ALPHA, runs)[1], failed / runs
