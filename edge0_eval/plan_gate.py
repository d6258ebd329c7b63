"""`edge0-eval plan GATE_CONFIG --size-gate`: the benchmark sample that fits the gate's budget.

A gate config (configs/edge0_*_gate.py) declares its inputs as data in `edge0_gate` and the
datasets its sample is drawn from in `edge0_gate_sources`. The inputs: the budget
(hours of the student arm), the student's declared tokens/s, the fidelity set's positions and
their teacher-forced rate, the overhead per run, the benchmarks to sample, the churn the power
figures assume, alpha and the rounds. Configs cannot run project code, so the sample itself is
data too (`samples`, `drops`), written by this command and checked against it by a test.

Sizing, on the planner's own costs (plan.tokens_per_sample: measured with --from, else the
thinking-on prior, else max_out_len as an upper bound):
  benchmark time = budget - overhead - fidelity positions / fidelity rate
  each sampled benchmark gets an equal share of that time (a benchmark whose whole set costs
  less than its share is taken whole and the rest shared again), as items at its cost per
  item; a pooled benchmark (MMLU-Pro) splits its items over its categories in proportion to
  their sizes (largest remainders: a stratified sample)
  drops: per benchmark, the drop the sequential rule detects at 80% power on those items at the
  declared churn (evaluation/sequential.py), rounded up to 0.1 point: the gate's threshold,
  so a student is `within` it or `regressed`, as the sample can tell.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from edge0_eval.errors import ConfigError
from edge0_eval.evaluation import paired, sequential
from edge0_eval.evaluation.benchmarks import benchmark_for
from edge0_eval.evaluation.rounds import check_rounds
from edge0_eval.plan import (
    arm_abbr,
    dataset_abbr,
    load_config,
    population,
    tokens_per_sample,
)
from edge0_eval.plan_measured import read_previous

_KEYS = {
    "budget_h": float,
    "tok_s": float,
    "fidelity_positions": int,
    "fidelity_tok_s": float,
    "overhead_s": float,
    "benchmarks": list,
    "churn": float,
    "alpha": float,
    "rounds": list,
    "samples": dict,
    "drops": dict,
}


@dataclass
class GateSize:
    arm: str
    samples: dict[str, int]  # dataset abbr -> items sampled (0: left out)
    drops: dict[str, float]  # benchmark -> threshold (points)
    rows: list[dict] = field(default_factory=list)  # per benchmark, for the table
    seconds: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    test_alpha: float = 0.0  # each paired test's level (paired.per_test_alpha)


def gate_inputs(cfg, path: Path) -> dict:
    gate = cfg.get("edge0_gate")
    if not isinstance(gate, dict):
        raise ConfigError(
            f"{path}: no `edge0_gate` dict: not a gate config (see "
            f"configs/edge0_tiny_gate.py)"
        )
    for key, kind in _KEYS.items():
        value = gate.get(key)
        if isinstance(value, bool) or not isinstance(
            value, (kind, int) if kind is float else kind
        ):
            raise ConfigError(
                f"{path}: edge0_gate[{key!r}] is {value!r}, not a {kind.__name__}"
            )
    if not (
        gate["budget_h"] > 0
        and gate["tok_s"] > 0
        and gate["fidelity_tok_s"] > 0
        and 0 < gate["churn"] < 1
        and 0 < gate["alpha"] < 0.5
    ):
        raise ConfigError(
            f"{path}: edge0_gate needs budget_h, tok_s, fidelity_tok_s > 0, "
            f"churn in (0, 1) and alpha in (0, 0.5)"
        )
    check_rounds(gate["rounds"])
    return dict(gate)


def _student(models: list) -> dict:
    found = [m for m in models if arm_abbr(m).endswith("student")]
    if len(found) != 1:
        raise ConfigError(
            "the gate's budget is the student arm's: the config must hold one "
            "model whose abbr ends in 'student' (EDGE0_ARMS)"
        )
    return found[0]


def _stratify(total: int, sizes: dict[str, int]) -> dict[str, int]:
    """`total` items over the datasets in proportion to their sizes, largest remainders."""
    whole = sum(sizes.values())
    exact = {d: total * n / whole for d, n in sizes.items()}
    out = {d: min(int(v), sizes[d]) for d, v in exact.items()}
    for d in sorted(exact, key=lambda d: (out[d] - exact[d], d)):
        if sum(out.values()) >= total:
            break
        if out[d] < sizes[d]:
            out[d] += 1
    return out


def size_gate(
    config: Path, *, tok_s: float | None = None, previous: Path | None = None
) -> GateSize:
    cfg = load_config(config)
    gate = gate_inputs(cfg, config)
    measured = read_previous(previous) if previous else None
    student = _student(list(cfg.get("models") or []))
    arm = arm_abbr(student)
    rate = tok_s or (measured.arm_rates.get(arm) if measured else None) or gate["tok_s"]
    fidelity_s = gate["fidelity_positions"] / gate["fidelity_tok_s"]
    budget = gate["budget_h"] * 3600 - gate["overhead_s"] - fidelity_s
    if budget <= 0:
        raise ConfigError(
            f"{config}: the fidelity set ({fidelity_s:.0f} s) and the overhead "
            f"({gate['overhead_s']:.0f} s) use up the {gate['budget_h']:g} h budget"
        )
    sizes: dict[str, dict[str, int]] = {b: {} for b in gate["benchmarks"]}
    cost: dict[str, float] = {}  # benchmark -> seconds per item
    for d in cfg.get("edge0_gate_sources") or []:
        abbr = dataset_abbr(d)
        bench = benchmark_for(abbr).name
        if bench not in sizes:
            continue
        sizes[bench][abbr] = population(d)[0]
        per = tokens_per_sample(student, abbr, measured)[0]
        cost[bench] = per / rate  # the same settings for every dataset of a benchmark
    missing = [b for b, s in sizes.items() if not s]
    if missing:
        raise ConfigError(
            f"{config}: edge0_gate benchmarks {missing} have no dataset in "
            f"edge0_gate_sources (the datasets the sample is drawn from)"
        )
    share, open_ = budget, dict(sizes)
    items: dict[str, int] = {}
    while open_:
        each = share / len(open_)
        whole = [b for b in open_ if sum(open_[b].values()) * cost[b] <= each]
        if not whole:
            break
        for b in whole:
            items[b] = sum(open_.pop(b).values())
            share -= items[b] * cost[b]
    for b in open_:
        items[b] = min(int(share / len(open_) / cost[b]), sum(sizes[b].values()))
    size = GateSize(
        arm,
        {},
        {},
        seconds=dict(
            budget=gate["budget_h"] * 3600,
            overhead=gate["overhead_s"],
            fidelity=fidelity_s,
            benchmarks=sum(items[b] * cost[b] for b in items),
        ),
    )
    size.test_alpha = level = paired.per_test_alpha(
        gate["alpha"], len(gate["benchmarks"])
    )
    for bench in gate["benchmarks"]:
        size.samples.update(_stratify(items[bench], sizes[bench]))
        n = sum(size.samples[d] for d in sizes[bench])
        seq = sequential.detectable_drop(n, gate["churn"], None, level) if n else None
        fixed = paired.detectable_drop(n, gate["churn"], level) if n else None
        size.drops[bench] = math.ceil(seq * 10) / 10 if seq is not None else 100.0
        size.rows.append(
            dict(
                benchmark=bench,
                items=n,
                population=sum(sizes[bench].values()),
                seconds_per_item=cost[bench],
                fixed=fixed,
                sequential=seq,
            )
        )
        if n == 0:
            size.notes.append(
                f"{bench}: one item costs {cost[bench]:.0f} s, more than its "
                f"share of the budget: not sampled"
            )
    return size


def render(size: GateSize, gate_cmd: str) -> str:
    s = size.seconds
    out = [
        f"budget {s['budget'] / 3600:g} h of {size.arm}: overhead {s['overhead']:.0f} s, "
        f"fidelity {s['fidelity']:.0f} s, benchmarks {s['benchmarks']:.0f} s; each of the "
        f"gate's {2 * len(size.rows)} tests at {size.test_alpha:.3g} (alpha over the tests)",
        "",
        "| benchmark | items of | s/item | drop detectable at 80% power: fixed | sequential |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in size.rows:
        f = "none" if r["fixed"] is None else f"{r['fixed']:.1f}"
        q = "none" if r["sequential"] is None else f"{r['sequential']:.1f}"
        out.append(
            f"| {r['benchmark']} | {r['items']} of {r['population']} | "
            f"{r['seconds_per_item']:.3g} | {f} | {q} |"
        )
    out += [
        "",
        f"# {gate_cmd}: paste into edge0_gate",
        f"samples={size.samples!r},",
        f"drops={size.drops!r},",
    ]
    return "\n".join(out + [f"- {n}" for n in size.notes])
