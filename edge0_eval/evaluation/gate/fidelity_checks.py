"""The gate's fidelity checks: each arm's teacher-forced KL and agreement against the baseline's.

Scoring a fixed set is close to deterministic, so the spread of the per-prompt changes is not
noise (a fault on a few prompts widens it and would hide itself). Per arm, with b and c the
baseline's and this report's means, FAIL when
  mean KL move     |c - b| > max(max_kl_rise x b, MIN_KL_RISE, noise_kl)   (a fall too)
  mean agreement   b - c   > max(max_agreement_drop, noise_agreement)
  prompts past     more than floor(max_prompts_past x n) prompts whose KL rose by more than
                   max(prompt_kl_rise x its KL, the mean allowance) + range_kl x its KL, or
                   agreement fell by more than prompt_agreement_drop + range_agreement
noise is measured from a baseline of R >= 2 runs: with s_i^2 prompt i's variance over them,
V = sum(s_i^2) / n^2 is the variance of a mean (a shift common to every prompt is what a
regression looks like: judged, not allowed), and noise = t_q(df) sqrt(V (1 + 1/R)), df by
Satterthwaite, q = 1 - NOISE_ALPHA/2 (KL, nats) or 1 - NOISE_ALPHA (agreement, points): each
mean rule fails an unchanged arm at most NOISE_ALPHA of the time. A noise term beyond its
tolerance is blind ("cannot see"). The per-prompt ranges (range_kl relative to the prompt's
KL) feed only the per-prompt rule. A one-run baseline: the tolerances alone. FAIL also when an
arm's fidelity is missing or failed, a side has no per-prompt values, the items differ, or the
teacher row is not KL 0 / agreement 100 (docs/gate.md: the formulas and measured rates).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import stats

DEFAULT_MAX_KL_RISE = 0.05  # relative: 5% of the baseline's KL
MIN_KL_RISE = 1e-4  # nats: below this a rise is float noise
DEFAULT_MAX_AGREEMENT_DROP = 2.0  # points
DEFAULT_PROMPT_KL_RISE = 1.0  # relative, per prompt: its KL at most doubles
DEFAULT_PROMPT_AGREEMENT_DROP = 10.0  # points, per prompt
DEFAULT_MAX_PROMPTS_PAST = 0.01  # share of prompts allowed past their own tolerance
# Per mean rule: the two fail an unchanged arm at most 1% of the time.
NOISE_ALPHA = 0.005


@dataclass(frozen=True)
class Tolerances:
    """What the fidelity gate allows (the module docstring; `gate`'s options)."""

    max_kl_rise: float = DEFAULT_MAX_KL_RISE
    max_agreement_drop: float = DEFAULT_MAX_AGREEMENT_DROP
    prompt_kl_rise: float = DEFAULT_PROMPT_KL_RISE
    prompt_agreement_drop: float = DEFAULT_PROMPT_AGREEMENT_DROP
    max_prompts_past: float = DEFAULT_MAX_PROMPTS_PAST


@dataclass(frozen=True)
class Noise:
    """A baseline's measured run-to-run noise of one arm (zeros: a one-run baseline)."""

    runs: int = 1
    kl: float = 0.0  # nats: the mean KL's noise bound (two-sided, NOISE_ALPHA)
    agreement: float = 0.0  # points: the mean agreement's noise bound (one-sided)
    range_kl: float = 0.0  # per-prompt rule: worst range relative to the prompt's KL
    range_agreement: float = 0.0  # per-prompt rule: worst range, points


def _mean_bound(values: np.ndarray, runs: int, q: float) -> float:
    """t_q(df) x sqrt(V (1 + 1/R)) of the module docstring for an (n, R) array."""
    s2 = values.var(axis=1, ddof=1)
    if not s2.sum() > 0:
        return 0.0
    df = s2.sum() ** 2 * (runs - 1) / (s2**2).sum()
    return float(
        stats.t.ppf(q, df) * math.sqrt(s2.sum() / len(s2) ** 2 * (1 + 1 / runs))
    )


def noise(section: dict, arm: str) -> Noise:
    """The arm's Noise from a baseline section's per_item_runs ({id: [[KL, agreement]] x R})."""
    table = (section.get("per_item_runs") or {}).get(arm) or {}
    if not table:
        return Noise()
    values = np.array([table[i] for i in sorted(table)], dtype=float)  # (n, R, 2)
    kl, agree, runs = values[..., 0], values[..., 1], values.shape[1]
    spread = lambda v: v.max(axis=1) - v.min(axis=1)  # noqa: E731
    return Noise(
        runs,
        _mean_bound(kl, runs, 1 - NOISE_ALPHA / 2),
        100.0 * _mean_bound(agree, runs, 1 - NOISE_ALPHA),
        float((spread(kl) / np.maximum(kl.mean(axis=1), MIN_KL_RISE)).max()),
        100.0 * float(spread(agree).max()),
    )


def _prompts_past(base: dict, cur: dict, mean_allowance: float, n: Noise, tol):
    """The prompts past their own tolerance: (id, KL base, KL now, agreement base, now)."""
    past = []
    for i in sorted(base):
        (kb, ab), (kc, ac) = base[i], cur[i]
        kl_tol = max(tol.prompt_kl_rise * kb, mean_allowance) + n.range_kl * kb
        drop = 100.0 * (ab - ac)
        if kc - kb > kl_tol or drop > tol.prompt_agreement_drop + n.range_agreement:
            past.append((i, kb, kc, ab, ac))
    return past


def gate_checks(
    current: dict, baseline: dict, tol: Tolerances = Tolerances()
) -> list[dict]:
    """One check per baseline arm: {name, result (pass | FAIL), reasons, items, blind,
    allowance}."""
    base, now = baseline.get("fidelity"), current.get("fidelity")
    if not base:
        new = dict(
            name="fidelity", result="new", items=(None, (now or {}).get("items"))
        )
        return [dict(new, reasons=["not in the baseline; not gated"])] if now else []
    cur = current.get("fidelity") or {"arms": {}, "items": None, "teacher_sanity": None}
    return [_arm_check(arm, base, cur, tol) for arm in base["arms"]]


def _arm_check(arm: str, base: dict, cur: dict, tol: Tolerances) -> dict:
    b, c = base["arms"][arm], cur["arms"].get(arm)
    check = {"name": f"fidelity {arm}", "result": "pass", "reasons": [], "blind": False}
    check["items"], check["allowance"] = (b.get("items"), None), None

    def fail(reason):
        check["result"] = "FAIL"
        check["reasons"].append(reason)

    if c is None:
        fail("missing from the report")
        return check
    if b["status"] != "ok" or "kl" not in b:
        fail(f"baseline not comparable ({b['status']})")
    if c["status"] != "ok" or "kl" not in c:
        fail(c["status"])
    if check["result"] == "FAIL":
        return check
    check["items"] = (b["items"], c["items"])
    if c["items"] != b["items"]:
        fail(f"{c['items']} items, baseline {b['items']}")
    per_item = [(r.get("per_item") or {}).get(arm) or {} for r in (base, cur)]
    if all(per_item) and set(per_item[0]) != set(per_item[1]):
        # The same count of other prompts (another set) is not the baseline's measurement.
        ids = set(per_item[0]) ^ set(per_item[1])
        fail(
            f"item ids differ from the baseline's ({len(ids)} not shared, e.g. "
            f"{sorted(ids)[0]}): scored on another set"
        )
    if arm == "teacher":
        if not (cur.get("teacher_sanity") or {}).get("ok"):
            fail(
                f"teacher on its own set: KL {c['kl']:.3g}, agreement "
                f"{c['agreement']:.2f} (want 0 and 100): not the set's teacher"
            )
        return check
    n = noise(base, arm)
    allowed = _mean_rules(check, b, c, n, tol, fail)
    if not all(per_item):
        where = "the baseline" if not per_item[0] else "this report"
        fail(
            f"{where} has no per-prompt values, so the per-prompt check cannot run; "
            f"make it again with `edge0-eval report`"
        )
    elif set(per_item[0]) == set(per_item[1]):
        _prompt_rule(check, per_item, allowed, n, tol, fail)
    return check


def _mean_rules(
    check: dict, b: dict, c: dict, n: Noise, tol: Tolerances, fail
) -> float:
    """The two mean rules; returns the mean KL allowance (nats) the per-prompt rule uses."""
    check["reasons"].append(
        f"KL {b['kl']:.4f}->{c['kl']:.4f}, agreement "
        f"{b['agreement']:.2f}->{c['agreement']:.2f}"
    )
    asked = max(tol.max_kl_rise * b["kl"], MIN_KL_RISE)
    kl_allowed = max(asked, n.kl)
    agree_allowed = max(tol.max_agreement_drop, n.agreement)
    source = (
        f"noise of the mean over the baseline's {n.runs} runs: KL {n.kl:.3g} nats, "
        f"agreement {n.agreement:.2f} points"
        if n.runs > 1
        else "one-run baseline: no noise measured, the tolerances alone"
    )
    check["allowance"] = (
        f"mean KL move at most {kl_allowed:.3g} nats ({100 * kl_allowed / max(b['kl'], 1e-300):.1f}%"
        f" of {b['kl']:.4g}), agreement drop at most {agree_allowed:.2f} points ({source})"
    )
    rise, drop = c["kl"] - b["kl"], b["agreement"] - c["agreement"]
    if rise > kl_allowed:
        fail(f"KL rose {rise:+.5f} > {kl_allowed:.5f} nats allowed")
    elif -rise > kl_allowed:
        fail(
            f"KL fell {rise:+.5f} beyond {kl_allowed:.5f} nats allowed: the served path "
            f"changed; refresh the baseline if that is intended"
        )
    if drop > agree_allowed:
        fail(f"agreement dropped {drop:.2f} > {agree_allowed:.2f} points allowed")
    for what, bound, limit, wanted in (
        ("KL move", n.kl, asked, f"{tol.max_kl_rise:g} of the baseline's"),
        (
            "agreement drop",
            n.agreement,
            tol.max_agreement_drop,
            f"{tol.max_agreement_drop:g} points",
        ),
    ):
        if bound > limit:
            check["blind"] = True
            check["reasons"].append(
                f"cannot see a mean {what} of {wanted}: the baseline's runs measure noise "
                f"of {bound:.3g} (more prompts or less run-to-run noise would)"
            )
    return kl_allowed


def _prompt_rule(
    check: dict, per_item: list, allowed: float, n: Noise, tol, fail
) -> None:
    past = _prompts_past(per_item[0], per_item[1], allowed, n, tol)
    limit = math.floor(tol.max_prompts_past * len(per_item[0]))
    check["allowance"] += (
        f"; at most {limit} of {len(per_item[0])} prompts past their own"
    )
    if len(past) > limit:
        worst = max(past, key=lambda p: p[2] - p[1])
        fail(
            f"{len(past)} of {len(per_item[0])} prompts past their own tolerance "
            f"(KL up > {tol.prompt_kl_rise:g} of the prompt's, or agreement down > "
            f"{tol.prompt_agreement_drop:g} points; at most {limit} allowed), e.g. "
            f"{worst[0]}: KL {worst[1]:.4g}->{worst[2]:.4g}, agreement "
            f"{100 * worst[3]:.1f}->{100 * worst[4]:.1f}"
        )
    elif past:
        check["reasons"].append(
            f"{len(past)} prompt(s) past their own tolerance (at most {limit} allowed)"
        )
