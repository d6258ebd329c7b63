"""Engine options on the command line: one place maps flags onto `EngineOptions`.

The routing width is `--experts-per-token K` on every verb (a config's num_experts_per_tok;
the EngineOptions field `experts_per_token`); `--top-k` samples, as in mlx-lm, where a verb
samples (generate), and is refused with the new name everywhere else, so a command written for
the old spelling fails instead of doing the other thing.
"""

from __future__ import annotations

import argparse

from edge0_eval.arguments.fields import add_fields, from_args
from edge0_eval.engine.options import EngineOptions

TOP_K_RENAMED = (
    "--top-k is no longer the routing width: give --experts-per-token K (the "
    "config's num_experts_per_tok); --top-k samples, as in mlx-lm, where a verb "
    "samples (generate --top-k)"
)


def _renamed_top_k(text: str):
    raise argparse.ArgumentTypeError(TOP_K_RENAMED)


def refuse_top_k(parser) -> None:
    """`--top-k`, the routing width's old spelling, refused with the new name."""
    parser.add_argument(
        "--top-k", type=_renamed_top_k, dest="renamed_top_k", help=argparse.SUPPRESS
    )


def add_engine_arguments(
    parser: argparse.ArgumentParser, *, samples: bool = False
) -> None:
    """The engine's flags, generated from `EngineOptions`' fields. samples: the verb samples
    and defines `--top-k` itself."""
    add_fields(parser.add_argument_group("engine"), EngineOptions)
    if not samples:
        refuse_top_k(parser)


def options_from_args(args: argparse.Namespace, **overrides) -> EngineOptions:
    options = from_args(EngineOptions, args, **overrides)
    options.validate()
    return options
