"""The fidelity checks against a baseline of three runs (`gate-baseline`), by simulation with
fixed seeds: the allowance on the mean comes from the noise of the mean, not from the worst
prompt's range, so a uniform rise of every prompt's KL is caught while an unchanged student
passes. Before, the allowance was the largest per-prompt range (~4 sigma of one prompt, ~40x
the mean's noise): +10% on every prompt was caught 0% of the time at 3% jitter.

The model (stated, not measured): per prompt a KL (the 35B gate's shape: 100 prompts x 1,024
positions, lognormal around 0.05 nats; the tiny set: the 12 prompts x 16 positions of
reports/tiny_gate) and an agreement share on the prompt's positions; each run multiplies
every prompt's KL by (1 + jitter x N(0, 1)) independently (or adds 1e-4 nats x N(0, 1)), and
moves its agreement by a tenth of the jitter, rounded to whole positions."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from edge0_eval.evaluation.gate import fidelity_checks as fc

SETS = 300
REPO = Path(__file__).resolve().parent.parent


def _shape(name: str, rng):
    if name == "35b":
        kl = rng.lognormal(np.log(0.05), 0.5, 100)
        return kl, np.clip(0.9 - kl, 0.3, 1.0), 1024
    fid = json.loads((REPO / "reports/tiny_gate/report.json").read_text())["fidelity"]
    values = np.array(list(fid["per_item"]["student"].values()))
    return values[:, 0], values[:, 1], 16


def _runs(rng, kl, agree, positions, jitter, count):
    """(count, n) KL and agreement of `count` scorings of the same code."""
    eps = rng.normal(size=(count, len(kl)))
    kls = (
        np.maximum(kl + 1e-4 * eps, 0.0)
        if jitter == "additive"
        else kl * (1 + jitter * eps)
    )
    step = 1e-3 if jitter == "additive" else jitter / 10
    moved = agree + step * rng.normal(size=(count, len(kl)))
    return kls, np.clip(np.round(moved * positions), 0, positions) / positions


def _section(kls, agrees) -> dict:
    """A fidelity section: per prompt the runs' mean, and the runs when several."""
    ids = [f"p{i}" for i in range(kls.shape[1])]
    kl, agree = kls.mean(0), agrees.mean(0)
    arm = {"status": "ok", "items": len(ids), "kl": float(kl.mean())}
    arm["agreement"] = 100.0 * float(agree.mean())
    out = {"items": len(ids), "arms": {"student": arm}, "teacher_sanity": {"ok": True}}
    out["per_item"] = {"student": {i: [kl[k], agree[k]] for k, i in enumerate(ids)}}
    if len(kls) > 1:
        out["per_item_runs"] = {
            "student": {
                i: [[kls[r, k], agrees[r, k]] for r in range(len(kls))]
                for k, i in enumerate(ids)
            }
        }
    return out


def _rates(shape: str, jitter, seed: int) -> tuple[float, float, float]:
    """(caught: every prompt's KL x1.10, false FAIL: unchanged, blind) over SETS baselines."""
    rng = np.random.default_rng(seed)
    caught = false = blind = 0
    for _ in range(SETS):
        kl, agree, positions = _shape(shape, rng)
        kls, agrees = _runs(rng, kl, agree, positions, jitter, 5)
        base = {"fidelity": _section(kls[:3], agrees[:3])}
        (clean,) = fc.gate_checks({"fidelity": _section(kls[3:4], agrees[3:4])}, base)
        risen = _section(kls[4:5] * 1.10, agrees[4:5])
        (hit,) = fc.gate_checks({"fidelity": risen}, base)
        false += clean["result"] == "FAIL"
        caught += hit["result"] == "FAIL"
        blind += clean["blind"]
    return caught / SETS, false / SETS, blind / SETS


@pytest.mark.parametrize("shape", ["35b", "tiny"])
@pytest.mark.parametrize("jitter", [0.01, 0.03, 0.10, "additive"])
def test_three_run_baseline_catches_a_uniform_rise(shape, jitter):
    caught, false, blind = _rates(shape, jitter, seed=57)
    print(
        f"{shape} {jitter}: caught {caught:.3f}, false FAIL {false:.3f}, blind {blind:.3f}"
    )
    assert false <= 0.01
    if shape == "tiny" and jitter == 0.10:
        # 12 prompts at 10% jitter: the mean's own noise (~3.3%) leaves a 10% rise
        # undetectable at 99% with a 1% false-fail rate by any rule (the best, the mean,
        # needs ~16%); the check says it cannot see a 5% move instead of passing quietly.
        assert blind >= 0.99
        return
    assert caught >= 0.99


def test_a_one_run_baseline_keeps_its_tolerances_and_says_so():
    rng = np.random.default_rng(3)
    kl, agree, positions = _shape("35b", rng)
    kls, agrees = _runs(rng, kl, agree, positions, 0.0, 2)
    base = {"fidelity": _section(kls[:1], agrees[:1])}
    (check,) = fc.gate_checks({"fidelity": _section(kls[1:] * 1.049, agrees[1:])}, base)
    assert check["result"] == "pass" and "one-run baseline" in check["allowance"]
    (check,) = fc.gate_checks({"fidelity": _section(kls[1:] * 1.051, agrees[1:])}, base)
    assert check["result"] == "FAIL"
