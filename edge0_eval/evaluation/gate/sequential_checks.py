"""`edge0-eval gate --sequential`: the gate's paired checks as anytime-valid sequential tests.

A sequential gate run (`gate-run --sequential`) scores a benchmark's seeded sample in rounds of
growing prefixes; each round's report covers every item so far. Items enter the tests in an
order that no outcome can change, drawn afresh for every run: the round an item first appeared
in (the rounds take the sample in the order of the run's order seed, rounds.run_order), then a
hash of its id with that seed (sequential.order). Items are named by their row in the dataset
(OpenCompass's idx), the same in every round and in the baseline; `gate` checks each round's
items against the baseline's questions (settings.item_digests). Per benchmark, as in the
fixed gate, two changes are tested on the items paired with the baseline (which holds the
whole sample):
  student drop    baseline student - current student, per item
  gap widening    (current gap - baseline gap) per item, halved into [-1, 1] for the test
                  (its threshold too; printed in points of the gap)
each by sequential.sequential_change at sequential.sequential_alpha of the test's level:
`regressed` (FAIL), `within` the benchmark's threshold (a decided pass), or `undecided`. A
benchmark is decided when either change regressed or both are within; the rule and the item
and round where it fired are printed. Undecided on the whole sample: the fixed tests decide at
the rest of the level (FALLBACK_SHARE: a collapse on a few items fails); a pass there cannot
see the threshold, said so. A round holding other items than its seed and round give fails.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from edge0_eval.errors import Edge0Error
from edge0_eval.evaluation.gate.rounds import run_order
from edge0_eval.evaluation.significance import paired
from edge0_eval.evaluation.significance.sequential import (
    FALLBACK_SHARE,
    REGRESSED,
    UNDECIDED,
    WITHIN,
    Sequential,
    order,
    sequential_alpha,
    sequential_change,
)

# `gate --sequential`: no benchmark failed, some undecided, items left
UNDECIDED_EXIT = 3


@dataclass
class Verdict:
    """One benchmark's sequential outcome, for gate.Check."""

    rule: str  # REGRESSED | WITHIN | UNDECIDED
    exhausted: bool  # undecided on the whole sample (no round left)
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    drop: float | None = None
    gap_increase: float | None = None
    student: tuple = (None, None)  # (baseline, current) on the items seen, points
    gap: tuple = (None, None)


def _per_item(row: dict, arm: str) -> dict | None:
    items = row.get("arms", {}).get(arm, {}).get("per_item")
    return items if isinstance(items, dict) and items else None


def teacher_gaps(bt: dict, bs: dict, ct_: dict, cs: dict) -> str | None:
    """Why the gap cannot be paired: a student item with no teacher outcome in its report
    (None when both reports' teachers cover their students' items)."""
    for name, teacher, student in (("the baseline", bt, bs), ("this report", ct_, cs)):
        missing = [i for i in student if i not in teacher]
        if missing:
            return (
                f"{name}'s teacher has no outcome for {len(missing)} of the student's "
                f"items (e.g. {missing[0]}); make the report again with both arms scored "
                f"on the same items"
            )
    return None


def first_rounds(reports: list[tuple[str, dict]]) -> dict[str, dict[str, int]]:
    """benchmark -> item id -> the round (1-based) whose report first holds it. A later round
    must hold every earlier item with the same outcome for every arm (the rounds rescore the
    same predictions); anything else is one error naming both reports."""
    first: dict[str, dict[str, int]] = {}
    seen: dict[tuple[str, str], tuple[str, dict]] = {}
    for number, (path, report) in enumerate(reports, start=1):
        for row in report["benchmarks"]:
            ids = first.setdefault(row["benchmark"], {})
            for arm, entry in row.get("arms", {}).items():
                items = entry.get("per_item") or {}
                before = seen.get((row["benchmark"], arm))
                if before is not None:
                    gone = [i for i in before[1] if i not in items]
                    changed = [
                        i for i in before[1] if i in items and items[i] != before[1][i]
                    ]
                    if gone or changed:
                        item = (gone or changed)[0]
                        raise Edge0Error(
                            f"{path}: {row['benchmark']} {arm} item {item} is "
                            f"{'missing' if gone else 'scored otherwise'} than in {before[0]}; "
                            f"the reports are not the rounds of one gate run (give them in "
                            f"round order)"
                        )
                seen[(row["benchmark"], arm)] = (path, items)
                for item in items:
                    ids.setdefault(item, number)
    return first


def sequence(first_round: dict[str, int], ids, seed: str) -> list[str]:
    """The items in the order the sequential tests see them: by round, then by a hash of the
    id with the run's order seed."""
    by_round: dict[int, list[str]] = {}
    for item in ids:
        by_round.setdefault(first_round.get(item, 1), []).append(item)
    return [i for r in sorted(by_round) for i in order(by_round[r], seed)]


def _said(
    result: Sequential,
    what: str,
    first_round: dict[str, int],
    seq: list[str],
    scale: float = 1.0,
) -> str:
    """The rule that decided, in points of the change tested (`scale`: the gap's halving)."""
    if result.decided_at is None:
        return f"{what}: undecided after {result.items} items"
    at = result.decided_at
    rnd = first_round.get(seq[at - 1], 1)
    if result.rule == REGRESSED:
        return (
            f"{what}: regressed, {result.drop * scale:+.2f} points over the first {at} "
            f"items (round {rnd}; e-value {result.e_regressed:.3g} reached 1/alpha)"
        )
    return (
        f"{what}: within {result.threshold * scale:g} points, decided at item {at} (round "
        f"{rnd}; e-value {result.e_within:.3g} reached 1/alpha)"
    )


def fixed_tests(bt: dict, bs: dict, ct_: dict, cs: dict, base: dict, alpha: float):
    """(student drop, gap widening) as paired changes: against the baseline's runs when it
    holds several (gate-baseline), else against its one run."""
    runs = [
        (base.get("arms", {}).get(a) or {}).get("per_item_runs")
        for a in ("teacher", "student")
    ]
    if all(runs):
        rt, rs = runs
        gap_runs = {i: [s - t for s, t in zip(rs[i], rt[i])] for i in rs if i in rt}
        return (
            paired.baseline_change(rs, cs, alpha),
            paired.baseline_change(gap_runs, {i: cs[i] - ct_[i] for i in cs}, alpha),
        )
    # Per item, student - teacher: its drop is the gap's widening.
    return paired.change(bs, cs, alpha), paired.change(
        {i: bs[i] - bt[i] for i in bs}, {i: cs[i] - ct_[i] for i in cs}, alpha
    )


def seed_orders(baseline: dict, row: dict, seed: str) -> dict[str, list[str]] | None:
    """Per dataset of the row, its item ids in the order a run with this seed takes them: the
    draw (the baseline's items in their order, a whole run's) in rounds.run_order. None when
    the baseline does not record its draw (its settings' data items)."""
    arm = (baseline.get("arms") or {}).get("student") or {}
    scoring = (arm.get("settings") or {}).get("scoring") or {}
    ids = _per_item(row, "student") or {}
    out = {}
    for ds in row.get("datasets") or []:
        drawn = list(((scoring.get(ds) or {}).get("data") or {}).get("items") or {})
        if not drawn:
            return None
        prefix = f"{ds}/" if f"{ds}/{drawn[0]}" in ids else ""
        out[ds] = [prefix + drawn[j] for j in run_order(len(drawn), seed, ds)]
    return out


def round_problems(
    baseline: dict, base_row: dict, cur_row: dict, seed: str, round_no: int, shares
) -> str | None:
    """Why the round's items are not those its order seed and round give (None: they are):
    per dataset the first ceil(share x K) of its seed order; without the shares (a `gate`
    run by hand), a prefix of that order."""
    orders = seed_orders(baseline, base_row, seed)
    if orders is None:
        return (
            "the baseline records no draw (its settings' data items) to check the round's "
            "items against; make it again with `edge0-eval report`"
        )
    if shares is not None and round_no > len(shares):
        return f"round {round_no}: the gate run has {len(shares)} rounds"
    for arm in ("teacher", "student"):
        ids = set(_per_item(cur_row, arm) or {})
        for ds, seq in orders.items():
            mine = (
                {i for i in ids if i.startswith(f"{ds}/")} if len(orders) > 1 else ids
            )
            m = math.ceil(shares[round_no - 1] * len(seq)) if shares else len(mine)
            want = set(seq[:m])
            lost, extra = sorted(want - mine), sorted(mine - want)
            if lost or extra:
                return (
                    f"round {round_no}: {arm} {ds} holds {len(mine)} items, its order "
                    f"seed and round give {len(want)}: {len(lost)} lost (e.g. "
                    f"{(lost or ['-'])[0]}), {len(extra)} not the round's (e.g. "
                    f"{(extra or ['-'])[0]}); a round holds exactly those items"
                )
    return None


def _fallback(verdict: Verdict, outcomes: list, base: dict, alpha: float) -> None:
    """The last round, undecided: the fixed tests over every item, at FALLBACK_SHARE x alpha."""
    level = alpha * FALLBACK_SHARE
    student, gap = fixed_tests(*outcomes, base, level)
    for what, test in (("student dropped", student), ("gap widened", gap)):
        if test.p_value < level:
            verdict.rule = REGRESSED
            verdict.failures.append(
                f"undecided at the last round, so the fixed test over all {test.items} "
                f"items: {what} {test.drop:.2f} ({test.p_text()} < {level:.3g})"
            )


def check_benchmark(
    base: dict,
    cur: dict,
    first_round: dict[str, int],
    max_drop: float,
    max_gap_increase: float,
    alpha: float,
    seed: str,
) -> Verdict:
    """The sequential checks of one benchmark row against its baseline row."""
    outcomes = [
        _per_item(r, arm) for r in (base, cur) for arm in ("teacher", "student")
    ]
    if any(o is None for o in outcomes):
        why = "the baseline or this report has no per-item outcomes for both arms"
        fix = "(regenerate it with `edge0-eval report`)"
        return Verdict(UNDECIDED, False, failures=[f"sequential: {why} {fix}"])
    bt, bs, ct_, cs = outcomes
    foreign = sorted(set(cs) - set(bs))
    if foreign:
        return Verdict(
            UNDECIDED,
            False,
            failures=[
                f"sequential: {len(foreign)} item(s) are not in the baseline (e.g. {foreign[0]}); "
                f"the baseline must hold the whole sample of the same gate config"
            ],
        )
    unpaired = teacher_gaps(bt, bs, ct_, cs)
    if unpaired:
        return Verdict(UNDECIDED, False, failures=[f"sequential: {unpaired}"])
    seq = sequence(first_round, cs, seed)
    level = sequential_alpha(alpha)
    student = sequential_change([bs[i] - cs[i] for i in seq], max_drop, level)
    gap = sequential_change(
        [((bs[i] - bt[i]) - (cs[i] - ct_[i])) / 2 for i in seq],
        max_gap_increase / 2,
        level,
    )
    verdict = _scores(bt, bs, ct_, cs, seq)
    said = [
        _said(student, "student drop", first_round, seq),
        _said(gap, "gap widening", first_round, seq, scale=2.0),
    ]
    if REGRESSED in (student.rule, gap.rule):  # its lines are the failures, said once
        verdict.rule = REGRESSED
        verdict.failures = [
            s for s, r in zip(said, (student, gap)) if r.rule == REGRESSED
        ]
        return verdict
    verdict.notes = said
    if student.rule == gap.rule == WITHIN:
        verdict.rule = WITHIN
    elif verdict.exhausted:
        _fallback(verdict, outcomes, base, alpha)
        verdict.notes.append(
            f"cannot see a {max_drop:g}-point drop: the whole sample ({len(cs)} items) left "
            f"the sequential rule undecided"
        )
    else:
        verdict.notes.append(f"{len(cs)} of {len(bs)} items so far: run the next round")
    return verdict


def _scores(bt: dict, bs: dict, ct_: dict, cs: dict, seq: list[str]) -> Verdict:
    """An undecided Verdict with both runs' scores on the items seen so far (the baseline's
    whole sample is more items)."""

    def mean(values) -> float:
        return 100.0 * sum(values) / len(seq)

    verdict = Verdict(
        UNDECIDED,
        len(cs) == len(bs),
        student=(mean(bs[i] for i in seq), mean(cs[i] for i in seq)),
        gap=(mean(bt[i] - bs[i] for i in seq), mean(ct_[i] - cs[i] for i in seq)),
    )
    verdict.drop = verdict.student[0] - verdict.student[1]
    verdict.gap_increase = verdict.gap[1] - verdict.gap[0]
    return verdict


def check_rounds(paths: list[str], reports: list[dict]) -> dict[str, dict[str, int]]:
    if len(paths) != len(reports) or not reports:
        raise Edge0Error(
            "give the rounds' reports in round order, the last one the current"
        )
    return first_rounds(list(zip(paths, reports)))
