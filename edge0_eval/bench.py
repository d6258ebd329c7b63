"""`edge0-eval bench`: engine arms measured in one process, interleaved, cache state declared.

Arms: `mlx-lm` (mlx-lm's model with every expert resident: the reference), `resident`,
`reactive`, `prerouted`. With `--cache cold` the expert file is evicted from the page cache
before every arm run, so no arm is flattered by another's reads. Besides the arms it measures the
physical limit (raw positioned reads of the same bundle size at the same queue depth) and the
compute-only step time (engine resident mode: every expert already in memory).

`--batch 1,4,8` runs the engine arms at each batch size instead (Engine.generate_batch, B
prompts of --prompt-tokens each, all rows at once), interleaved in every round as the arms are:
aggregate and per-row decode tok/s, bytes read per generated token, the mean union of experts
a layer needed per step, peak memory, with the cache state and any emulation labelled; the
targets give each figure as a ratio to B = 1 of the same run.

`--compare-file-guard` states the cost of the check after every expert read that the file is
unchanged (engine/store.py's FileGuard): each reactive or prerouted arm runs a second time per round
with the check off, the two in alternating order, and the time of one check is measured apart.
"""

from __future__ import annotations

import argparse
import gc
import json
import mmap
import os
import platform
import random
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import generate_step, wired_limit
from mlx_lm.sample_utils import make_sampler

from edge0_eval.arguments import value_types as ct
from edge0_eval.arguments.engine_flags import add_engine_arguments, options_from_args
from edge0_eval.arguments.fields import add_fields, option
from edge0_eval.checkpoints.reference import load_reference
from edge0_eval.engine.engine import Engine
from edge0_eval.engine.store import ExpertStore
from edge0_eval.errors import ConfigError
from edge0_eval.formats.layout import RESIDENT_NAME, ExpertIndex

ARMS = ("mlx-lm", "resident", "compute-only", "reactive", "prerouted")
BATCH_ARMS = ("resident", "reactive", "prerouted")


@dataclass
class BenchOptions:
    """bench's own flags, each declared once (the engine's are EngineOptions' fields)."""

    model: str = option(help="converted model directory", flag="model")
    arms: str | None = option(
        None,
        f"comma list from {', '.join(ARMS)} (default: the --mode arm)",
        type=ct.name_list,
    )
    cache: str = option(
        "cold", "page cache state of the expert file", choices=("cold", "warm")
    )
    tokens: int = option(32, "decode tokens per run", type=ct.positive_int)
    prompt_tokens: int = option(32, "prompt tokens per row", type=ct.positive_int)
    repeats: int = option(1, "interleaved rounds over the arms", type=ct.positive_int)
    batch: list[int] | None = option(
        None,
        "comma list of batch sizes (e.g. 1,4,8): run the engine arms "
        f"({', '.join(BATCH_ARMS)}) batched at each size",
        type=ct.positive_int_list,
    )
    raw_reads: int = option(
        256,
        "bundles read for the raw bandwidth figure (0 skips it)",
        type=ct.nonneg_int,
    )
    emulate_balanced: bool = option(
        False,
        "set the storage throttle so pure read time equals the compute-only "
        "step time (where overlap gains most); figures are labelled emulated",
    )
    compare_mmap: bool = option(
        False, "also copy the same number of random bundles out of an mmap"
    )
    profile: bool = option(
        False,
        "print the split of a decode step per arm: build and eval (the step's "
        "graph building with its waits, and its final evaluation), host (its wall time "
        "outside MLX evaluation and read waits, sampling included) and host_cpu (the "
        "stepping thread's CPU time outside evaluation), ms per step",
    )
    compare: str | None = option(
        None,
        "comma list of other converted models (the same shape in another "
        "quantization): each arm runs on every model in turn, cache evicted before each, "
        "and bytes per token are set against the ratio of their bundle bytes",
    )
    compare_file_guard: bool = option(
        False,
        "also run the reactive and prerouted arms without the check after each "
        "expert read that the file is unchanged (interleaved), and time one check",
    )
    json_path: str | None = option(
        None, "write the report as JSON here", flag="--json", type=ct.output_file
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_fields(parser, BenchOptions)
    add_engine_arguments(parser)


def measure_raw_reads(
    directory, n_reads: int, queue_depth: int, cold: bool, seed: int = 0
) -> dict:
    """Positioned reads of random bundles at `queue_depth`: the storage's physical limit here."""
    # storage only
    store = ExpertStore(directory, io_workers=queue_depth, verify_crc=False)
    try:
        if cold:
            store.evict_page_cache()
        rng = random.Random(seed)
        pairs = [
            (rng.choice(store.index.moe_layers), rng.randrange(store.index.num_experts))
            for _ in range(n_reads)
        ]
        started = time.perf_counter()
        with ThreadPoolExecutor(queue_depth) as pool:
            list(pool.map(lambda p: store.read(*p), pairs))
        elapsed = time.perf_counter() - started
        nbytes = sum(store.index.layout(layer).bundle_stride for layer, _ in pairs)
        return {
            "reads": n_reads,
            "bundle_bytes": nbytes / n_reads,  # the mean, where layers' bundles differ
            "queue_depth": queue_depth,
            "cache": "cold" if cold else "warm",
            "seconds": elapsed,
            "gbps": nbytes / elapsed / 1e9,
            "ms_per_bundle": 1000 * elapsed / n_reads,
        }
    finally:
        store.close()


def measure_mmap_reads(
    directory, n_reads: int, queue_depth: int, cold: bool, seed: int = 0
) -> dict:
    """The same random bundles copied out of an mmap of the file: the alternative to preadv."""
    index = ExpertIndex.load(directory)
    fd = os.open(os.path.join(directory, index.file), os.O_RDONLY)
    try:
        mapped = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        if cold:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        rng = random.Random(seed)
        spans = []
        for _ in range(n_reads):
            layer = rng.choice(index.moe_layers)
            offset = index.bundle_offset(layer, rng.randrange(index.num_experts))
            spans.append((offset, offset + index.layout(layer).bundle_stride))
        copy = lambda span: bytes(mapped[span[0] : span[1]])  # noqa: E731
        started = time.perf_counter()
        with ThreadPoolExecutor(queue_depth) as pool:
            list(pool.map(copy, spans))
        elapsed = time.perf_counter() - started
        mapped.close()
        return {
            "reads": n_reads,
            "queue_depth": queue_depth,
            "cache": "cold" if cold else "warm",
            "gbps": sum(end - start for start, end in spans) / elapsed / 1e9,
        }
    finally:
        os.close(fd)


def _prompt(tokenizer, n: int, row: int = 0) -> list[int]:
    """A prompt of n tokens; each `row` starts further into the text, so rows route apart."""
    text = (
        "The quick brown fox jumps over the lazy dog while experts stream from disk. "
        * 64
    )
    ids = tokenizer.encode(text)
    start = (7 * row) % max(1, len(ids))
    return (ids * ((start + n) // max(1, len(ids)) + 1))[start : start + n]


@contextmanager
def _engine(model_dir, mode: str, args, cold: bool, file_guard: bool = True):
    """The arm's engine, its page cache evicted when `cold`, its counters reset, wired."""
    engine = Engine.load(model_dir, options_from_args(args, mode=mode))
    try:
        engine.store.file_guard = file_guard
        if cold:
            engine.store.evict_page_cache()
        engine.store.reset_stats()
        with wired_limit(engine.model):
            yield engine
    finally:
        engine.close()


def run_engine_arm(
    model_dir, mode: str, args, cold: bool, file_guard: bool = True
) -> dict:
    with _engine(model_dir, mode, args, cold, file_guard) as engine:
        prompt = _prompt(engine.tokenizer, args.prompt_tokens)
        stats = engine.generate(
            prompt, max_tokens=args.tokens, stop_token_ids=set()
        ).stats
    steps = max(1, stats["generated_tokens"] - 1)
    blocked_s = stats["blocked_load_ms_per_step"] * steps / 1000
    stats["blocked_gbps"] = (
        stats["decode_bytes_read"] / blocked_s if blocked_s > 0 else None
    )
    return stats


GUARD_ARMS = ("reactive", "prerouted")
NO_GUARD = " no-file-guard"  # the comparison arm's suffix


def measure_file_guard(directory, checks: int = 100_000) -> dict:
    """Seconds of one FileGuard check (an fstat of the open expert file), timed alone."""
    store = ExpertStore(directory, verify_crc=False)
    try:
        guard = store._guard
        started = time.perf_counter()
        for _ in range(checks):
            guard.check()
        elapsed = time.perf_counter() - started
    finally:
        store.close()
    return {"checks": checks, "us_per_check": 1e6 * elapsed / checks}


def run_batch_arm(model_dir, mode: str, args, cold: bool, batch: int) -> dict:
    """`batch` prompts decoded together: the batch's figures, and every row's decode rate."""
    with _engine(model_dir, mode, args, cold) as engine:
        prompts = [
            _prompt(engine.tokenizer, args.prompt_tokens, row) for row in range(batch)
        ]
        results = engine.generate_batch(
            prompts, max_tokens=args.tokens, batch_size=batch, stop_token_ids=set()
        )
    stats = dict(results[0].stats)
    rows = [r.stats for r in results]
    row_rates = [r["decode_tok_s"] for r in rows]
    stats.update(
        {
            "batch": batch,
            # aggregate, every row's tokens
            "decode_tok_s": stats["batch_decode_tok_s"],
            "row_decode_tok_s": row_rates,
            "mean_row_decode_tok_s": sum(row_rates) / len(row_rates),
            "prefill_tok_s": sum(r["prompt_tokens"] for r in rows)
            / stats["batch_prefill_s"],
            "generated_tokens": stats["batch_generated_tokens"],
        }
    )
    return stats


def run_compute_only_arm(model_dir, args) -> dict:
    """Decode with every needed expert already in the slots: the same greedy run twice, with
    room for every expert the run touches; the second run reads nothing."""
    options = options_from_args(
        args, mode="reactive", expert_budget_mib=None, slots_per_layer=None
    )
    resolved = options.resolve(model_dir)
    options.slots_per_layer = min(
        resolved.num_experts,
        (args.prompt_tokens + args.tokens + 1) * resolved.experts_per_token,
    )
    engine = Engine.load(model_dir, options)
    try:
        prompt = _prompt(engine.tokenizer, args.prompt_tokens)
        with wired_limit(engine.model):
            engine.generate(prompt, max_tokens=args.tokens, stop_token_ids=set())
            stats = engine.generate(
                prompt, max_tokens=args.tokens, stop_token_ids=set()
            ).stats
        stats["mode"] = "compute-only"
        if stats["decode_bytes_read"]:
            stats["note"] = "some experts were read: not purely compute"
        return stats
    finally:
        engine.close()


def run_mlx_lm_arm(model_dir, args) -> dict:
    mx.reset_peak_memory()
    model, tokenizer = load_reference(
        model_dir,
        compute_dtype=args.compute_dtype,
        experts_per_token=args.experts_per_token,
    )
    prompt = mx.array(_prompt(tokenizer, args.prompt_tokens))
    times = []
    with wired_limit(model):  # as mlx-lm's own generate runs generate_step
        started = time.perf_counter()
        for _, _ in zip(
            range(args.tokens),
            generate_step(
                prompt, model, max_tokens=args.tokens, sampler=make_sampler(0.0)
            ),
        ):
            times.append(time.perf_counter())
    prefill = times[0] - started
    decode = times[-1] - times[0]
    steps = len(times) - 1
    return {
        "mode": "mlx-lm",
        "generated_tokens": len(times),
        "prefill_tok_s": args.prompt_tokens / prefill,
        "decode_tok_s": steps / decode if steps and decode > 0 else 0.0,
        "peak_memory_gib": mx.get_peak_memory() / 2**30,
        "bytes_per_token": 0.0,
        "blocked_load_ms_per_step": 0.0,
    }


# (header, key, format) of each column of the table of single-row runs, and of batched ones
COLUMNS = [
    ("arm", "arm", "{}"),
    ("cache", "cache", "{}"),
    ("decode tok/s", "decode_tok_s", "{:.2f}"),
    ("prefill tok/s", "prefill_tok_s", "{:.1f}"),
    ("peak GiB", "peak_memory_gib", "{:.3f}"),
    ("RSS GiB", "rss_gib", "{:.3f}"),
    ("MiB/token", "bytes_per_token", "{:.2f}"),
    ("blocked ms/step", "blocked_load_ms_per_step", "{:.2f}"),
    ("hit rate", "decode_hit_rate", "{:.2f}"),
    ("dropped", "dropped_experts", "{}"),
]
BATCH_COLUMNS = [
    ("arm", "mode", "{}"),
    ("B", "batch", "{}"),
    ("cache", "cache", "{}"),
    ("aggregate tok/s", "decode_tok_s", "{:.2f}"),
    ("per-row tok/s", "mean_row_decode_tok_s", "{:.2f}"),
    ("MiB/token", "bytes_per_token", "{:.2f}"),
    ("union/layer", "mean_union_per_layer", "{:.2f}"),
    ("peak GiB", "peak_memory_gib", "{:.3f}"),
    ("blocked ms/step", "blocked_load_ms_per_step", "{:.2f}"),
    ("slot MiB", "expert_buffer_mib", "{:.1f}"),
    ("storage", "storage", "{}"),
]


def _print_rows(
    cols: list[tuple[str, str, str]], rows: list[dict], by_model: bool
) -> None:
    """One line per row, the model's label first when several are benched, bytes_per_token
    shown in MiB."""
    if by_model:
        cols = [("model", "model", "{}"), *cols]
    print(" | ".join(c[0] for c in cols))
    for row in rows:
        cells = []
        for _, key, fmt in cols:
            value = row.get(key)
            if key == "bytes_per_token" and value is not None:
                value = value / 2**20
            cells.append("-" if value is None else fmt.format(value))
        print(" | ".join(cells))


def _models(args) -> dict[str, str]:
    """label -> directory of the benched models: MODEL, then --compare's, in order."""
    paths = [str(args.model)] + [
        p for p in (args.compare or "").split(",") if p.strip()
    ]
    labels = {}
    for i, path in enumerate(paths):
        label = Path(path).name or path
        labels[label if label not in labels else f"{label}#{i}"] = path
    return labels


def _storage_figures(path, args, cold: bool) -> dict:
    """A model's checkpoint bytes, expert quantization and raw read bandwidth, printed."""
    index = ExpertIndex.load(path)
    out = {
        "path": str(path),
        "experts": index.describe_quant(),
        "slot_bytes": index.slot_bytes,
        "checkpoint_bytes": checkpoint_bytes(path),
    }
    if args.raw_reads:
        r = out["raw_reads"] = measure_raw_reads(
            path, args.raw_reads, args.io_workers, cold
        )
        print(
            f"raw positioned reads of {Path(path).name} ({r['cache']}, qd "
            f"{r['queue_depth']}, {r['bundle_bytes'] / 2**20:.2f} MiB bundles): "
            f"{r['gbps']:.2f} GB/s, {r['ms_per_bundle']:.2f} ms/bundle"
        )
        if args.compare_mmap:
            m = out["mmap_reads"] = measure_mmap_reads(
                path, args.raw_reads, args.io_workers, cold, seed=1
            )
            print(
                f"same reads through mmap ({m['cache']}, qd {m['queue_depth']}): "
                f"{m['gbps']:.2f} GB/s"
            )
    return out


def _check(args) -> tuple[list[str], bool, dict[str, str]]:
    """The arms, whether the cache is cold, and the models, refusing what cannot run."""
    arms = (args.arms or args.mode).split(",")
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        raise ConfigError(f"unknown arm(s) {unknown}; choose from {', '.join(ARMS)}")
    if args.batch and any(a not in BATCH_ARMS for a in arms):
        raise ConfigError(
            f"--batch runs the engine arms {', '.join(BATCH_ARMS)}; drop "
            f"{', '.join(a for a in arms if a not in BATCH_ARMS)} from --arms "
            f"(run them in a bench without --batch)"
        )
    cold = args.cache == "cold"
    if cold and not hasattr(os, "posix_fadvise"):
        raise ConfigError(
            "--cache cold needs posix_fadvise (Linux); on macOS use --cache warm "
            "or purge the page cache yourself"
        )
    models = _models(args)
    if len(models) > 1 and args.emulate_balanced:
        raise ConfigError(
            "--emulate-balanced sets one storage speed from one model's step; drop "
            "--compare, or give --io-throttle-mbps for every model alike"
        )
    if args.compare_file_guard and args.batch:
        raise ConfigError(
            "--compare-file-guard compares single-row decodes; drop --batch"
        )
    return arms, cold, models


def run(args: argparse.Namespace) -> int:
    arms, cold, models = _check(args)
    report = {
        "command": "edge0-eval bench " + " ".join(_argv_echo(args)),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} {platform.system()} {os.cpu_count()} cores, "
        f"mlx {mx.__version__} device {mx.default_device()}",
        "cache": args.cache,
        "io_throttle_mbps": args.io_throttle_mbps,
        "emulated": args.io_throttle_mbps is not None,
        "runs": [],
    }
    figures = {label: _storage_figures(p, args, cold) for label, p in models.items()}
    if len(models) == 1:
        (first,) = figures.values()
        report["checkpoint_bytes"] = first["checkpoint_bytes"]
        report.update({k: first[k] for k in ("raw_reads", "mmap_reads") if k in first})
    else:
        report["models"] = figures
    if args.emulate_balanced:
        args.io_throttle_mbps = _balanced_throttle(args, cold)
        report["emulated"], report["io_throttle_mbps"] = True, args.io_throttle_mbps
        print(
            f"storage emulation: {args.io_throttle_mbps:.1f} MB/s makes pure read time equal "
            f"the compute-only step time"
        )
    if args.compare_file_guard:
        report["file_guard"] = measure_file_guard(args.model)
    storage = _run_rounds(args, arms, cold, models, report)
    print(f"cache: {args.cache}; storage: {storage}")
    if len(models) > 1:
        for label, f in figures.items():
            print(f"model {label}: experts {f['experts']}")
    if args.batch:
        report["batch_prompts"] = (
            f"B prompts of {args.prompt_tokens} tokens, each starting "
            f"further into the same text; all B rows decode at once"
        )
    columns = BATCH_COLUMNS if args.batch else COLUMNS
    _print_rows(columns, report["runs"], len(models) > 1)
    if args.profile:
        _print_profiles(report["runs"])
    report["targets"] = compare_targets(report) if len(models) > 1 else targets(report)
    for name, value in report["targets"].items():
        print(f"target {name}: {value}")
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(report, f, indent=1, default=str)
    return 0


def _run_rounds(args, arms, cold: bool, models: dict[str, str], report: dict) -> str:
    """Every round of every batch size, arm and model, rows into `report`; the storage."""
    emulated = report["emulated"]
    storage = f"EMULATED at {args.io_throttle_mbps:g} MB/s" if emulated else "real disk"
    for round_ in range(args.repeats):
        for batch in args.batch or [None]:
            for arm in _round_arms(arms, args.compare_file_guard, round_):
                for label, model in models.items():
                    row = _run_arm(model, arm, args, cold, batch)
                    # Free the arm's engine before the next: its buffers must not count there.
                    gc.collect()
                    mx.clear_cache()
                    warm = arm in ("mlx-lm", "compute-only", "resident")
                    row.update(
                        {
                            "arm": arm,
                            "round": round_,
                            "cache": "warm (experts in memory)" if warm else args.cache,
                            "emulated": emulated and not warm,
                            "storage": "in memory" if warm else storage,
                        }
                    )
                    if len(models) > 1:
                        row["model"] = label
                    report["runs"].append(row)
    return storage


def _print_profiles(rows: list[dict]) -> None:
    """The split of a decode step, per arm that profiled it."""
    for row in rows:
        if "profile_ms_per_step" not in row:
            continue
        prof = ", ".join(f"{k} {v:.2f}" for k, v in row["profile_ms_per_step"].items())
        extra = ""
        if "stage_wait_ms_per_step" in row:
            extra = (
                f", stage wait {row['stage_wait_ms_per_step']:.2f}, heads host "
                f"{row['head_host_ms_per_step']:.2f}, staged loads/step "
                f"{row['staged_loads_per_step']:.1f}, early evals/step "
                f"{row['early_evals_per_step']:.1f}"
            )
            if row.get("online_recall") is not None:
                extra += f", online recall {row['online_recall']:.3f}"
            if row.get("hedge_precision") is not None:
                extra += (
                    f", hedge {row['hedge_kind']} precision "
                    f"{row['hedge_precision']:.3f} (layers {len(row['hedge_layers'])}, "
                    f"heads host {row['hedge_host_ms_per_step']:.2f} ms, wasted "
                    f"loads/step {row['hedge_wasted_loads_per_step']:.1f}, "
                    f"cancelled/step {row['hedge_cancelled_per_step']:.1f})"
                )
            if row.get("draft_match_rate") is not None:
                extra += f", draft = token {row['draft_match_rate']:.3f}"
        model = f" {row['model']}" if "model" in row else ""
        print(f"profile {row['arm']}{model} (ms/step): {prof}{extra}")


def _run_arm(model, arm: str, args, cold: bool, batch: int | None) -> dict:
    if batch is not None:
        return run_batch_arm(model, arm, args, cold, batch)
    if arm == "mlx-lm":
        return run_mlx_lm_arm(model, args)
    if arm == "compute-only":
        return run_compute_only_arm(model, args)
    if arm.endswith(NO_GUARD):
        return run_engine_arm(
            model, arm[: -len(NO_GUARD)], args, cold, file_guard=False
        )
    return run_engine_arm(model, arm, args, cold)


def _round_arms(arms: list[str], compare_guard: bool, round_: int) -> list[str]:
    """The arms of one round; with the file-guard comparison each reactive or prerouted arm
    is followed (even rounds) or preceded (odd rounds) by its run without the check."""
    if not compare_guard:
        return arms
    out = []
    for arm in arms:
        pair = [arm, arm + NO_GUARD] if arm in GUARD_ARMS else [arm]
        out += pair if round_ % 2 == 0 else pair[::-1]
    return out


def _argv_echo(args: argparse.Namespace) -> list[str]:
    """The options as flags that re-run this bench (a dest is not always its flag's name:
    `prerouter_path` is `--prerouter`)."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    actions = {a.dest: a for a in parser._actions if a.option_strings}
    out = [str(args.model)]
    for key, value in sorted(vars(args).items()):
        action = actions.get(key)
        if action is None or key == "json_path":
            continue
        if action.nargs == 0:  # a switch: echoed when away from its default
            if value != action.default:
                on = value or not isinstance(action, argparse.BooleanOptionalAction)
                out.append(action.option_strings[0 if on else 1])
        elif value is not None:
            if isinstance(value, list):
                value = ",".join(str(v) for v in value)
            out.append(f"{max(action.option_strings, key=len)} {value}")
    return out


def _balanced_throttle(args, cold: bool) -> float:
    """MB/s at which reading one decode step's bytes takes one compute-only step."""
    compute = run_compute_only_arm(args.model, args)
    reactive = run_engine_arm(args.model, "reactive", args, cold)
    step_s = 1.0 / compute["decode_tok_s"]
    return reactive["bytes_per_token"] / step_s / 1e6


def checkpoint_bytes(model_dir) -> int:
    """Bytes of the converted checkpoint's weights: the expert file plus the resident file."""
    index = ExpertIndex.load(model_dir)
    return sum(
        p.stat().st_size
        for p in (Path(model_dir) / index.file, Path(model_dir) / RESIDENT_NAME)
    )


def _mean(rows, arm, key, **match):
    """The mean of `key` over `arm`'s rows whose other fields equal `match` (absent: None)."""
    match["arm"] = arm
    values = [
        r[key]
        for r in rows
        if r.get(key) is not None and all(r.get(k) == v for k, v in match.items())
    ]
    return sum(values) / len(values) if values else None


BATCH_RATIOS = {
    "decode": "decode_tok_s",
    "row_decode": "mean_row_decode_tok_s",
    "bytes_per_token": "bytes_per_token",
    "union": "mean_union_per_layer",
    "peak": "peak_memory_gib",
}


def batch_targets(report: dict) -> dict:
    """Each batched figure as a ratio to B = 1 of the same arm in the same run."""
    rows, out = report["runs"], {}
    sizes = sorted({r["batch"] for r in rows if r.get("batch") is not None})
    if 1 not in sizes:
        return (
            {"note": "no B = 1 runs: ratios to B = 1 need 1 in --batch"}
            if sizes
            else {}
        )
    for arm in sorted({r["arm"] for r in rows if r.get("batch") is not None}):
        for batch in (b for b in sizes if b != 1):
            for name, key in BATCH_RATIOS.items():
                base = _mean(rows, arm, key, batch=1)
                value = _mean(rows, arm, key, batch=batch)
                if base and value is not None:
                    out[f"{arm}_b{batch}_over_b1_{name}"] = round(value / base, 3)
    if report.get("emulated"):
        out["note"] = f"storage emulated at {report['io_throttle_mbps']:.1f} MB/s"
    return out


def targets(report: dict) -> dict:
    """Speed and memory ratios from this run's arms (absent arms: not computed)."""
    rows, out = report["runs"], {}
    if any(r.get("batch") is not None for r in rows):
        return batch_targets(report)
    pre_tps = _mean(rows, "prerouted", "decode_tok_s")
    rea_tps = _mean(rows, "reactive", "decode_tok_s")
    comp_tps = _mean(rows, "compute-only", "decode_tok_s")
    raw = report.get("raw_reads")
    if pre_tps and comp_tps and raw:
        bytes_tok = _mean(rows, "prerouted", "bytes_per_token")
        read_s = bytes_tok / (raw["gbps"] * 1e9)
        bound = max(1 / comp_tps, read_s)
        out["prerouted_step_over_bound"] = round((1 / pre_tps) / bound, 3)
        out["bound_ms"] = round(1000 * bound, 2)
    pre_b = _mean(rows, "prerouted", "blocked_load_ms_per_step")
    rea_b = _mean(rows, "reactive", "blocked_load_ms_per_step")
    if pre_b is not None and rea_b:
        out["blocked_prerouted_over_reactive"] = round(pre_b / rea_b, 3)
    if pre_tps and rea_tps:
        out["decode_prerouted_over_reactive"] = round(pre_tps / rea_tps, 3)
    res_tps = _mean(rows, "resident", "decode_tok_s")
    ref_tps = _mean(rows, "mlx-lm", "decode_tok_s")
    if res_tps and ref_tps:
        out["warm_engine_over_mlx_lm"] = round(res_tps / ref_tps, 3)
    res_pre = _mean(rows, "resident", "prefill_tok_s")
    ref_pre = _mean(rows, "mlx-lm", "prefill_tok_s")
    if res_pre and ref_pre:
        out["warm_prefill_engine_over_mlx_lm"] = round(res_pre / ref_pre, 3)
    achieved = _mean(rows, "reactive", "demand_read_gbps")
    if achieved and raw:
        out["reactive_read_gbps_over_raw"] = round(achieved / raw["gbps"], 3)
    total = report.get("checkpoint_bytes")
    for arm in ("reactive", "prerouted"):
        peak = _mean(rows, arm, "peak_memory_gib")
        if peak and total:
            out[f"peak_{arm}_over_checkpoint"] = round(peak * 2**30 / total, 4)
    out.update(file_guard_targets(report))
    if report.get("emulated"):
        out["note"] = f"storage emulated at {report['io_throttle_mbps']:.1f} MB/s"
    return out


def compare_targets(report: dict) -> dict:
    """Several models in one bench: each model's own targets (prefixed with its label), and
    per engine arm every other model's bytes read and decode rate against the first's, beside
    the ratio of their bundle bytes (a slot in every layer): reads in proportion to the bits
    give a bytes ratio equal to the bundle ratio."""
    models, out = report["models"], {}
    for label, figures in models.items():
        sub = {
            **{k: v for k, v in report.items() if k not in ("models", "runs")},
            **{
                k: figures[k] for k in ("checkpoint_bytes", "raw_reads") if k in figures
            },
            "runs": [r for r in report["runs"] if r.get("model") == label],
        }
        out.update({f"{label}: {k}": v for k, v in targets(sub).items()})
    first, *others = models
    for label in others:
        bundles = models[label]["slot_bytes"] / models[first]["slot_bytes"]
        out[f"bundle_bytes {label} over {first}"] = round(bundles, 4)
        for arm in ("reactive", "prerouted", "resident"):
            for key, digits in (("bytes_per_token", 4), ("decode_tok_s", 3)):
                base = _mean(report["runs"], arm, key, model=first)
                value = _mean(report["runs"], arm, key, model=label)
                if not base or value is None:
                    continue
                name = f"{arm} {key} {label} over {first}"
                out[name] = round(value / base, digits)
                if key == "bytes_per_token":
                    out[f"{name} / bundle ratio"] = round(value / base / bundles, 4)
    return out


def file_guard_targets(report: dict) -> dict:
    """Per guarded arm: decode tok/s with the check over without it (same run, interleaved),
    and the check's time per token from its measured cost x the arm's reads per token."""
    guard, rows, out = report.get("file_guard"), report["runs"], {}
    if guard is None:
        return out
    out["file_guard_us_per_check"] = round(guard["us_per_check"], 3)
    for arm in GUARD_ARMS:
        on = _mean(rows, arm, "decode_tok_s")
        off = _mean(rows, arm + NO_GUARD, "decode_tok_s")
        reads = _mean(rows, arm, "reads_per_token")
        if on and off:
            out[f"file_guard_{arm}_decode_over_unguarded"] = round(on / off, 3)
        if on and reads is not None:
            ms = reads * guard["us_per_check"] / 1000
            out[f"file_guard_{arm}_ms_per_token"] = round(ms, 4)
            out[f"file_guard_{arm}_share_of_step"] = round(ms * on / 1000, 5)
    return out
