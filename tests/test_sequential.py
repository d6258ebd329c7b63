"""The sequential gate's rules (evaluation/significance/sequential.py), checked by simulation as
tests/test_paired_gate.py checks the fixed-size test: runs of unchanged quality (outcomes
redrawn at known rates, as after a harmless numerical change) fail at most at alpha whenever
they stop; a student that dropped by the threshold is declared `within` at most at alpha; a
drop is caught at >= 80% where `detectable_drop` says; clean and broken students stop early."""

from __future__ import annotations

import math

import numpy as np
import pytest

from edge0_eval.evaluation.gate import rounds
from edge0_eval.evaluation.gate import sequential_checks as gate_sequential
from edge0_eval.evaluation.significance import paired
from edge0_eval.evaluation.significance.paired import DEFAULT_ALPHA, POWER
from edge0_eval.evaluation.significance.sequential import (
    REGRESSED,
    UNDECIDED,
    WITHIN,
    detectable_drop,
    order,
    run_tests,
    sequential_change,
    simulate,
)

RUNS = 1000
ITEMS = 200


def _upper(p: float, n: int, z: float = 2.576) -> float:
    return p + z * math.sqrt(p * (1 - p) / n)


def _lower(p: float, n: int, z: float = 2.576) -> float:
    return p - z * math.sqrt(p * (1 - p) / n)


def _item_runs(
    rng, rates: np.ndarray, drop: float = 0.0, samples: int = 1
) -> np.ndarray:
    """Per-item changes (baseline - current, item means over samples) of RUNS runs in which
    every item's outcomes are redrawn at its own rate, the current run's lowered by `drop`."""
    base = (rng.random((RUNS, len(rates), samples)) < rates[:, None]).mean(axis=2)
    now_rates = np.clip(rates - drop, 0, 1)
    now = (rng.random((RUNS, len(rates), samples)) < now_rates[:, None]).mean(axis=2)
    return base - now


def _verdicts(d: np.ndarray, threshold: float):
    fail, ok, _, _ = run_tests(d, threshold)
    n = d.shape[-1]
    return (
        (fail < n) & (fail <= ok),
        (ok < n) & (ok < fail),
        np.minimum(np.minimum(fail, ok), n),
    )


@pytest.mark.parametrize("difficulty,samples", [((7, 1), 1), ((2, 2), 1), ((2, 2), 4)])
def test_unchanged_quality_fails_at_most_at_alpha(difficulty, samples):
    """Item rates AIME-like (around 88%) or spread; one sample or the mean of 4 per item.
    Anytime-valid: the bound holds whenever the gate stops, so the rate is at or below alpha."""
    rng = np.random.default_rng(31)
    rates = rng.beta(*difficulty, size=ITEMS)
    failed, _, _ = _verdicts(_item_runs(rng, rates, samples=samples), 0.10)
    assert failed.mean() <= _upper(DEFAULT_ALPHA, RUNS), failed.mean()


def test_a_drop_at_the_threshold_is_declared_within_at_most_at_alpha():
    rng = np.random.default_rng(32)
    rates = rng.beta(2, 2, size=ITEMS)
    _, within, _ = _verdicts(_item_runs(rng, rates, drop=0.10), 0.10)
    assert within.mean() <= _upper(DEFAULT_ALPHA, RUNS), within.mean()


def test_drop_caught_where_detectable_drop_says():
    churn, threshold = 0.10, 10.0
    said = detectable_drop(ITEMS, churn, threshold)
    assert said is not None and said < 20
    # A fresh simulation (another seed) at the printed drop: caught at >= 80%.
    fail, ok = simulate(ITEMS, churn, said / 100, threshold / 100, runs=RUNS, seed=99)
    caught = ((fail < ITEMS) & (fail <= ok)).mean()
    assert caught >= _lower(POWER, RUNS), caught
    # The price of looking after every item: more than the fixed-size test needs.
    assert said > paired.detectable_drop(ITEMS, churn)


def test_clean_and_broken_students_stop_early():
    rng = np.random.default_rng(33)
    rates = rng.beta(2, 2, size=ITEMS)
    # Clean, low churn (common random numbers: most items reproduce): decided within early.
    clean = _item_runs(rng, rates) * (rng.random((RUNS, ITEMS)) < 0.1)
    failed, within, stop = _verdicts(clean, 0.10)
    assert within.mean() >= 0.95 and np.median(stop) < ITEMS / 2, (within.mean(), stop)
    # Broken (a 40-point drop): fails, after a few dozen items.
    failed, _, stop = _verdicts(_item_runs(rng, rates, drop=0.40), 0.10)
    assert failed.mean() >= 0.99 and np.median(stop) < 40, (
        failed.mean(),
        np.median(stop),
    )


def test_one_sequence_names_the_rule_that_stopped_it():
    assert sequential_change([1.0] * 30, 10.0).rule == REGRESSED
    broken = sequential_change([1.0] * 30, 10.0)
    assert broken.decided_at < 30 and broken.e_regressed >= 1 / DEFAULT_ALPHA
    assert broken.drop == pytest.approx(100.0)
    same = sequential_change([0.0] * 200, 10.0)
    assert (
        same.rule == WITHIN and same.e_within >= 1 / DEFAULT_ALPHA and same.drop == 0.0
    )
    few = sequential_change([0.0] * 5, 10.0)
    assert (few.rule, few.decided_at) == (UNDECIDED, None)
    assert sequential_change([], 10.0).rule == UNDECIDED
    with pytest.raises(ValueError):
        sequential_change([0.0], 0.0)


def test_order_is_fixed_and_independent_of_the_listing():
    ids = [str(i) for i in range(50)]
    assert order(ids) == order(list(reversed(ids))) != ids
    assert sorted(order(ids)) == sorted(ids)
    assert order(ids, "other seed") != order(ids)


def test_sized_drop_caught_by_the_rule_the_gate_runs():
    """`plan --size-gate` writes the drop detectable_drop(n, churn, None) as the benchmark's
    threshold, so the gate runs `within` at that drop beside `regressed`: caught at >= 80% on
    fresh draws (measured with `regressed` alone, the sized drop was caught ~79%)."""
    said = detectable_drop(234, 0.10, None)
    runs = 40000
    fail, ok = simulate(234, 0.10, said / 100, said / 100, runs=runs, seed=99)
    caught = ((fail < 234) & (fail <= ok)).mean()
    assert caught >= _lower(POWER, runs), caught


# -- the order: drawn per run ------------------------------------------------------------------


def _seen(values: np.ndarray, seeds: list[str]) -> np.ndarray:
    """Per gate run (one order seed each), the per-item changes in the order its sequential
    tests see them: the rounds take the sample in the run's order (rounds.run_order), a round
    report names item k by the baseline's id, and the gate sequences by round then by a
    seeded hash (gate.sequential_checks.sequence). values: per baseline item id, in the draw's
    order."""
    size, shares = len(values), [0.125, 0.25, 0.5, 1.0]
    out = np.empty((len(seeds), size))
    for row, seed in enumerate(seeds):
        positions = rounds.run_order(size, seed, "d")
        first_round = {}
        for number in range(1, len(shares) + 1):
            first, end, _ = rounds.bounds(size, shares, number)
            first_round.update({str(positions[k]): number for k in range(first, end)})
        seq = gate_sequential.sequence(first_round, list(first_round), seed)
        out[row] = values[[int(i) for i in seq]]
    return out


def _seeds(runs: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return [f"{v:016x}" for v in rng.integers(0, 2**63, runs)]


def test_harmed_items_first_do_not_fail_a_mean_zero_change_over_run_orders():
    """A change that harms 20 items and helps 20 others (mean zero), the harmed ones first in
    the sample's draw: over fresh per-run orders the sequential gate fails it at most at
    alpha; with one fixed order (the gate before, seed '') every run fails it."""
    values = np.zeros(ITEMS)
    values[:20], values[20:40] = 1.0, -1.0
    failed, _, _ = _verdicts(_seen(values, _seeds(RUNS, 51)), 0.10)
    assert failed.mean() <= _upper(DEFAULT_ALPHA, RUNS), failed.mean()
    fixed, _, _ = _verdicts(_seen(values, [""] * 20), 0.10)
    assert fixed.all()


def test_a_threshold_drop_on_the_last_items_is_not_declared_within_over_run_orders():
    """A drop of exactly the threshold (10 points: 20 of 200 items lost), on the items last in
    the draw: over fresh per-run orders `within` fires at most at alpha; with the fixed order
    it fired before those items were seen, every run."""
    values = np.zeros(ITEMS)
    values[-20:] = 1.0
    _, within, _ = _verdicts(_seen(values, _seeds(RUNS, 52)), 0.10)
    assert within.mean() <= _upper(DEFAULT_ALPHA, RUNS), within.mean()
    _, fixed, _ = _verdicts(_seen(values, [""] * 20), 0.10)
    assert fixed.all()
