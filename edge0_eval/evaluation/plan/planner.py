"""What an OpenCompass run of a config will cost, before it starts (`edge0-eval plan`), and
the benchmark sample that fits a gate's budget (`edge0-eval plan --size-gate`).

The plan. Per arm and dataset: items x samples, the generated tokens to expect, and hours at
each arm's aggregate rate (every row of a batch together). Lengths and rates come from an
earlier run (`--from RUN`: its per-sample engine stats, the same files the report reads;
`read_previous`) where it has the same arm and dataset, else from a stated prior: with thinking
on, the typical lengths of PRIOR_TOKENS capped at max_out_len; with thinking off, max_out_len
itself (an upper bound) (run_config.tokens_per_sample). Teacher-forced fidelity costs its
prompts and positions: priced apart at the rates `edge0-eval fidelity bench --json` measured
(`--fidelity-rate FILE`: its layer-major scorer's prompt tokens/s and positions/s), else together
at the rate an earlier run's scoring measured (`--from`) or `--fidelity-tok-s`, else at the
arm's decode rate, which the plan then says it assumed. Per benchmark it also states the smallest drop
(points) a paired gate on that many items detects at 80% power (paired.py), at the churn of
`--churn` (the share of items whose outcome changes between two runs of an unchanged model).

The gate's sample. A gate config (configs/edge0_*_gate.py) declares its inputs as data in
`edge0_gate` and the datasets its sample is drawn from in `edge0_gate_sources`. The inputs: the
budget (hours of the student arm), the student's declared tokens/s, the fidelity set's
positions and their teacher-forced rate, the overhead per run, the benchmarks to sample, the
churn the power figures assume, alpha and the rounds. Configs cannot run project code, so the
sample itself is data too (`samples`, `drops`), written by `--size-gate` and checked against it
by a test. Sizing, on the plan's own costs per sample:
  benchmark time = budget - overhead - fidelity positions / fidelity rate
  each sampled benchmark gets an equal share of that time (a benchmark whose whole set costs
  less than its share is taken whole and the rest shared again), as items at its cost per
  item; a pooled benchmark (MMLU-Pro) splits its items over its categories in proportion to
  their sizes (largest remainders: a stratified sample)
  drops: per benchmark, the drop the sequential rule detects at 80% power on those items at the
  churn (sequential.py), rounded up to 0.1 point: the gate's threshold, so a student is
  `within` it or `regressed`, as the sample can tell. The churn is the config's declared one,
  or with `--churn-from BASELINE.json` (a baseline of several runs, `gate-baseline`) each
  benchmark's as its runs measured it: a threshold sized at 10% churn is caught 55% of the time
  at 20% churn, so the thresholds follow the measurement once there is one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from edge0_eval.engine.options import option
from edge0_eval.errors import ConfigError, Edge0Error
from edge0_eval.evaluation.benchmarks import benchmark_for
from edge0_eval.evaluation.data_paths import data_root
from edge0_eval.evaluation.fidelity.sets import DATASET_ABBR as FIDELITY_ABBR
from edge0_eval.evaluation.fidelity.sets import LAYER_MAJOR, SET_PATH
from edge0_eval.evaluation.gate.inputs import load_report
from edge0_eval.evaluation.gate.rounds import check_rounds
from edge0_eval.evaluation.outputs.predictions import read_json
from edge0_eval.evaluation.plan.run_config import (
    arm_abbr,
    count_items,
    dataset_abbr,
    fidelity_counts,
    load_config,
    population,
    tokens_per_sample,
)
from edge0_eval.evaluation.significance import paired, sequential
from edge0_eval.evaluation.significance.paired import (
    DEFAULT_ALPHA,
    detectable_drop,
    per_test_alpha,
)
from edge0_eval.formats.json_files import read_json_file

DEFAULT_CHURN = 0.10
DEFAULT_TASK_OVERHEAD_S = 30.0
# `edge0-eval fidelity bench --json` files (evaluation/plan/fidelity_bench.py writes them).
FIDELITY_BENCH_FORMAT = "edge0-eval/fidelity-bench/v2"
# The scorer whose rates price fidelity: the one fidelity sets are made and scored with.
PRICED_SCORER = LAYER_MAJOR


@dataclass(frozen=True)
class FidelityRate:
    """What teacher-forced scoring costs, prompts and positions apart: seconds = prompt tokens /
    prompt_tokens_per_s + positions / positions_per_s (`fidelity bench` measures both)."""

    prompt_tokens_per_s: float
    positions_per_s: float
    source: str  # where it was measured: the file, its model, device and dtype

    def seconds(self, prompt_tokens: float, positions: float) -> float:
        return (
            prompt_tokens / self.prompt_tokens_per_s + positions / self.positions_per_s
        )


def read_fidelity_rate(path: Path) -> FidelityRate:
    """The layer-major scorer's rates from a `fidelity bench --json` file; anything else is
    one error naming the file and how to make one."""
    fix = (
        "make one with `edge0-eval fidelity bench MODEL --prompts N --json FILE` "
        "(its layer-major arm)"
    )
    data = read_json_file(path, "fidelity bench file", fix)
    if data.get("format") != FIDELITY_BENCH_FORMAT:
        raise ConfigError(
            f"--fidelity-rate {path}: not a {FIDELITY_BENCH_FORMAT} file; {fix}"
        )
    rates = (data.get("rates") or {}).get(PRICED_SCORER) or {}
    p, s = rates.get("prompt_tokens_per_s"), rates.get("positions_per_s")
    if not all(
        isinstance(v, (int, float))
        and not isinstance(v, bool)
        and math.isfinite(v)
        and v > 0
        for v in (p, s)
    ):
        raise ConfigError(
            f"--fidelity-rate {path}: no {PRICED_SCORER} rates in it (ran without that "
            f"arm?); {fix}"
        )
    where = f"{Path(path).name}: {data.get('model')}, {data.get('device')}, {data.get('dtype')}"
    return FidelityRate(float(p), float(s), where)


# -- what an earlier run measured ---------------------------------------------------------------


@dataclass
class Measured:
    """What an earlier run of a config measured (`--from RUN`): per arm and dataset the mean
    generated tokens per sample and the tokens/s of its generate calls (prefill included; for
    teacher-forced fidelity, prompt and continuation tokens/s), read from the engine stats the
    report reads, and the run's overhead per arm (its wall time less the generation it
    measured)."""

    tokens: dict[tuple[str, str], float]  # (arm, dataset) -> mean tokens per sample
    rates: dict[tuple[str, str], float]  # (arm, dataset) -> tokens/s of its calls
    arm_rates: dict[str, float]  # arm -> tokens/s over all its datasets
    overhead_s: float | None  # per arm: run wall time minus generation


def _stats_files(pred_dir: Path) -> dict[str, list[Path]]:
    out: dict[str, list[Path]] = {}
    for path in sorted(pred_dir.glob("*.engine_stats.json")):
        stem = path.name[: -len(".engine_stats.json")]
        base, _, shard = stem.rpartition("_")
        dataset = base if shard.isdigit() and base else stem
        out.setdefault(dataset, []).append(path)
    return out


def _call_seconds(rows: list[dict], path: Path) -> float:
    """Seconds of the generate calls behind `rows`, in order: each call's rows carry its
    batch_size; a batched call's time is its batch_wall_s, a single prompt's its wall_s."""
    total, i = 0.0, 0
    while i < len(rows):
        size = rows[i].get("batch_size", 1)
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise Edge0Error(
                f"{path}: row {i} has batch_size {size!r}; the file is corrupt, "
                f"re-run that task"
            )
        call = rows[i : i + size]
        walls = [r.get("batch_wall_s", r.get("wall_s")) for r in call]
        if any(not isinstance(w, (int, float)) for w in walls):
            raise Edge0Error(
                f"{path}: rows {i}..{i + len(call) - 1} lack wall_s; made by an "
                f"older edge0-eval? re-run that task"
            )
        total += max(walls)
        i += size
    return total


def _run_wall_s(run: Path) -> float | None:
    """The run's wall time: from its folder name (OpenCompass names it by its start time) to
    the newest summary file."""
    try:
        start = datetime.strptime(run.name, "%Y%m%d_%H%M%S").timestamp()
    except ValueError:
        return None
    ends = [p.stat().st_mtime for p in (run / "summary").glob("summary_*")]
    return max(ends) - start if ends else None


def read_previous(run: Path) -> Measured:
    pred_root = run / "predictions"
    if not pred_root.is_dir():
        raise ConfigError(
            f"--from {run}: no predictions/ folder; give an OpenCompass run "
            f"folder (outputs/<config>/<timestamp>)"
        )
    tokens, rates, totals = {}, {}, {}
    for model_dir in sorted(p for p in pred_root.iterdir() if p.is_dir()):
        arm = model_dir.name
        for dataset, files in _stats_files(model_dir).items():
            rows: list[dict] = []
            seconds = 0.0
            for path in files:
                data = read_json(path, "engine stats")
                if not isinstance(data, list) or not all(
                    isinstance(r, dict) for r in data
                ):
                    raise Edge0Error(
                        f"{path}: engine stats must be a list of objects; the "
                        f"file is corrupt, re-run that task"
                    )
                rows += data
                seconds += _call_seconds(data, path)
            counts = [r.get("tokens") for r in rows]
            if not rows or any(
                isinstance(c, bool) or not isinstance(c, int) for c in counts
            ):
                raise Edge0Error(
                    f"{files[0]}: a row without a whole 'tokens' count; the file "
                    f"is corrupt, re-run that task"
                )
            tokens[(arm, dataset)] = sum(counts) / len(counts)
            work = sum(counts)
            if (
                dataset == FIDELITY_ABBR
            ):  # scoring runs the prompt as well: run_config.fidelity_tokens
                prompts = [r.get("prompt_tokens") for r in rows]
                if any(isinstance(p, bool) or not isinstance(p, int) for p in prompts):
                    raise Edge0Error(
                        f"{files[0]}: a row without a whole 'prompt_tokens' "
                        f"count; the file is corrupt, re-run that task"
                    )
                work += sum(prompts)
            if seconds > 0:
                rates[(arm, dataset)] = work / seconds
            done = totals.setdefault(arm, [0, 0.0])
            done[0] += sum(counts)
            done[1] += seconds
    if not tokens:
        raise ConfigError(f"--from {run}: no engine stats under {pred_root}")
    wall = _run_wall_s(run)
    overhead = None
    if wall is not None:
        overhead = max(0.0, wall - sum(s for _, s in totals.values())) / len(totals)
    arm_rates = {arm: n / s for arm, (n, s) in totals.items() if s > 0}
    return Measured(tokens, rates, arm_rates, overhead)


# -- the plan ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlanOptions:
    """What a plan prices; a field's metadata is its `edge0-eval plan` flag (plan.py)."""

    config: Path = option(
        help="an OpenCompass config, e.g. configs/edge0_35b.py",
        flag="config",
        type=Path,
    )
    tok_s: float = option(
        20.0,
        "aggregate generated tokens/s of an arm, all rows (default 20, the paper's 35B "
        "decode rate); --from measures it per arm instead",
        type="positive_float",
    )
    arm_tok_s: dict[str, float] = option(factory=dict, flag=False)  # plan --arm-tok-s
    previous: Path | None = option(
        None,
        "an earlier run folder of this config: measured lengths, rates and overhead",
        flag="--from",
        type=Path,
    )
    task_overhead_s: float | None = option(
        None,
        "seconds per arm besides generation (load, start, scoring); default: measured "
        f"by --from, else {DEFAULT_TASK_OVERHEAD_S:g}",
        flag="--overhead-s",
        type="nonneg_float",
    )
    churn: float = option(
        DEFAULT_CHURN,
        "share of items whose outcome changes between two runs of an unchanged model "
        "(default 0.10)",
        type=("float_range", 0.0, 1.0, True),
    )
    alpha: float = option(
        DEFAULT_ALPHA,
        "the gate's false-fail rate",
        type=("float_range", 0.0, 0.5, True),
    )
    fidelity_tok_s: float | None = option(
        None,
        "teacher-forced scoring rate, prompt and continuation tokens/s (default: "
        "measured by --from, else the arm's rate)",
        type="positive_float",
    )
    # measured by fidelity bench (plan --fidelity-rate FILE): wins
    fidelity_rate: FidelityRate | None = option(None, flag=False)


@dataclass
class Line:
    arm: str
    dataset: str
    benchmark: str
    items: int
    samples: int
    items_source: str  # "data", "published", "fidelity set"
    tokens_per_sample: float
    tokens_source: str  # "measured", "prior", "limit", "prompt + positions"
    tokens: float
    tok_s: float
    tok_s_source: str  # "measured", "declared"
    hours: float


@dataclass
class Plan:
    lines: list[Line]
    arms: dict[str, dict]  # abbr -> {tokens, hours, overhead_s, total_hours}
    #                                      (the configs run arms one after another)
    power: dict[str, dict]  # benchmark -> {items, detectable_drop, churn, alpha}
    notes: list[str]


def _rate(
    opts: PlanOptions, measured: Measured | None, arm: str, dataset: str
) -> tuple[float, str]:
    """An arm's tokens/s on a dataset: declared for the arm, else measured on that dataset
    (its calls' own time, prefill included), else measured over the arm, else declared."""
    if arm in opts.arm_tok_s:
        return opts.arm_tok_s[arm], "declared"
    if measured and (arm, dataset) in measured.rates:
        return measured.rates[(arm, dataset)], "measured"
    if measured and arm in measured.arm_rates:
        return measured.arm_rates[arm], "measured (arm)"
    return opts.tok_s, "declared"


def _fidelity_rate(
    opts: PlanOptions,
    split: tuple[int, int],
    tokens: float,
    rate: float,
    source: str,
    notes: list[str],
) -> tuple[float, str]:
    """The fidelity line's rate (prompt + positions per second) and its source: measured by
    `fidelity bench` (prompts and positions priced apart), declared, measured by an earlier
    run, else the arm's decode rate, said to be assumed (with a note saying how to measure)."""
    if opts.fidelity_rate is not None:
        seconds = opts.fidelity_rate.seconds(*split)
        return (
            tokens / seconds,
            f"measured, fidelity bench ({opts.fidelity_rate.source})",
        )
    if opts.fidelity_tok_s is not None:
        return opts.fidelity_tok_s, "declared (teacher-forced)"
    if source.startswith("measured"):
        return rate, source
    note = (
        f"fidelity priced at an ASSUMED rate, the arm's decode rate ({rate:g} tok/s): "
        f"measure it with `edge0-eval fidelity bench MODEL --prompts N --json FILE` and "
        f"pass --fidelity-rate FILE"
    )
    if note not in notes:
        notes.append(note)
    return rate, "assumed: decode rate"


def _count(cfg: dict, datasets: list, notes: list[str]):
    """Per dataset abbr (items, samples, items' source, fidelity positions or None), and the
    fidelity set's (prompt tokens, positions) when one is staged or declared."""
    counted, fidelity_split = {}, None
    for d in datasets:
        abbr = dataset_abbr(d)
        if abbr != FIDELITY_ABBR:
            items, source = count_items(d)
            counted[abbr] = (items, int(d.get("n", 1)), source, None)
            continue
        staged = fidelity_counts()
        declared = (cfg.get("edge0_gate") or {}).get("fidelity_positions")
        source = "fidelity set"
        if staged is None and isinstance(declared, int) and declared > 0:
            # A gate config declares its set's positions (prompts not declared).
            staged, source = (1, 0, declared), "gate config"
            notes.append(
                f"{abbr}: no fidelity set staged; the gate config's "
                f"fidelity_positions ({declared:,}) are priced, their prompts not "
                f"(the config does not declare them)"
            )
        if staged is None:
            notes.append(
                f"{abbr}: no fidelity set at {data_root() / SET_PATH}; its cost "
                f"is left out (make one with `edge0-eval fidelity make`)"
            )
            continue
        fidelity_split = staged[1:]  # (prompt tokens, positions)
        counted[abbr] = (staged[0], 1, source, staged[1] + staged[2])
    return counted, fidelity_split


def _lines(opts, models, counted, measured, fidelity_split, notes) -> list[Line]:
    lines = []
    for m in models:
        arm = arm_abbr(m)
        for abbr, (items, samples, items_source, positions) in counted.items():
            per, source = tokens_per_sample(
                m, abbr, measured.tokens if measured else None, positions, items
            )
            rate, rate_source = _rate(opts, measured, arm, abbr)
            tokens = items * samples * per
            if positions is not None:
                rate, rate_source = _fidelity_rate(
                    opts, fidelity_split, tokens, rate, rate_source, notes
                )
            lines.append(
                Line(
                    arm,
                    abbr,
                    benchmark_for(abbr).name,
                    items,
                    samples,
                    items_source,
                    per,
                    source,
                    tokens,
                    rate,
                    rate_source,
                    tokens / rate / 3600,
                )
            )
    return lines


def _power(opts: PlanOptions, counted: dict, gate: bool) -> dict[str, dict]:
    """Per benchmark what a paired gate on its items detects (and a gate config's sequential
    rule), each test at the gate's level over these benchmarks (paired.per_test_alpha)."""
    power = {}
    for abbr, (items, _, _, positions) in counted.items():
        if positions is None:
            p = power.setdefault(benchmark_for(abbr).name, {"items": 0})
            p["items"] += items
    level = per_test_alpha(opts.alpha, len(power))
    for p in power.values():
        p.update(
            churn=opts.churn,
            alpha=opts.alpha,
            test_alpha=level,
            detectable_drop=detectable_drop(p["items"], opts.churn, level),
        )
        if gate:
            p["sequential_drop"] = sequential.detectable_drop(
                p["items"], opts.churn, None, sequential.sequential_alpha(level)
            )
    return power


def make_plan(opts: PlanOptions) -> Plan:
    cfg = load_config(opts.config)
    models, datasets = list(cfg.get("models") or []), list(cfg.get("datasets") or [])
    if not models or not datasets:
        raise ConfigError(
            f"{opts.config}: the config has no "
            f"{'models' if not models else 'datasets'} to plan"
        )
    measured = read_previous(opts.previous) if opts.previous else None
    notes = []
    counted, fidelity_split = _count(cfg, datasets, notes)
    lines = _lines(opts, models, counted, measured, fidelity_split, notes)
    overhead = opts.task_overhead_s
    if overhead is None:
        overhead = (
            measured.overhead_s
            if measured and measured.overhead_s is not None
            else DEFAULT_TASK_OVERHEAD_S
        )
    arms = {}
    for line in lines:
        a = arms.setdefault(line.arm, {"tokens": 0.0, "hours": 0.0})
        a["tokens"] += line.tokens
        a["hours"] += line.hours
    for a in arms.values():
        a["overhead_s"] = overhead
        a["total_hours"] = a["hours"] + overhead / 3600
    power = _power(opts, counted, bool(cfg.get("edge0_gate")))
    if any(l.tokens_source == "limit" for l in lines):
        notes.append(
            "'limit': no measured length and no prior for this setting, so every "
            "sample is counted at max_out_len (an upper bound); pass --from RUN"
        )
    if any(l.items_source == "published" for l in lines):
        notes.append(
            "'published': the data is not staged here, so the benchmark's published "
            "size is used"
        )
    return Plan(lines, arms, power, notes)


# -- output -------------------------------------------------------------------------------------


def _hours(h: float) -> str:
    if h < 1 / 60:
        return f"{h * 3600:.0f} s"
    return (
        f"{h * 60:.1f} min"
        if h < 1
        else f"{h:.1f} h"
        if h < 48
        else f"{h / 24:.1f} days"
    )


def _by_benchmark(lines: list[Line]) -> list[dict]:
    """Lines summed per (arm, benchmark): MMLU-Pro's categories as one row."""
    rows: dict[tuple[str, str], dict] = {}
    for l in lines:
        r = rows.setdefault(
            (l.arm, l.benchmark),
            dict(
                arm=l.arm,
                benchmark=l.benchmark,
                items=0,
                samples=l.samples,
                tokens=0.0,
                hours=0.0,
                tok_s=l.tok_s,
                sources=set(),
                rate_source=l.tok_s_source,
            ),
        )
        r["items"] += l.items
        r["tokens"] += l.tokens
        r["hours"] += l.hours
        r["sources"] |= {l.items_source, l.tokens_source}
    return list(rows.values())


def render(plan: Plan) -> str:
    out = [
        "| arm | benchmark | items x samples | tokens/sample | tokens | tok/s | time |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in _by_benchmark(plan.lines):
        per = r["tokens"] / max(1, r["items"] * r["samples"])
        out.append(
            f"| {r['arm']} | {r['benchmark']} | {r['items']} x {r['samples']} | "
            f"{per:,.0f} ({', '.join(sorted(r['sources']))}) | {r['tokens']:,.0f} | "
            f"{r['tok_s']:,.1f} ({r['rate_source']}) | {_hours(r['hours'])} |"
        )
    out += [
        "",
        "| arm | tokens (generated; fidelity: scored) | generation and scoring "
        "| + overhead | total |",
        "| --- | --- | --- | --- | --- |",
    ]
    for arm, a in plan.arms.items():
        out.append(
            f"| {arm} | {a['tokens']:,.0f} | {_hours(a['hours'])} | "
            f"{a['overhead_s']:.0f} s | {_hours(a['total_hours'])} |"
        )
    total = sum(a["total_hours"] for a in plan.arms.values())
    out.append(f"| all arms, one after another | | | | {_hours(total)} |")
    out += [
        "",
        "| benchmark | items | drop detectable at 80% power (paired, one sample) |",
        "| --- | --- | --- |",
    ]
    for bench, p in plan.power.items():
        drop = p["detectable_drop"]
        seen = f"{drop:.1f} points" if drop is not None else "none (too few items)"
        if "sequential_drop" in p:
            seq = p["sequential_drop"]
            seen += (
                f"; sequential (gate-run --sequential): "
                f"{f'{seq:.1f} points' if seq is not None else 'none'}"
            )
        out.append(
            f"| {bench} | {p['items']} | {seen} at churn {p['churn']:.0%}, "
            f"each test at {p['test_alpha']:.3g} (alpha {p['alpha']:g} over "
            f"{2 * len(plan.power)} tests) |"
        )
    return "\n".join(out + [""] + [f"- {n}" for n in plan.notes])


# -- the gate's sample --------------------------------------------------------------------------


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
    fidelity_source: str = ""  # the fidelity rate: measured (where) or assumed


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


def measured_churn(path: Path, benchmarks: list[str]) -> dict[str, float]:
    """Each benchmark's churn as a baseline of several runs measured it (`gate-baseline`)."""
    report = load_report(str(path))
    rows = {r["benchmark"]: r for r in report["benchmarks"]}
    churn = {}
    for bench in benchmarks:
        spread = (rows.get(bench) or {}).get("baseline_runs") or {}
        value = spread.get("churn")
        if not isinstance(value, (int, float)) or not 0 <= value < 1:
            raise ConfigError(
                f"--churn-from {path}: no measured churn for {bench} (a baseline of "
                f"several runs holds one: `edge0-eval gate-baseline`)"
            )
        churn[bench] = float(value)
    return churn


def _allocate(budget: float, sizes: dict, cost: dict) -> dict[str, int]:
    """Items per benchmark: the budget shared equally, a benchmark that fits whole taking its
    whole population and leaving the rest to the others."""
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
    return items


def _size_row(
    size, bench: str, items: int, sizes: dict, cost: float, churn: float, level
):
    """One benchmark's sample (stratified), threshold and what each mode detects."""
    size.samples.update(_stratify(items, sizes))
    n = sum(size.samples[d] for d in sizes)
    seq_level = sequential.sequential_alpha(level)
    seq = sequential.detectable_drop(n, churn, None, seq_level) if n else None
    fixed = paired.detectable_drop(n, churn, level) if n else None
    size.drops[bench] = math.ceil(seq * 10) / 10 if seq is not None else 100.0
    size.rows.append(
        dict(
            benchmark=bench,
            items=n,
            population=sum(sizes.values()),
            seconds_per_item=cost,
            churn=churn,
            fixed=fixed,
            sequential=seq,
            collapse=(
                collapse_from(n, level),
                collapse_from(n, level * sequential.FALLBACK_SHARE),
            ),
        )
    )
    if n == 0:
        size.notes.append(
            f"{bench}: one item costs {cost:.0f} s, more than its share of the budget: "
            f"not sampled"
        )


def size_gate(
    config: Path,
    *,
    tok_s: float | None = None,
    previous: Path | None = None,
    churn_from: Path | None = None,
    fidelity_rate: FidelityRate | None = None,
) -> GateSize:
    cfg = load_config(config)
    gate = gate_inputs(cfg, config)
    churn = (
        measured_churn(churn_from, gate["benchmarks"])
        if churn_from
        else {b: gate["churn"] for b in gate["benchmarks"]}
    )
    measured = read_previous(previous) if previous else None
    student = _student(list(cfg.get("models") or []))
    arm = arm_abbr(student)
    rate = tok_s or (measured.arm_rates.get(arm) if measured else None) or gate["tok_s"]
    # The fidelity part's cost: measured by fidelity bench (--fidelity-rate; the config
    # declares positions, not prompts), else the config's declared rate, an assumption.
    if fidelity_rate is not None:
        fidelity_s = fidelity_rate.seconds(0, gate["fidelity_positions"])
        fidelity_source = f"measured, {fidelity_rate.positions_per_s:.3g} positions/s ({fidelity_rate.source})"
    else:
        fidelity_s = gate["fidelity_positions"] / gate["fidelity_tok_s"]
        fidelity_source = (
            f"ASSUMED {gate['fidelity_tok_s']:g} positions/s, the config's "
            f"fidelity_tok_s (measure with `fidelity bench --json`, pass --fidelity-rate)"
        )
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
        per = tokens_per_sample(student, abbr, measured.tokens if measured else None)[0]
        cost[bench] = per / rate  # the same settings for every dataset of a benchmark
    missing = [b for b, s in sizes.items() if not s]
    if missing:
        raise ConfigError(
            f"{config}: edge0_gate benchmarks {missing} have no dataset in "
            f"edge0_gate_sources (the datasets the sample is drawn from)"
        )
    items = _allocate(budget, sizes, cost)
    size = GateSize(
        arm,
        {},
        {},
        fidelity_source=fidelity_source,
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
        _size_row(
            size, bench, items[bench], sizes[bench], cost[bench], churn[bench], level
        )
    return size


def collapse_from(items: int, level: float) -> float | None:
    """The least student score (points) whose collapse to 0 the exact paired test at `level`
    catches every time: d items lost, all one way, give p = 2^-d (None: not on these items).
    The sequential mode's is its last round's fixed test, at FALLBACK_SHARE of the level."""
    lost = math.ceil(math.log2(1 / level))
    return 100.0 * lost / items if 0 < lost <= items else None


def render_gate_size(size: GateSize, gate_cmd: str) -> str:
    s = size.seconds
    out = [
        f"budget {s['budget'] / 3600:g} h of {size.arm}: overhead {s['overhead']:.0f} s, "
        f"fidelity {s['fidelity']:.0f} s, benchmarks {s['benchmarks']:.0f} s; each of the "
        f"gate's {2 * len(size.rows)} tests at {size.test_alpha:.3g} (alpha over the tests)",
        f"fidelity rate: {size.fidelity_source}",
        "",
        "| benchmark | items of | s/item | churn | drop detectable at 80% power: fixed "
        "| sequential | a collapse to 0 caught every time from a score of: fixed | "
        "sequential |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    shown = lambda v: "none" if v is None else f"{v:.1f}"  # noqa: E731
    for r in size.rows:
        out.append(
            f"| {r['benchmark']} | {r['items']} of {r['population']} | "
            f"{r['seconds_per_item']:.3g} | {100 * r['churn']:.1f}% | {shown(r['fixed'])} "
            f"| {shown(r['sequential'])} | {shown(r['collapse'][0])} | "
            f"{shown(r['collapse'][1])} |"
        )
    out += [
        "",
        f"# {gate_cmd}: paste into edge0_gate",
        f"samples={size.samples!r},",
        f"drops={size.drops!r},",
    ]
    return "\n".join(out + [f"- {n}" for n in size.notes])
