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

from edge0_eval.arguments import value_types as ct
from edge0_eval.arguments.engine_flags import add_engine_arguments, options_from_args
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
        help="teacher-forced scoring speed and reads: decode steps, pieces and "
        "layer-major (interleaved, one process)",
    )
    _add_bench_arguments(bench)


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
        "--arms",
        default=",".join(fidelity_bench.ARMS),
        help=f"scorers to run, comma-separated, from {', '.join(fidelity_bench.ARMS)} (default all; "
        f"the comparison needs steps)",
    )
    parser.add_argument(
        "--prompts",
        type=ct.positive_int,
        default=1,
        help="prompts the layer-major arm scores together (default 1)",
    )
    parser.add_argument(
        "--steps-prompts",
        type=ct.positive_int,
        default=1,
        help="of those, how many steps and pieces score (a subset; default 1)",
    )
    parser.add_argument(
        "--positions",
        type=ct.positive_int,
        default=128,
        help="continuation positions scored per prompt",
    )
    parser.add_argument("--prompt-tokens", type=ct.positive_int, default=32)
    parser.add_argument(
        "--chunk",
        type=ct.positive_int,
        default=SCORE_CHUNK,
        help=f"positions a piece holds (default {SCORE_CHUNK}, the pieces scorer's)",
    )
    parser.add_argument(
        "--score-mib",
        type=ct.positive_float,
        default=DEFAULT_MEMORY_MIB,
        help="layer-major: the memory a round's hidden states and MoE call may hold "
        f"(MiB, default {DEFAULT_MEMORY_MIB}); a larger batch is split",
    )
    parser.add_argument(
        "--window",
        type=ct.positive_int,
        default=DEFAULT_WINDOW,
        help=f"layer-major: the longest piece of a sequence a round runs "
        f"(default {DEFAULT_WINDOW})",
    )
    parser.add_argument(
        "--rounds",
        type=ct.positive_int,
        default=2,
        help="interleaved rounds over the arms",
    )
    parser.add_argument("--cache", choices=("cold", "warm"), default="warm")
    parser.add_argument(
        "--wrap-pieces",
        action="store_true",
        help="a wrap-around student in pieces (their fixed point, step.py) even "
        "on the CPU, where the pieces scorer steps it: its passes per piece",
    )
    parser.add_argument("--json", dest="json_path", default=None, type=ct.output_file)
    add_engine_arguments(parser)


def run(args: argparse.Namespace) -> int:
    if args.action == "bench":
        return fidelity_bench.run(args, options_from_args(args))
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
