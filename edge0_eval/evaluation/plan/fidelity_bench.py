"""`edge0-eval fidelity bench MODEL`: teacher-forced scoring speed and reads, by scorer.

Arms in one process, interleaved (their order alternating by round), on the same seeded prompts
and continuations (random ids: speed does not depend on the text, and a synthetic model has no
teacher):
  steps        one decode step per position (`Sequence.step`; mlx-lm's one-token calls for a
               teacher), each prompt prefilled first: fidelity scoring before pieces
  pieces       pieces of `--chunk` positions (`Sequence.forced`), one prompt at a time
  layer-major  all `--prompts` prompts together, one layer at a time (engine/layer_major.py)
steps and pieces score the first `--steps-prompts` prompts (a subset: they cost the same per
prompt whatever the batch); layer-major scores all of them. Each arm's log-prob rows on the
subset are compared with steps': bit-identical, or the largest difference (half precision;
bailing_hybrid's pieces).

Figures per arm: scored positions per second (prefill included: what a fidelity run pays),
apart as prompt tokens/s and positions/s (`LayerMajorStats.rates`; steps and pieces: their
prefill and their continuation), and bytes read from the expert file per scored position
(the store's counter); against steps, the speed ratio and steps' bytes over the arm's.
`--json` writes them; `edge0-eval plan --fidelity-rate FILE` prices fidelity from it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from datetime import datetime, timezone

import mlx.core as mx
import numpy as np
from mlx_lm.generate import wired_limit

from edge0_eval.engine.engine import Engine, EngineOptions
from edge0_eval.engine.layer_major import (
    Forced,
    LayerMajor,
    LayerMajorStats,
)
from edge0_eval.engine.mlx_compat import activation_dtype
from edge0_eval.errors import ConfigError
from edge0_eval.evaluation.fidelity.scoring import (
    EngineRunner,
    MLXRunner,
    _logprobs,
    load_teacher,
)
from edge0_eval.evaluation.plan.planner import FIDELITY_BENCH_FORMAT, PRICED_SCORER

ARMS = ("steps", "pieces", PRICED_SCORER)


def _tokens(vocab: int, n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, vocab, size=n)]


def _stepwise(runner, arm: str, items: list[Forced], chunk: int, wrap_pieces: bool):
    """steps or pieces over `items`, one prompt after another: (prefill s, scoring s, rows)."""
    prefill = score = 0.0
    rows = []
    for item in items:
        t0 = time.perf_counter()
        got = [runner.start(item.prompt)]
        t1 = time.perf_counter()
        if arm == "steps":
            got += [runner.advance(t) for t in item.tokens[:-1]]
        else:
            pieces = runner.sequence.forced if wrap_pieces else runner.forced
            got += [
                lp
                for logits in pieces(item.tokens[:-1], chunk)
                for lp in _logprobs(logits)
            ]
        prefill += t1 - t0
        score += time.perf_counter() - t1
        rows.append(np.stack(got))
    return prefill, score, rows


def _layer_major(scorer: LayerMajor, items: list[Forced], keep: int):
    """All `items` layer-major: (seconds, rows of the first `keep` items)."""
    rows = [[None] * len(i.tokens) for i in items[:keep]]
    started = time.perf_counter()
    for index, first, lp in scorer.rows(items):
        if index < keep:
            rows[index][first : first + len(lp)] = list(lp)
        else:
            lp.argmax(axis=-1)  # what a scorer does with a row it keeps only ids of
    seconds = time.perf_counter() - started
    return seconds, [np.stack(r) for r in rows]


def run(args: argparse.Namespace, options: EngineOptions) -> int:
    """The bench of `args` (fidelity.py's `bench` parser); `options`: the engine's, resolved
    from the same arguments by the verb."""
    arms = [a.strip() for a in str(args.arms).split(",") if a.strip()]
    unknown = [a for a in arms if a not in ARMS]
    if unknown or not arms:
        raise ConfigError(f"--arms {args.arms!r}: choose from {', '.join(ARMS)}")
    if args.steps_prompts > args.prompts:
        raise ConfigError(
            f"--steps-prompts {args.steps_prompts} is more than --prompts "
            f"{args.prompts}: the subset is of the batch"
        )
    if args.teacher:
        model, tokenizer = load_teacher(args.model, args.compute_dtype)
        runner, engine = MLXRunner(model), None
        scorer = LayerMajor.for_mlx_lm(
            model, cuts=MLXRunner.cuts, memory_mib=args.score_mib, window=args.window
        )
    else:
        engine = Engine.load(args.model, options)
        runner, tokenizer = EngineRunner(engine), engine.tokenizer
        scorer = LayerMajor.for_engine(
            engine, memory_mib=args.score_mib, window=args.window
        )
    vocab = tokenizer.vocab_size  # within the model's embedding
    items = [
        Forced(
            _tokens(vocab, args.prompt_tokens, 1 + 2 * i),
            _tokens(vocab, args.positions, 2 + 2 * i),
        )
        for i in range(args.prompts)
    ]
    rounds = []
    with wired_limit(runner.module):
        for r in range(args.rounds):
            # Arms alternate their order each round, so neither always runs warm.
            order = arms if r % 2 == 0 else arms[::-1]
            got = {arm: _arm(args, arm, runner, engine, scorer, items) for arm in order}
            rounds.append(_round_figures(got, order))
            print(
                f"round {r + 1}: " + "; ".join(_arm_line(rounds[-1], a) for a in arms)
            )
    out = _summary(args, arms, rounds, engine, scorer)
    if engine is not None:
        engine.close()
    _print_summary(out)
    if args.json_path:
        with open(args.json_path, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1)
    return 0


def _arm(args, arm: str, runner, engine, scorer, items: list[Forced]) -> dict:
    """One arm's run over the items (the stepwise arms over the --steps-prompts subset)."""
    subset = items[: args.steps_prompts]
    if engine is not None and args.cache == "cold":
        engine.store.evict_page_cache()
    before = engine.snapshot()["bytes"] if engine is not None else 0
    mx.reset_peak_memory()
    if arm == PRICED_SCORER:
        scorer.stats = LayerMajorStats()  # this run's figures alone
        seconds, rows = _layer_major(scorer, items, len(subset))
        done, prefill = items, None
    else:
        wrap = args.wrap_pieces and engine is not None
        prefill, score, rows = _stepwise(runner, arm, subset, args.chunk, wrap)
        seconds, done = prefill + score, subset
    scored = sum(len(i.tokens) for i in done)
    g = {
        "prompts": len(done),
        "scored_positions": scored,
        "seconds": seconds,
        "positions_per_s": scored / seconds,
        "peak_memory_gib": mx.get_peak_memory() / 2**30,
        "rows": rows,
    }
    if prefill is not None:
        g["prompt_tokens_per_s"] = sum(len(i.prompt) for i in done) / prefill
        g["continuation_positions_per_s"] = scored / (seconds - prefill)
    if engine is not None:
        g["bytes_read"] = engine.snapshot()["bytes"] - before
        g["bytes_per_position"] = g["bytes_read"] / scored
    return g


def _arm_line(figures: dict, arm: str) -> str:
    g = figures[arm]
    line = f"{arm} {g['positions_per_s']:.3f} positions/s"
    if "bytes_per_position" in g:
        line += f", {g['bytes_per_position'] / 2**20:.3f} MiB/pos"
    if arm != "steps" and "steps" in figures:
        line += f", max |d log-prob| vs steps {g['max_abs_logprob_diff']:.3g}"
    return line


def _round_figures(got: dict, order) -> dict:
    """One round's figures; each arm's rows compared with steps' (on the subset)."""
    want = got["steps"]["rows"] if "steps" in got else None
    out = {"order": list(order)}
    for arm, g in got.items():
        rows = g.pop("rows")
        if want is not None and arm != "steps":
            g["max_abs_logprob_diff"] = max(
                float(np.abs(a - w).max()) for a, w in zip(rows, want)
            )
            g["same_argmax"] = all(
                np.array_equal(a.argmax(-1), w.argmax(-1)) for a, w in zip(rows, want)
            )
        out[arm] = g
    return out


def _summary(args, arms, rounds, engine, scorer) -> dict:
    # Later rounds: the first compiles kernel shapes and warms the page cache.
    later = rounds[1:] or rounds
    mean = {
        arm: float(np.mean([x[arm]["positions_per_s"] for x in later])) for arm in arms
    }
    out = {
        "format": FIDELITY_BENCH_FORMAT,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} {platform.system()}, {os.cpu_count()} CPUs, "
        f"load average {os.getloadavg()[0]:.2f} at the end",
        "device": str(mx.default_device()),
        "openblas_preloaded": "openblas" in os.environ.get("LD_PRELOAD", ""),
        "model": str(args.model),
        "arm_kind": "teacher (mlx-lm)" if args.teacher else f"engine {args.mode}",
        "dtype": activation_dtype(args.compute_dtype, args.model),
        "prompts": args.prompts,
        "steps_prompts": args.steps_prompts,
        "positions": args.positions,
        "prompt_tokens": args.prompt_tokens,
        "chunk": args.chunk,
        "cache": args.cache,
        "wrap_pieces": args.wrap_pieces,
        "rounds": rounds,
        "rounds_averaged": "later" if len(rounds) > 1 else "all",
        "positions_per_s": mean,
        "layer_major": {
            "memory_mib": scorer.memory_mib,
            "bytes_per_position_estimate": scorer.bytes_per_position,
            "round_positions": scorer.round_positions,
            "window": scorer.window,
            **scorer.stats.as_dict(),
        },
    }
    out["rates"] = _rates(arms, later, scorer)
    if "steps" in arms:
        out.update(_against_steps(arms, rounds, later, mean, engine))
    if engine is not None:
        out["engine"] = {
            k: v
            for k, v in engine.stats().items()
            if k
            in (
                "mode",
                "top_k",
                "slots_per_layer",
                "lora",
                "prerouter_owners",
                "prerouter_wrap_around",
                "prerouter_features",
                "wrap_passes_per_chunk",
            )
        }
    return out


def _rates(arms, later: list, scorer) -> dict:
    """What a fidelity run costs per arm, prompts and positions apart (plan --fidelity-rate)."""
    rates = {}
    for arm in arms:
        if arm == PRICED_SCORER:
            rates[arm] = scorer.stats.rates()
            continue
        rates[arm] = {
            "prompt_tokens_per_s": float(
                np.mean([x[arm]["prompt_tokens_per_s"] for x in later])
            ),
            "positions_per_s": float(
                np.mean([x[arm]["continuation_positions_per_s"] for x in later])
            ),
        }
    return rates


def _against_steps(arms, rounds: list, later: list, mean: dict, engine) -> dict:
    """Each arm against the step-by-step arm: speed, log-prob agreement, bytes read."""
    others = [arm for arm in arms if arm != "steps"]
    out = {
        "ratio_over_steps": {arm: mean[arm] / mean["steps"] for arm in others},
        "bit_identical": {
            arm: all(x[arm]["max_abs_logprob_diff"] == 0.0 for x in rounds)
            for arm in others
        },
        "max_abs_logprob_diff": {
            arm: max(x[arm]["max_abs_logprob_diff"] for x in rounds) for arm in others
        },
    }
    if engine is not None:
        per = {
            arm: float(np.mean([x[arm]["bytes_per_position"] for x in later]))
            for arm in arms
        }
        out["bytes_per_position"] = per
        out["bytes_ratio_steps_over"] = {
            arm: (per["steps"] / per[arm] if per[arm] else None) for arm in others
        }
    return out


def _print_summary(out: dict) -> None:
    mean = out["positions_per_s"]
    line = "positions/s (prefill included): " + ", ".join(
        f"{arm} {v:.3f}" for arm, v in mean.items()
    )
    for arm, ratio in (out.get("ratio_over_steps") or {}).items():
        same = out["bit_identical"][arm]
        line += (
            f"; {arm}/steps {ratio:.2f}x ("
            + (
                "bit-identical"
                if same
                else f"max |d log-prob| {out['max_abs_logprob_diff'][arm]:.3g}"
            )
            + ")"
        )
    print(line)
    for arm, ratio in (out.get("bytes_ratio_steps_over") or {}).items():
        per = out["bytes_per_position"]
        print(
            f"bytes per scored position: steps {per['steps'] / 2**20:.3f} MiB, {arm} "
            f"{per[arm] / 2**20:.4f} MiB: 1/{ratio:.1f} of steps'"
            if ratio
            else f"bytes per scored position: {arm} reads nothing"
        )
    lm = out["layer_major"]
    if lm.get("batches"):
        print(
            f"layer-major: {lm['batches']} batch(es), {lm['rounds']} round(s), up to "
            f"{lm['max_round_positions']} positions a round (bound {lm['memory_mib']:g} "
            f"MiB at ~{lm['bytes_per_position_estimate'] / 1024:.1f} KiB a position; "
            f"measured peak {out['rounds'][-1]['layer-major']['peak_memory_gib']:.2f} GiB, "
            f"model included)"
            + (
                f", wrap fixed point {lm['wrap_passes_per_round']:.2f} passes a round"
                if lm.get("wrap_passes_per_round")
                else ""
            )
        )
