"""`edge0-eval bench`: engine arms measured in one process, interleaved, cache state declared.

Arms: `mlx-lm` (mlx-lm's model with every expert resident: the reference), `resident`,
`reactive`, `prerouted`. With `--cache cold` the expert file is evicted from the page cache
before every arm run, so no arm is flattered by another's reads. Besides the arms it measures the
physical limit (raw positioned reads of the same bundle size at the same queue depth) and the
compute-only step time (engine resident mode: every expert already in memory).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone

import mlx.core as mx

from edge0_eval.cli_options import add_engine_arguments, options_from_args
from edge0_eval.errors import ConfigError

ARMS = ("mlx-lm", "resident", "reactive", "prerouted")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="converted model directory")
    parser.add_argument("--arms", default=None,
                        help=f"comma list from {', '.join(ARMS)} (default: the --mode arm)")
    parser.add_argument("--cache", choices=("cold", "warm"), default="cold")
    parser.add_argument("--tokens", type=int, default=32, help="decode tokens per run")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=1, help="interleaved rounds over the arms")
    parser.add_argument("--raw-reads", type=int, default=256,
                        help="bundles read for the raw bandwidth figure (0 skips it)")
    parser.add_argument("--json", dest="json_path", default=None)
    add_engine_arguments(parser)


def measure_raw_reads(directory, n_reads: int, queue_depth: int, cold: bool, seed: int = 0) -> dict:
    """Positioned reads of random bundles at `queue_depth`: the storage's physical limit here."""
    from edge0_eval.store import ExpertStore

    store = ExpertStore(directory, io_workers=queue_depth)
    try:
        if cold:
            store.evict_page_cache()
        rng = random.Random(seed)
        pairs = [(rng.choice(store.index.moe_layers), rng.randrange(store.index.num_experts))
                 for _ in range(n_reads)]
        started = time.perf_counter()
        with ThreadPoolExecutor(queue_depth) as pool:
            list(pool.map(lambda p: store.read(*p), pairs))
        elapsed = time.perf_counter() - started
        nbytes = n_reads * store.index.bundle_stride
        return {"reads": n_reads, "bundle_bytes": store.index.bundle_stride,
                "queue_depth": queue_depth, "cache": "cold" if cold else "warm",
                "seconds": elapsed, "gbps": nbytes / elapsed / 1e9,
                "ms_per_bundle": 1000 * elapsed / n_reads}
    finally:
        store.close()


def _prompt(tokenizer, n: int) -> list[int]:
    text = ("The quick brown fox jumps over the lazy dog while experts stream from disk. " * 64)
    ids = tokenizer.encode(text)
    return (ids * (n // max(1, len(ids)) + 1))[:n]


def run_engine_arm(model_dir, mode: str, args, cold: bool) -> dict:
    from edge0_eval.engine import Engine

    options = options_from_args(args, mode=mode)
    engine = Engine.load(model_dir, options)
    try:
        if cold:
            engine.store.evict_page_cache()
        engine.store.reset_stats()
        prompt = _prompt(engine.tokenizer, args.prompt_tokens)
        result = engine.generate(prompt, max_tokens=args.tokens, stop_token_ids=set())
        stats = result.stats
        stats["blocked_gbps"] = (stats["decode_bytes_read"] / (stats["blocked_load_ms_per_step"]
                                 * max(1, stats["generated_tokens"] - 1) / 1000)
                                 if stats["blocked_load_ms_per_step"] > 0 else None)
        return stats
    finally:
        engine.close()


def run_mlx_lm_arm(model_dir, args) -> dict:
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    from edge0_eval.reference import load_reference

    mx.reset_peak_memory()
    model, tokenizer = load_reference(model_dir)
    prompt = mx.array(_prompt(tokenizer, args.prompt_tokens))
    times = []
    started = time.perf_counter()
    for _, _ in zip(range(args.tokens), generate_step(prompt, model, max_tokens=args.tokens,
                                                      sampler=make_sampler(0.0))):
        times.append(time.perf_counter())
    prefill = times[0] - started
    decode = times[-1] - times[0]
    steps = len(times) - 1
    return {"mode": "mlx-lm", "generated_tokens": len(times),
            "prefill_tok_s": args.prompt_tokens / prefill,
            "decode_tok_s": steps / decode if steps and decode > 0 else 0.0,
            "peak_memory_gib": mx.get_peak_memory() / 2**30, "bytes_per_token": 0.0,
            "blocked_load_ms_per_step": 0.0}


def _print_table(rows: list[dict]) -> None:
    cols = [("arm", "mode", "{}"), ("cache", "cache", "{}"), ("decode tok/s", "decode_tok_s", "{:.2f}"),
            ("prefill tok/s", "prefill_tok_s", "{:.1f}"), ("peak GiB", "peak_memory_gib", "{:.3f}"),
            ("RSS GiB", "rss_gib", "{:.3f}"), ("MiB/token", "bytes_per_token", "{:.2f}"),
            ("blocked ms/step", "blocked_load_ms_per_step", "{:.2f}"),
            ("hit rate", "decode_hit_rate", "{:.2f}"), ("dropped", "dropped_experts", "{}")]
    print(" | ".join(c[0] for c in cols))
    for row in rows:
        cells = []
        for _, key, fmt in cols:
            value = row.get(key)
            if key == "bytes_per_token" and value is not None:
                value = value / 2**20
            cells.append("-" if value is None else fmt.format(value))
        print(" | ".join(cells))


def run(args: argparse.Namespace) -> int:
    arms = (args.arms or args.mode).split(",")
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        raise ConfigError(f"unknown arm(s) {unknown}; choose from {', '.join(ARMS)}")
    cold = args.cache == "cold"
    if cold and not hasattr(os, "posix_fadvise"):
        raise ConfigError("--cache cold needs posix_fadvise (Linux); on macOS use --cache warm "
                          "or purge the page cache yourself")
    emulated = args.io_throttle_mbps is not None
    report = {
        "command": "edge0-eval bench " + " ".join(_argv_echo(args)),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} {platform.system()} {os.cpu_count()} cores, "
                   f"mlx {mx.__version__} device {mx.default_device()}",
        "cache": args.cache, "io_throttle_mbps": args.io_throttle_mbps, "emulated": emulated,
        "runs": [],
    }
    if args.raw_reads:
        report["raw_reads"] = measure_raw_reads(args.model, args.raw_reads, args.io_workers, cold)
        r = report["raw_reads"]
        print(f"raw positioned reads ({r['cache']}, qd {r['queue_depth']}, "
              f"{r['bundle_bytes'] / 2**20:.2f} MiB bundles): {r['gbps']:.2f} GB/s, "
              f"{r['ms_per_bundle']:.2f} ms/bundle")
    for round_ in range(args.repeats):
        for arm in arms:
            row = (run_mlx_lm_arm(args.model, args) if arm == "mlx-lm"
                   else run_engine_arm(args.model, arm, args, cold))
            row.update({"arm": arm, "round": round_, "cache": args.cache if arm != "mlx-lm"
                        else "warm (all experts loaded)", "emulated": emulated})
            report["runs"].append(row)
    print(f"cache: {args.cache}; storage: "
          + (f"EMULATED at {args.io_throttle_mbps:g} MB/s" if emulated else "real disk"))
    _print_table(report["runs"])
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(report, f, indent=1, default=str)
    return 0


def _argv_echo(args: argparse.Namespace) -> list[str]:
    out = [str(args.model)]
    for key, value in sorted(vars(args).items()):
        if key in ("model", "json_path") or value in (None, False):
            continue
        out.append(f"--{key.replace('_', '-')}" + ("" if value is True else f" {value}"))
    return out
