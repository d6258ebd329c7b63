"""`edge0-eval plan CONFIG`: what an OpenCompass run of CONFIG will cost, before it starts.

Per arm and dataset: items x samples, the generated tokens to expect, and hours at each arm's
aggregate rate (every row of a batch together). Lengths and rates come from an earlier run
(`--from RUN`: its per-sample engine stats, the same files the report reads) where it has the
same arm and dataset, else from a stated prior: with thinking on, the typical lengths of
PRIOR_TOKENS capped at max_out_len; with thinking off, max_out_len itself (an upper bound).
Teacher-forced fidelity costs its prompts and positions, at the rate an earlier run's scoring
measured (`--from`) or `--fidelity-tok-s`, else the arm's decode rate.

Per benchmark it also states the smallest drop (points) a paired gate on that many items
detects at 80% power (evaluation/paired.py), at the churn of `--churn` (the share of items
whose outcome changes between two runs of an unchanged model).

    edge0-eval plan configs/edge0_35b.py --tok-s 20
    edge0-eval plan configs/edge0_tiny.py --from outputs/demo/opencompass/20261203_101500
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from edge0_eval import cli_types as ct
from edge0_eval.errors import ConfigError
from edge0_eval.evaluation import sequential
from edge0_eval.evaluation.agreement import DATASET_ABBR as AGREEMENT_ABBR
from edge0_eval.evaluation.agreement import SET_PATH as AGREEMENT_PATH
from edge0_eval.evaluation.agreement import prompts as agreement_prompts
from edge0_eval.evaluation.benchmarks import benchmark_for
from edge0_eval.evaluation.data_paths import data_root
from edge0_eval.evaluation.fidelity_set import DATASET_ABBR as FIDELITY_ABBR
from edge0_eval.evaluation.fidelity_set import SET_PATH, read_set
from edge0_eval.evaluation.paired import DEFAULT_ALPHA, detectable_drop, per_test_alpha
from edge0_eval.evaluation.rounds import sample_size
from edge0_eval.plan_measured import Measured, read_previous

# Typical generated tokens per answer with thinking on (Qwen3.6-class models; shared notes of
# 2026-12-02): the prior when no earlier run measured them. Keys: Benchmark.name.
PRIOR_TOKENS = {
    "AIME 2026": 20_000,
    "HumanEval": 3_000,
    "GPQA-Diamond": 8_000,
    "MMLU-Pro": 2_500,
    "IFBench": 3_000,
}
# Published sizes, used only when a dataset's data is not staged where the config looks.
PUBLISHED_ITEMS = {
    "aime2026": 30,
    "openai_humaneval": 164,
    "GPQA_diamond": 198,
    "IFBench": 294,
    "mmlu_pro_biology": 717,
    "mmlu_pro_business": 789,
    "mmlu_pro_chemistry": 1132,
    "mmlu_pro_computer_science": 410,
    "mmlu_pro_economics": 844,
    "mmlu_pro_engineering": 969,
    "mmlu_pro_health": 818,
    "mmlu_pro_history": 381,
    "mmlu_pro_law": 1101,
    "mmlu_pro_math": 1351,
    "mmlu_pro_other": 924,
    "mmlu_pro_philosophy": 499,
    "mmlu_pro_physics": 1299,
    "mmlu_pro_psychology": 798,
}
DEFAULT_CHURN = 0.10
DEFAULT_TASK_OVERHEAD_S = 30.0


@dataclass(frozen=True)
class PlanOptions:
    config: Path
    tok_s: float  # aggregate generated tokens/s of an arm, all rows
    arm_tok_s: dict[str, float] = field(default_factory=dict)  # model abbr -> rate
    previous: Path | None = None  # an earlier run folder of the same config
    task_overhead_s: float | None = (
        None  # per arm: load, start, scoring (None: measured/prior)
    )
    churn: float = DEFAULT_CHURN
    alpha: float = DEFAULT_ALPHA
    fidelity_tok_s: float | None = (
        None  # teacher-forced prompt + positions/s (None: measured)
    )


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


# -- reading the config ---------------------------------------------------------------------------


def load_config(path: Path):
    """The config as `opencompass` reads it; a config that stops (a missing variable) or fails
    to parse is one error naming the file."""
    from mmengine.config import Config  # the [eval] extra; imported only by this verb

    if not path.is_file():
        raise ConfigError(
            f"{path}: config not found; give an OpenCompass config such as "
            f"configs/edge0_35b.py"
        )
    try:
        return Config.fromfile(str(path))
    except SystemExit as exc:  # the tier configs stop on a missing EDGE0_* variable
        raise ConfigError(
            f"{path}: {exc} (the planner reads the config as opencompass does; "
            f"any existing path will do for planning)"
        ) from None
    except Exception as exc:
        raise ConfigError(
            f"{path}: cannot read the config ({type(exc).__name__}: {exc})"
        ) from None


def dataset_abbr(cfg) -> str:
    from opencompass.utils import dataset_abbr_from_cfg

    return dataset_abbr_from_cfg(cfg)


def count_items(cfg) -> tuple[int, str]:
    """(items, where the count came from): built as OpenCompass builds it when its data is
    staged, else the published size (a gate sample: its int test_range of that). A benchmark
    whose data file is missing is never built: OpenCompass would try to download it."""
    from opencompass.utils import build_dataset_from_cfg

    abbr = dataset_abbr(cfg)
    bench = benchmark_for(abbr)
    if abbr == AGREEMENT_ABBR and not (data_root() / AGREEMENT_PATH).is_file():
        return _sampled(cfg, len(agreement_prompts())), "prompts"
    staged = bench.data_path is None or (data_root() / bench.data_path).exists()
    if not staged and abbr in PUBLISHED_ITEMS:
        return _sampled(cfg, PUBLISHED_ITEMS[abbr]), "published"
    if not staged:
        raise ConfigError(
            f"dataset {abbr}: {data_root() / bench.data_path} not found; stage "
            f"it (`edge0-eval data stage`) and point COMPASS_DATA_CACHE at it"
        )
    try:
        return len(build_dataset_from_cfg(cfg).test) // int(cfg.get("n", 1)), "data"
    except Exception as exc:
        raise ConfigError(
            f"dataset {abbr}: its data could not be read ({type(exc).__name__}: "
            f"{str(exc)[:200]}); check the files under {data_root()}"
        ) from None


def _sampled(cfg, items: int) -> int:
    """What OpenCompass's int test_range K leaves of `items` (load_partial_dataset: K when
    0 < K < items, else all)."""
    size = sample_size(cfg)
    return size if size is not None and 0 < size < items else items


def test_range_slice(dataset: dict) -> slice | None:
    """A dataset's `reader_cfg.test_range` ('[a:b]', as OpenCompass slices it; NumWorker
    chunks are such ranges) as a slice."""
    text = (dataset.get("reader_cfg") or {}).get("test_range")
    if not text:
        return None
    match = re.fullmatch(r"\[\s*(-?\d*)\s*:\s*(-?\d*)\s*\]", str(text))
    if not match:
        return None  # another form: check every item, as without a range
    start, stop = (int(v) if v else None for v in match.groups())
    return slice(start, stop)


def population(cfg) -> tuple[int, str]:
    """count_items of the dataset without its test_range: the items a gate samples from."""
    whole = copy.deepcopy(cfg)
    whole["reader_cfg"] = {
        k: v for k, v in whole["reader_cfg"].items() if k != "test_range"
    }
    return count_items(whole)


def fidelity_tokens(part: slice | None = None) -> tuple[int, int] | None:
    """(items, tokens the scorer runs: prompts + teacher-forced positions) of the staged fidelity
    set, or of its items `part` (a chunk's test_range); None when none is staged. Prompts
    count: a set of short continuations after long prompts costs mostly its prefills."""
    path = data_root() / SET_PATH
    if not path.is_file():
        return None
    items = read_set(path)["items"][part or slice(None)]
    return len(items), sum(
        len(item["prompt_ids"]) + len(item["tokens"]) for item in items
    )


def thinking_on(model_cfg) -> bool:
    kwargs = model_cfg.get("chat_template_kwargs") or {}
    return bool(kwargs.get("enable_thinking", False))


# -- the plan ------------------------------------------------------------------------------------


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


def arm_abbr(model_cfg) -> str:
    return model_cfg.get("abbr") or Path(model_cfg["path"]).name


def tokens_per_sample(
    model_cfg,
    abbr: str,
    measured: Measured | None = None,
    positions: int | None = None,
    items: int = 1,
) -> tuple[float, str]:
    """Expected generated tokens per sample of dataset `abbr` on this model, and their source:
    a fidelity set's positions; measured by an earlier run; the thinking-on prior capped at
    max_out_len; else max_out_len itself (an upper bound)."""
    arm, limit = arm_abbr(model_cfg), int(model_cfg.get("max_out_len") or 0)
    bench = benchmark_for(abbr).name
    if positions is not None:
        return positions / max(items, 1), "prompt + positions"
    if measured and (arm, abbr) in measured.tokens:
        return min(measured.tokens[(arm, abbr)], limit or math.inf), "measured"
    if thinking_on(model_cfg) and bench in PRIOR_TOKENS:
        return min(PRIOR_TOKENS[bench], limit or math.inf), "prior"
    return float(limit), "limit"


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
    counted = {}
    for d in datasets:
        abbr = dataset_abbr(d)
        if abbr == FIDELITY_ABBR:
            staged = fidelity_tokens()
            if staged is None:
                notes.append(
                    f"{abbr}: no fidelity set at {data_root() / SET_PATH}; its cost "
                    f"is left out (make one with `edge0-eval fidelity make`)"
                )
                continue
            counted[abbr] = (staged[0], 1, "fidelity set", staged[1])
        else:
            items, source = count_items(d)
            counted[abbr] = (items, int(d.get("n", 1)), source, None)
    lines = []
    for m in models:
        arm = arm_abbr(m)
        for abbr, (items, samples, items_source, positions) in counted.items():
            bench = benchmark_for(abbr).name
            per, source = tokens_per_sample(m, abbr, measured, positions, items)
            rate, rate_source = _rate(opts, measured, arm, abbr)
            if positions is not None and opts.fidelity_tok_s is not None:
                rate, rate_source = opts.fidelity_tok_s, "declared (teacher-forced)"
            tokens = items * samples * per
            lines.append(
                Line(
                    arm,
                    abbr,
                    bench,
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
    power = {}
    for abbr, (items, samples, _, positions) in counted.items():
        if positions is not None:
            continue
        p = power.setdefault(benchmark_for(abbr).name, {"items": 0})
        p["items"] += items
    # The gate's level for each of its tests over these benchmarks (paired.per_test_alpha).
    level = per_test_alpha(opts.alpha, len(power))
    for bench, p in power.items():
        p.update(
            churn=opts.churn,
            alpha=opts.alpha,
            test_alpha=level,
            detectable_drop=detectable_drop(p["items"], opts.churn, level),
        )
        if cfg.get(
            "edge0_gate"
        ):  # a gate config: what its sequential rule detects, too
            p["sequential_drop"] = sequential.detectable_drop(
                p["items"], opts.churn, None, level
            )
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "config", type=Path, help="an OpenCompass config, e.g. configs/edge0_35b.py"
    )
    parser.add_argument(
        "--tok-s",
        type=ct.positive_float,
        default=20.0,
        help="aggregate generated tokens/s of an arm (default 20, the "
        "paper's 35B decode rate); --from measures it per arm instead",
    )
    parser.add_argument(
        "--arm-tok-s",
        action="append",
        default=[],
        metavar="ABBR=R",
        type=ct.named(ct.positive_float, "ABBR"),
        help="one arm's rate (model abbr=tokens/s); repeatable",
    )
    parser.add_argument(
        "--from",
        dest="previous",
        type=Path,
        default=None,
        help="an earlier run folder of this config: measured lengths, rates "
        "and overhead",
    )
    parser.add_argument(
        "--overhead-s",
        type=ct.nonneg_float,
        default=None,
        help=f"seconds per arm besides generation (load, start, scoring); "
        f"default: measured by --from, else {DEFAULT_TASK_OVERHEAD_S:g}",
    )
    parser.add_argument(
        "--churn",
        type=ct.float_range(0.0, 1.0, low_open=True),
        default=DEFAULT_CHURN,
        help="share of items whose outcome changes between two runs of an "
        "unchanged model (default 0.10)",
    )
    parser.add_argument(
        "--alpha",
        type=ct.float_range(0.0, 0.5, low_open=True),
        default=DEFAULT_ALPHA,
        help="the gate's false-fail rate",
    )
    parser.add_argument(
        "--fidelity-tok-s",
        type=ct.positive_float,
        default=None,
        help="teacher-forced scoring rate, prompt and continuation tokens/s "
        "(default: measured by --from, else the arm's rate)",
    )
    parser.add_argument(
        "--json",
        dest="json_path",
        type=ct.output_file,
        default=None,
        help="also write the plan as JSON here",
    )
    parser.add_argument(
        "--size-gate",
        action="store_true",
        help="a gate config: print the sample (`samples`, `drops`) that fits "
        "its edge0_gate budget, to paste into the config",
    )
    parser.add_argument(
        "--size-tok-s",
        type=ct.positive_float,
        default=None,
        help="with --size-gate: the student's tokens/s (default: measured by "
        "--from, else the config's edge0_gate tok_s)",
    )


def run(args: argparse.Namespace) -> int:
    if args.size_gate:
        # plan_gate builds on this module, so it is imported here, not at the top.
        from edge0_eval import plan_gate

        size = plan_gate.size_gate(
            args.config, tok_s=args.size_tok_s, previous=args.previous
        )
        print(plan_gate.render(size, f"edge0-eval plan {args.config} --size-gate"))
        return 0
    opts = PlanOptions(
        config=args.config,
        tok_s=args.tok_s,
        arm_tok_s=dict(args.arm_tok_s),
        previous=args.previous,
        task_overhead_s=args.overhead_s,
        churn=args.churn,
        alpha=args.alpha,
        fidelity_tok_s=args.fidelity_tok_s,
    )
    plan = make_plan(opts)
    print(render(plan))
    if args.json_path:
        Path(args.json_path).write_text(
            json.dumps(asdict(plan), indent=1), encoding="utf-8"
        )
    return 0
