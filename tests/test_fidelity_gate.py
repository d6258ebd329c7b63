"""The fidelity checks of the gate (evaluation.gate.fidelity_checks.gate_checks) judged as the
deterministic measure teacher-forced scoring is, by simulation with fixed seeds: a fault on a
few prompts fails however much it widens the spread of the per-prompt changes (the old check
allowed the threshold plus 1.96 standard errors of those changes, so the fault hid itself), a
clean re-scoring passes, and the only noise allowed is what two scorings of the same code
measured."""

from __future__ import annotations

import math

import numpy as np
import pytest

from edge0_eval.evaluation.gate import fidelity_checks as fc

PROMPTS = 100
SEEDS = 200


def _section(kl: np.ndarray, agreement: np.ndarray) -> dict:
    """A fidelity section as `report` writes it (the gate reads arms and per_item)."""
    per_item = {
        f"p{i}": [float(k), float(a)] for i, (k, a) in enumerate(zip(kl, agreement))
    }
    return {
        "items": len(kl),
        "arms": {
            "student": {
                "status": "ok",
                "items": len(kl),
                "kl": float(kl.mean()),
                "agreement": 100.0 * float(agreement.mean()),
            }
        },
        "per_item": {"student": per_item},
        "teacher_sanity": {"ok": True},
    }


def _student(rng) -> tuple[np.ndarray, np.ndarray]:
    """A student's per-prompt KL (heavy-tailed, as real sets are) and agreement shares."""
    kl = rng.lognormal(math.log(0.05), 1.0, PROMPTS)
    return kl, np.clip(0.9 - kl, 0.3, 1.0)


def _broken(rng, kl, agreement, prompts: int, rise: float):
    """`prompts` prompts broken so that the arm's mean KL is `rise` times the baseline's; their
    agreement falls to 0 (their argmax no longer the teacher's)."""
    hit = rng.choice(PROMPTS, prompts, replace=False)
    kl, agreement = kl.copy(), agreement.copy()
    kl[hit] += (rise - 1) * kl.sum() / prompts
    agreement[hit] = 0.0
    return kl, agreement


def _verdict(current: dict, baseline: dict) -> dict:
    (check,) = fc.gate_checks({"fidelity": current}, {"fidelity": baseline})
    return check


def _old_rule_passes(kl_base, ag_base, kl_now, ag_now) -> bool:
    """The check before: the mean's change against its threshold plus the 95% half-width of
    the per-prompt changes (KL 5% of the baseline's; agreement 2 points)."""

    def hw(d):
        return 1.96 * d.std(ddof=1) / math.sqrt(len(d))

    rise = kl_now.mean() - kl_base.mean()
    drop = 100 * (ag_base.mean() - ag_now.mean())
    return rise <= 0.05 * kl_base.mean() + hw(kl_now - kl_base) and drop <= 2 + hw(
        100 * (ag_now - ag_base)
    )


@pytest.mark.parametrize("prompts,rise", [(3, 20.0), (2, 20.0), (3, 1.04)])
def test_a_fault_on_a_few_prompts_fails(prompts, rise):
    """3 (or 2) of 100 prompts broken, the arm's mean KL up 20x: every simulated set fails;
    the old rule passed them. 3 prompts broken while the mean KL moves 4%, within its
    threshold: the per-prompt tolerance still fails it."""
    rng = np.random.default_rng(61)
    old_passed = 0
    for _ in range(SEEDS):
        kl, ag = _student(rng)
        bad_kl, bad_ag = _broken(rng, kl, ag, prompts, rise)
        check = _verdict(_section(bad_kl, bad_ag), _section(kl, ag))
        assert check["result"] == "FAIL", check
        assert f"{prompts} of {PROMPTS} prompts past their own tolerance" in " ".join(
            check["reasons"]
        )
        old_passed += _old_rule_passes(kl, ag, bad_kl, bad_ag)
    if rise == 20.0:
        assert old_passed / SEEDS > 0.5, old_passed  # the blind spot this closes


def test_a_clean_rescoring_passes_and_measured_noise_is_allowed():
    """Scoring the same set again with the same code reproduces it: pass. Scorings that vary
    (float noise, 0.1% of a prompt's KL), judged with no tolerance beyond noise: a one-run
    baseline allows none and fails them; a baseline of two scorings measured the noise and
    allows it, so a third scoring passes."""
    rng = np.random.default_rng(62)
    exact = fc.Tolerances(max_kl_rise=0.0, prompt_kl_rise=0.0)
    one_run_failed = 0
    for _ in range(SEEDS):
        kl, ag = _student(rng)
        assert _verdict(_section(kl, ag), _section(kl, ag))["result"] == "pass"
        runs = [kl * (1 + rng.normal(0, 1e-3, PROMPTS)) for _ in range(3)]
        one = _section(runs[0], ag)
        two = _section((runs[0] + runs[1]) / 2, ag)
        two["per_item_runs"] = {
            "student": {
                f"p{i}": [[float(r[i]), float(ag[i])] for r in runs[:2]]
                for i in range(PROMPTS)
            }
        }
        third = {"fidelity": _section(runs[2], ag)}
        (check,) = fc.gate_checks(third, {"fidelity": two}, exact)
        assert check["result"] == "pass", check
        (check,) = fc.gate_checks(third, {"fidelity": one}, exact)
        one_run_failed += check["result"] == "FAIL"
    assert one_run_failed == SEEDS
    # Beyond the noise: five prompts' KL up 2.2x are past their tolerance (their own KL);
    # up 1.5x they are not.
    kl, ag = _student(rng)
    doubled = kl.copy()
    doubled[:5] *= 2.2
    assert _verdict(_section(doubled, ag), _section(kl, ag))["result"] == "FAIL"
    halfway = kl.copy()
    halfway[:5] *= 1.5
    check = _verdict(_section(halfway, ag), _section(kl, ag))
    assert "prompts past" not in " ".join(check["reasons"])


def test_without_per_prompt_values_the_check_fails_closed():
    rng = np.random.default_rng(63)
    kl, ag = _student(rng)
    bare = _section(kl, ag)
    del bare["per_item"]
    check = _verdict(_section(kl, ag), bare)
    assert check["result"] == "FAIL"
    assert "the baseline has no per-prompt values" in " ".join(check["reasons"])
