"""`edge0-eval fidelity make TEACHER --out FILE`: the fidelity set, made once from the teacher.

The set (see edge0_eval/evaluation/fidelity/scoring.py) holds prompts, the teacher's greedy
continuation of each and the teacher's top-k log-probs at every position; every arm is later
scored on it (configs/datasets/edge0_fidelity.py). Make it where the teacher fits, copy the one
file to where the students run, and `edge0-eval data stage --root R --fidelity FILE` lays it
where the config looks.

`edge0-eval fidelity bench MODEL`: teacher-forced scoring speed and reads by scorer
(evaluation/plan/fidelity_bench.py).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from edge0_eval.arguments import value_types as ct
from edge0_eval.arguments.engine_flags import add_engine_arguments, options_from_args
from edge0_eval.arguments.fields import add_fields, option
from edge0_eval.engine.layer_major import DEFAULT_MEMORY_MIB, DEFAULT_WINDOW
from edge0_eval.engine.mlx_compat import COMPUTE_DTYPES
from edge0_eval.errors import ConfigError
from edge0_eval.evaluation.fidelity.scoring import (
    DEFAULT_BATCH,
    DEFAULT_MAX_NEW,
    DEFAULT_TOP_K,
    SCORE_CHUNK,
    SOURCES,
    gather_prompts,
    make_set,
)
from edge0_eval.evaluation.fidelity.sets import ENDS, source_counts, write_set
from edge0_eval.evaluation.plan import fidelity_bench


@dataclass
class MakeOptions:
    """`fidelity make`'s options, each declared once (its flag from the field)."""

    teacher: str = option(
        help="mlx-lm teacher checkpoint directory", flag="teacher", metavar="TEACHER"
    )
    out: str = option(
        help="the set to write (.json, or .json.gz for a gzipped one)",
        required=True,
        metavar="FILE",
        type=ct.output_path,
    )
    max_new: int = option(
        DEFAULT_MAX_NEW,
        f"teacher tokens per prompt (default {DEFAULT_MAX_NEW})",
        metavar="N",
    )
    min_new: int = option(
        1,
        "leave out prompts whose continuation stops before N tokens (a "
        "long-form set: e.g. --max-new 4096 --min-new 512 --thinking; the set "
        "lists them under left_out)",
        metavar="N",
    )
    top_k: int = option(
        DEFAULT_TOP_K,
        f"teacher log-probs kept per position (default {DEFAULT_TOP_K})",
        metavar="K",
    )
    prompts_from: str = option(
        ",".join(SOURCES),
        f"packaged prompt sources, comma-separated, from {', '.join(SOURCES)} "
        f"(default all; '' for none)",
        metavar="SRC,...",
    )
    limit: int | None = option(
        None, "at most N prompts from each source (default all)", type=int, metavar="N"
    )
    text: list[str] = option(
        help='extra prompts: a .jsonl of {"prompt": ...} lines, or a text file '
        "(one prompt)",
        factory=list,
        nargs="+",
        metavar="FILE",
    )
    compute_dtype: str = option(
        "auto",
        "the teacher's activation dtype, as the teacher arm's compute_dtype "
        "(default auto)",
        choices=COMPUTE_DTYPES,
    )
    thinking: bool = option(
        False,
        "chat template with enable_thinking=True where the template reads it "
        "(the set records whether it does; default off)",
    )
    batch: int = option(
        DEFAULT_BATCH,
        f"continuations the teacher decodes together (default {DEFAULT_BATCH})",
        type=ct.positive_int,
        metavar="N",
    )
    progress: bool = option(
        True, "no progress bar", flag="--no-progress", action="store_false"
    )


@dataclass
class BenchOptions:
    """`fidelity bench`'s own options (the engine's are EngineOptions')."""

    model: str = option(
        help="converted model directory (with --teacher: an mlx-lm "
        "checkpoint, scored as the teacher arm)",
        flag="model",
    )
    teacher: bool = option(False, "MODEL is the teacher: mlx-lm, every weight resident")
    arms: str = option(
        ",".join(fidelity_bench.ARMS),
        f"scorers to run, comma-separated, from {', '.join(fidelity_bench.ARMS)} "
        f"(default all; the comparison needs steps)",
    )
    prompts: int = option(
        1,
        "prompts the layer-major arm scores together (default 1)",
        type=ct.positive_int,
    )
    steps_prompts: int = option(
        1,
        "of those, how many steps and pieces score (a subset; default 1)",
        type=ct.positive_int,
    )
    positions: int = option(
        128, "continuation positions scored per prompt", type=ct.positive_int
    )
    prompt_tokens: int = option(32, "prompt tokens per prompt", type=ct.positive_int)
    chunk: int = option(
        SCORE_CHUNK,
        f"positions a piece holds (default {SCORE_CHUNK}, the pieces scorer's)",
        type=ct.positive_int,
    )
    score_mib: float = option(
        DEFAULT_MEMORY_MIB,
        "layer-major: the memory a round's hidden states and MoE call may hold "
        f"(MiB, default {DEFAULT_MEMORY_MIB}); a larger batch is split",
        type=ct.positive_float,
    )
    window: int = option(
        DEFAULT_WINDOW,
        f"layer-major: the longest piece of a sequence a round runs "
        f"(default {DEFAULT_WINDOW})",
        type=ct.positive_int,
    )
    rounds: int = option(2, "interleaved rounds over the arms", type=ct.positive_int)
    cache: str = option(
        "warm", "page cache state of the expert file", choices=("cold", "warm")
    )
    wrap_pieces: bool = option(
        False,
        "a wrap-around student in pieces (their fixed point, step.py) even "
        "on the CPU, where the pieces scorer steps it: its passes per piece",
    )
    json_path: str | None = option(
        None, "write the results as JSON here", flag="--json", type=ct.output_file
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    make = sub.add_parser("make", help="make a fidelity set from a teacher checkpoint")
    add_fields(make, MakeOptions)
    bench = sub.add_parser(
        "bench",
        help="teacher-forced scoring speed and reads: decode steps, pieces and "
        "layer-major (interleaved, one process)",
    )
    add_fields(bench, BenchOptions)
    add_engine_arguments(bench)


def run(args: argparse.Namespace) -> int:
    if args.action == "bench":
        return fidelity_bench.run(args, options_from_args(args))
    if args.limit is not None and args.limit < 1:
        raise ConfigError("--limit must be at least 1")
    sources = [s.strip() for s in args.prompts_from.split(",") if s.strip()]
    prompts, info = gather_prompts(sources, args.text, args.limit)
    keep = ("max_new", "min_new", "top_k", "compute_dtype", "thinking", "batch")
    fset = make_set(
        args.teacher,
        prompts,
        info,
        **{k: getattr(args, k) for k in keep},
        progress=args.progress,
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
