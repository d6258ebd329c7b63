"""The gate's paired statistics (evaluation/significance/paired.py), checked by simulation with
fixed seeds: runs of unchanged quality whose per-item outcomes are redrawn at known rates (as
after any harmless numerical change on the path) fail at about alpha; a drop equal to the
printed detectable drop is caught >= 78% of the time (the target is 80%: 78% leaves room for the
simulation's own error) at every size, for one sample per item and for averaged scores, with the
drop spread over the items or concentrated in a few; a baseline of several runs keeps each
baseline's false-fail rate near alpha, not only their average."""

from __future__ import annotations

import math

import numpy as np
import pytest

from edge0_eval.evaluation.significance import paired
from edge0_eval.evaluation.significance.paired import (
    DEFAULT_ALPHA,
    POWER,
    baseline_p,
    binary_change,
    change,
    detectable_drop,
    graded_change,
    randomized_p,
    sign_flip_ps,
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


def test_graded_scores_use_the_sign_flip_test():
    rng = np.random.default_rng(15)
    runs = 1000
    # IFBench-like instruction shares, redrawn: the decision's level, over many runs at once.
    base, now = rng.integers(0, 5, (2, runs, ITEMS)) / 4
    fails = (sign_flip_ps(base - now) < DEFAULT_ALPHA).mean()
    low, high = _interval(DEFAULT_ALPHA, runs)
    assert low <= fails <= high, fails
    c = change(_as_items(base[0]), _as_items(now[0]))
    assert c.test == "sign-flip-midp" and c.exact_p is None
    worse = {k: max(0.0, v - 0.5) for k, v in _as_items(base[0]).items()}
    assert graded_change(_as_items(base[0]), worse).p_value < DEFAULT_ALPHA
    # Items that all agree still say what they could see (one item's change, at least).
    same = _as_items(base[0])
    assert graded_change(same, dict(same)).detectable is not None


def test_the_exact_sign_flip_p_is_the_enumeration():
    """The characteristic-function route against all 2^n sign patterns, ties included."""
    rng = np.random.default_rng(17)
    for _ in range(100):
        n = int(rng.integers(1, 11))
        d = rng.integers(-4, 5, n) / 4 * rng.choice([1, 2])
        if not d.any():
            continue
        signs = np.array(np.meshgrid(*[[-1, 1]] * n)).reshape(n, -1).T
        sums, obs = signs @ np.abs(d), d.sum()
        brute = (sums > obs + 1e-9).mean() + 0.5 * (np.abs(sums - obs) < 1e-9).mean()
        assert paired.sign_flip_p(d) == pytest.approx(brute, abs=1e-9), d


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
    base = np.stack([_clustered_run(rng) for _ in range(RUNS)])
    now = np.stack([_clustered_run(rng) for _ in range(RUNS)])
    clustered = (
        sign_flip_ps(base.mean(axis=2) - now.mean(axis=2)) < DEFAULT_ALPHA
    ).mean()
    pooled = np.mean(
        [_pooled_mid_p(b, n, rng.random()) < DEFAULT_ALPHA for b, n in zip(base, now)]
    )
    low, high = _interval(DEFAULT_ALPHA, RUNS)
    assert low <= clustered <= high, clustered
    assert pooled > high, pooled  # the control sees the shared shifts


def test_the_whole_gate_fails_unchanged_runs_at_most_at_alpha():
    """The gate runs two tests per benchmark; uncorrected, 3 benchmarks of 56 items at 0.05
    each failed ~25% of unchanged runs. gate.evaluate tests each at alpha / (2 x benchmarks)."""
    from edge0_eval.evaluation.gate.checks import evaluate

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


# -- the printed detectable drop, injected ----------------------------------------------------
# Each test level of a gate of five benchmarks (alpha 0.05 / 10), where the figures matter.
LEVEL = paired.per_test_alpha(DEFAULT_ALPHA, 5)
CAUGHT = 0.78  # the bar: 80% less 2.5 simulation standard errors of 4,000 runs


@pytest.mark.parametrize("items", [401, 1000, 12032])
@pytest.mark.parametrize("churn", [0.0, 0.004, 0.10])
def test_printed_drop_is_caught_at_every_size(items, churn):
    """The figure the gate and the planner print, injected as the power model has it (each
    item improves with probability churn/2, worsens with churn/2 + drop), judged by the gate's
    randomized exact test. The discordant counts (b, c) are all the test reads from the items,
    so they are drawn directly (multinomial). Above 400 items the figure used the no-change
    variance and was caught 35-64% of the time (it jumped from 3.98 to 2.72 points at 401)."""
    said = detectable_drop(items, churn, LEVEL)
    rng = np.random.default_rng(items + int(churn * 1e4))
    runs = 4000
    v, w = churn / 2, churn / 2 + said / 100
    b, c, _ = rng.multinomial(items, [v, w, 1 - v - w], size=runs).T
    caught = (randomized_p(b + c, c, rng.random(runs)) < LEVEL).mean()
    assert caught >= CAUGHT, (said, caught)


def _lowered(rng, rates, runs, drop, placement):
    """Per run, the item rates after a drop (a share): spread (every item's rate in
    proportion) or concentrated (random whole items lose their whole rate, the last in part)."""
    n = len(rates)
    if placement == "spread":
        return np.broadcast_to(rates * (1 - drop / rates.mean()), (runs, n))
    order = np.argsort(rng.random((runs, n)), axis=1)
    taken = rates[order]
    lost = np.clip(drop * n - (np.cumsum(taken, axis=1) - taken), 0, taken)
    lowered = np.empty((runs, n))
    np.put_along_axis(lowered, order, taken - lost, axis=1)
    return lowered


def _averaged_runs(rng, rates, samples, runs, drop=0.0, placement="spread"):
    """Per-item changes (baseline - current, item means over `samples`) of `runs` runs whose
    current rates lost `drop` (_lowered)."""
    base = rng.binomial(samples, rates, (runs, len(rates))) / samples
    now = rng.binomial(samples, _lowered(rng, rates, runs, drop, placement)) / samples
    return base - now


@pytest.mark.parametrize(
    "difficulty,items,samples",
    [((7, 1), 30, 4), ((2, 2), 100, 4), ((7, 1), 30, 16)],
)
def test_printed_drop_for_averaged_scores_is_caught_wherever_it_sits(
    difficulty, items, samples
):
    """Items of several samples each (dataset n), AIME-like (rates ~88%) or spread: the
    smallest figure the gate prints over 5 clean runs, injected spread over every item or
    concentrated in the fewest whole items, is caught >= 78% by the gate's exact test. The
    normal approximation printed before was caught 57-69% spread, 7-24% concentrated."""
    rng = np.random.default_rng(41)
    rates = rng.beta(*difficulty, size=items)
    clean = _averaged_runs(rng, rates, samples, 5)
    said = min(
        graded_change(_as_items(d), _as_items(0 * d), LEVEL).detectable for d in clean
    )
    for placement in ("spread", "concentrated"):
        d = _averaged_runs(rng, rates, samples, 1000, said / 100, placement)
        caught = (sign_flip_ps(d) < LEVEL).mean()
        assert caught >= CAUGHT, (placement, said, caught)


def test_averaged_figure_is_larger_than_the_spread_alone_needs():
    """Repeats do not help when a drop sits in a few whole items: the printed figure is the
    concentrated one, and a spread drop of it is caught nearly always."""
    rng = np.random.default_rng(42)
    rates = rng.beta(7, 1, size=30)
    d = _averaged_runs(rng, rates, 4, 1)[0]
    said = paired.graded_detectable(d, LEVEL) / 100
    power = paired._GradedPower(d, LEVEL)
    assert power(said, "spread") > 0.95 and power(said, "concentrated") >= POWER


# -- a baseline of several runs ---------------------------------------------------------------


def _false_fail_by_baseline(rng, rates, runs, baselines, currents, alpha, test):
    """Per simulated baseline (`runs` runs of items at `rates`), the share of `currents`
    fresh runs of unchanged quality that the test fails: the false-fail rate CI sees."""
    rates_out = []
    for _ in range(baselines):
        base = (rng.random((len(rates), runs)) < rates[:, None]).astype(float)
        now = (rng.random((currents, len(rates))) < rates).astype(float)
        rates_out.append((test(base, now) < alpha).mean())
    return np.array(rates_out)


def _one_run_mcnemar(base, now):
    """Today's gate against a one-run baseline: the randomized exact test per current run."""
    c = ((base[:, 0] == 1) & (now == 0)).sum(axis=1)
    b = ((base[:, 0] == 0) & (now == 1)).sum(axis=1)
    return randomized_p(b + c, c, np.random.default_rng(0).random(len(now)))


def test_each_multi_run_baseline_keeps_its_false_fail_rate_near_alpha():
    """600 simulated baselines of 3 runs (100 items, rates spread over (0, 1)), 500 clean CI
    runs each: the 99th percentile of the per-baseline false-fail rate is <= 2 alpha. The
    control, one baseline run with the exact paired test (the gate before), is far above."""
    alpha, items = 0.05, 100
    rng = np.random.default_rng(43)
    rates = rng.beta(0.6, 0.6, size=items)
    several = _false_fail_by_baseline(
        rng, rates, 3, 600, 500, alpha, lambda b, n: baseline_p(b, n)[1]
    )
    assert np.quantile(several, 0.99) <= 2 * alpha, np.quantile(several, 0.99)
    one = _false_fail_by_baseline(rng, rates, 1, 600, 500, alpha, _one_run_mcnemar)
    assert one.mean() <= _interval(alpha, 600 * 500)[1]  # fine on average...
    assert np.quantile(one, 0.99) > 2 * alpha  # ...not per baseline


def test_multi_run_baseline_catches_its_printed_drop():
    rng = np.random.default_rng(44)
    rates = rng.beta(0.6, 0.6, size=200)
    base = (rng.random((200, 3)) < rates[:, None]).astype(float)
    clean = (rng.random(200) < rates).astype(float)
    said = paired.baseline_change(
        {str(i): list(base[i]) for i in range(200)},
        {str(i): clean[i] for i in range(200)},
        LEVEL,
    ).detectable
    for placement in ("spread", "concentrated"):
        now = rng.binomial(1, _lowered(rng, rates, 1000, said / 100, placement))
        caught = (baseline_p(base, now)[1] < LEVEL).mean()
        assert caught >= CAUGHT, (placement, said, caught)
