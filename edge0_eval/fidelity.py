"""`edge0-eval fidelity make TEACHER --out FILE`: the fidelity set, made once from the teacher.

The set (see edge0_eval/evaluation/fidelity_scoring.py) holds prompts, the teacher's greedy
continuation of each and the teacher's top-k log-probs at every position; every arm is later
scored on it (configs/datasets/edge0_fidelity.py). Make it where the teacher fits, copy the one
file to where the students run, and `edge0-eval data stage --root R --fidelity FILE` lays it
where the config looks.

`edge0-eval fidelity bench MODEL`: teacher-forced scoring speed, decode steps vs pieces.

Two arms in one process, interleaved (their order alternating by round), on the same seeded
prompt and continuation: `steps` scores the continuation as fidelity scored it before issue 28,
one decode step per position (`Sequence.step`, mlx-lm's one-token calls for a teacher);
`pieces` forces it in pieces of `--chunk` positions (`Sequence.forced`). Each round starts a
new sequence, prefills the prompt (timed apart: both arms run the same prefill) and scores
`--positions` positions; `--cache cold` evicts the expert file before every arm. Both arms'
log-prob rows are compared: bit-identical, or the largest difference (bailing_hybrid).

The figure is positions per second of the continuation; the ratio pieces / steps. Tokens are
seeded random ids (speed does not depend on the text; a synthetic model has no teacher).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from datetime import datetime, timezone

import numpy as np

from edge0_eval.arguments import value_types as ct
from edge0_eval.arguments.engine_flags import add_engine_arguments, options_from_args
from edge0_eval.engine.engine import Engine
from edge0_eval.engine.mlx_compat import COMPUTE_DTYPES, wired_limit
from edge0_eval.errors import ConfigError
from edge0_eval.evaluation.fidelity_scoring import (
    DEFAULT_BATCH,
    DEFAULT_MAX_NEW,
    DEFAULT_TOP_K,
    SCORE_CHUNK,
    SOURCES,
    EngineRunner,
    MLXRunner,
    _logprobs,
    gather_prompts,
    load_teacher,
    make_set,
)
from edge0_eval.evaluation.fidelity_set import ENDS, source_counts, write_set


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    mk = sub.add_parser("make", help="make a fidelity set from a teacher checkpoint")
    mk.add_argument(
        "teacher", metavar="TEACHER", help="mlx-lm teacher checkpoint directory"
    )
    mk.add_argument(
        "--out",
        required=True,
        metavar="FILE",
        type=ct.output_path,
        help="the set to write (.json, or .json.gz for a gzipped one)",
    )
    mk.add_argument(
        "--max-new",
        type=int,
        default=DEFAULT_MAX_NEW,
        metavar="N",
        help=f"teacher tokens per prompt (default {DEFAULT_MAX_NEW})",
    )
    mk.add_argument(
        "--min-new",
        type=int,
        default=1,
        metavar="N",
        help="leave out prompts whose continuation stops before N tokens (a "
        "long-form set: e.g. --max-new 4096 --min-new 512 --thinking; the set "
        "lists them under left_out)",
    )
    mk.add_argument(
        "--top-k",
        type=int,
        default=DEFAULT_TOP_K,
        metavar="K",
        help=f"teacher log-probs kept per position (default {DEFAULT_TOP_K})",
    )
    mk.add_argument(
        "--prompts-from",
        default=",".join(SOURCES),
        metavar="SRC,...",
        help=f"packaged prompt sources, comma-separated, from {', '.join(SOURCES)} "
        f"(default all; '' for none)",
    )
    mk.add_argument(
        "--limit",
        type=int,
        default=None,
        metavar="N",
        help="at most N prompts from each source (default all)",
    )
    mk.add_argument(
        "--text",
        nargs="+",
        default=[],
        metavar="FILE",
        help='extra prompts: a .jsonl of {"prompt": ...} lines, or a text file '
        "(one prompt)",
    )
    mk.add_argument(
        "--compute-dtype",
        default="auto",
        choices=COMPUTE_DTYPES,
        help="the teacher's activation dtype, as the teacher arm's compute_dtype "
        "(default auto)",
    )
    mk.add_argument(
        "--thinking",
        action="store_true",
        help="chat template with enable_thinking=True where the template reads it "
        "(the set records whether it does; default off)",
    )
    mk.add_argument(
        "--batch",
        type=ct.positive_int,
        default=DEFAULT_BATCH,
        metavar="N",
        help=f"continuations the teacher decodes together (default {DEFAULT_BATCH})",
    )
    mk.add_argument("--no-progress", action="store_true", help="no progress bar")
    bench = sub.add_parser(
        "bench",
        help="teacher-forced scoring speed: decode steps vs pieces "
        "(interleaved, one process)",
    )
    _add_bench_arguments(bench)


def run(args: argparse.Namespace) -> int:
    if args.action == "bench":
        return _bench(args)
    if args.limit is not None and args.limit < 1:
        raise ConfigError("--limit must be at least 1")
    sources = [s.strip() for s in args.prompts_from.split(",") if s.strip()]
    prompts, info = gather_prompts(sources, args.text, args.limit)
    fset = make_set(
        args.teacher,
        prompts,
        info,
        max_new=args.max_new,
        min_new=args.min_new,
        top_k=args.top_k,
        compute_dtype=args.compute_dtype,
        thinking=args.thinking,
        batch=args.batch,
        progress=not args.no_progress,
    )
    path = write_set(fset, args.out)
    counts = ", ".join(f"{k} {v}" for k, v in source_counts(fset).items())
    positions = sum(len(i["tokens"]) for i in fset["items"])
    short = len(fset["left_out"]["shorter_than_min_new"])
    ends = {e: sum(i["end"] == e for i in fset["items"]) for e in ENDS}
    print(
        f"wrote {path}: {len(fset['items'])} prompts ({counts}), {positions} positions, "
        f"top-{fset['top_k']}, teacher {fset['teacher']['fingerprint'][:12]}; ended by "
        f"{', '.join(f'{k} {v}' for k, v in ends.items())}"
        + (f"; {short} left out, shorter than --min-new" if short else "")
        + (
            ""
            if not args.thinking or fset["thinking_in_template"]
            else "; the chat template has no thinking switch: thinking had no effect"
        )
    )
    return 0


# -- fidelity bench -------------------------------------------------------------------------------

BENCH_ARMS = ("steps", "pieces")


def _add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        help="converted model directory (with --teacher: an mlx-lm "
        "checkpoint, scored as the teacher arm)",
    )
    parser.add_argument(
        "--teacher",
        action="store_true",
        help="MODEL is the teacher: mlx-lm, every weight resident",
    )
    parser.add_argument(
        "--positions",
        type=ct.positive_int,
        default=128,
        help="continuation positions scored per arm per round",
    )
    parser.add_argument("--prompt-tokens", type=ct.positive_int, default=32)
    parser.add_argument(
        "--chunk",
        type=ct.positive_int,
        default=SCORE_CHUNK,
        help=f"positions a piece holds (default {SCORE_CHUNK}, the scorer's)",
    )
    parser.add_argument(
        "--rounds",
        type=ct.positive_int,
        default=2,
        help="interleaved rounds over the two arms",
    )
    parser.add_argument("--cache", choices=("cold", "warm"), default="warm")
    parser.add_argument(
        "--wrap-pieces",
        action="store_true",
        help="a wrap-around student in pieces (their fixed point, step.py) even "
        "on the CPU, where the scorer steps it: its passes per piece",
    )
    parser.add_argument("--json", dest="json_path", default=None, type=ct.output_file)
    add_engine_arguments(parser)


def _tokens(vocab: int, n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, vocab, size=n)]


def _score(
    runner,
    arm: str,
    prompt: list[int],
    tokens: list[int],
    chunk: int,
    wrap_pieces: bool,
) -> dict:
    """One arm's run: (prefill seconds, continuation seconds, log-prob rows)."""
    t0 = time.perf_counter()
    rows = [runner.start(prompt)]
    t1 = time.perf_counter()
    if arm == "steps":
        rows += [runner.advance(t) for t in tokens[:-1]]
    else:
        pieces = runner.sequence.forced if wrap_pieces else runner.forced
        rows += [
            lp for logits in pieces(tokens[:-1], chunk) for lp in _logprobs(logits)
        ]
    t2 = time.perf_counter()
    return {"prefill_s": t1 - t0, "score_s": t2 - t1, "rows": np.stack(rows)}


def _bench(args: argparse.Namespace) -> int:
    """`fidelity bench`: see the module's docstring."""
    if args.teacher:
        model, tokenizer = load_teacher(args.model, args.compute_dtype)
        runner, engine = MLXRunner(model), None
    else:
        engine = Engine.load(args.model, options_from_args(args))
        runner, tokenizer = EngineRunner(engine), engine.tokenizer
    vocab = tokenizer.vocab_size  # within the model's embedding
    prompt = _tokens(vocab, args.prompt_tokens, 1)
    tokens = _tokens(vocab, args.positions + 1, 2)  # the last is never consumed
    rounds = []
    with wired_limit(runner.module):
        for r in range(args.rounds):
            order = BENCH_ARMS if r % 2 == 0 else BENCH_ARMS[::-1]
            got = {}
            for arm in order:
                if engine is not None and args.cache == "cold":
                    engine.store.evict_page_cache()
                before = engine.snapshot() if engine is not None else None
                got[arm] = _score(
                    runner,
                    arm,
                    prompt,
                    tokens,
                    args.chunk,
                    args.wrap_pieces and engine is not None,
                )
                if engine is not None:
                    got[arm]["bytes_read"] = (
                        engine.snapshot()["bytes"] - before["bytes"]
                    )
            diff = float(np.abs(got["pieces"]["rows"] - got["steps"]["rows"]).max())
            same_argmax = bool(
                np.array_equal(
                    got["pieces"]["rows"].argmax(-1), got["steps"]["rows"].argmax(-1)
                )
            )
            rounds.append(
                {
                    "order": list(order),
                    "max_abs_logprob_diff": diff,
                    "same_argmax": same_argmax,
                    **{
                        arm: {
                            "prefill_s": g["prefill_s"],
                            "score_s": g["score_s"],
                            "positions_per_s": args.positions / g["score_s"],
                            **(
                                {"bytes_read": g["bytes_read"]}
                                if "bytes_read" in g
                                else {}
                            ),
                        }
                        for arm, g in got.items()
                    },
                }
            )
            print(
                f"round {r + 1}: "
                + ", ".join(
                    f"{arm} {rounds[-1][arm]['positions_per_s']:.3f} positions/s"
                    for arm in BENCH_ARMS
                )
                + f"; max |d log-prob| {diff:.3g}, same argmax {same_argmax}"
            )
    mean = {
        arm: float(np.mean([x[arm]["positions_per_s"] for x in rounds]))
        for arm in BENCH_ARMS
    }
    out = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} {platform.system()}, {os.cpu_count()} CPUs, "
        f"load average {os.getloadavg()[0]:.2f} at the end",
        "openblas_preloaded": "openblas" in os.environ.get("LD_PRELOAD", ""),
        "model": str(args.model),
        "arm_kind": "teacher (mlx-lm)" if args.teacher else f"engine {args.mode}",
        "positions": args.positions,
        "prompt_tokens": args.prompt_tokens,
        "chunk": args.chunk,
        "cache": args.cache,
        "wrap_pieces": args.wrap_pieces,
        "rounds": rounds,
        "positions_per_s": mean,
        "ratio_pieces_over_steps": mean["pieces"] / mean["steps"],
        "bit_identical": all(x["max_abs_logprob_diff"] == 0.0 for x in rounds),
    }
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
        engine.close()
    worst = max(x["max_abs_logprob_diff"] for x in rounds)
    print(
        f"positions/s: steps {mean['steps']:.3f}, pieces {mean['pieces']:.3f}, ratio "
        f"{out['ratio_pieces_over_steps']:.2f} ("
        + ("bit-identical" if out["bit_identical"] else f"max |d log-prob| {worst:.3g}")
        + ")"
    )
    if args.json_path:
        with open(args.json_path, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1)
    return 0
