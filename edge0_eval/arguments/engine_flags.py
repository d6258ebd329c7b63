"""Engine options on the command line: one place maps flags onto `EngineOptions`.

The routing width is `--experts-per-token K` on every verb (a config's num_experts_per_tok;
the EngineOptions field `experts_per_token`); `--top-k` samples, as in mlx-lm, where a verb
samples (generate), and is refused with the new name everywhere else, so a command written for
the old spelling fails instead of doing the other thing.
"""

from __future__ import annotations

import argparse
from dataclasses import fields

from edge0_eval.arguments import value_types as ct
from edge0_eval.engine.mlx_compat import COMPUTE_DTYPES
from edge0_eval.engine.options import (
    HEDGE_FILE,
    LORA_FILE,
    MODES,
    PREROUTER_FILE,
    EngineOptions,
)

# Every flag's default is the EngineOptions field's: one owner.
_DEFAULTS = EngineOptions()
TOP_K_RENAMED = (
    "--top-k is no longer the routing width: give --experts-per-token K (the "
    "config's num_experts_per_tok); --top-k samples, as in mlx-lm, where a verb "
    "samples (generate --top-k)"
)


def _renamed_top_k(text: str):
    raise argparse.ArgumentTypeError(TOP_K_RENAMED)


def add_experts_per_token(
    parser, help: str, default=None, type=ct.positive_int, refuse_old: bool = True
) -> None:
    """`--experts-per-token K`, the routing width; with `refuse_old`, the old spelling
    `--top-k` is refused with the new name (a verb that samples defines its own --top-k)."""
    parser.add_argument(
        "--experts-per-token", type=type, default=default, metavar="K", help=help
    )
    if refuse_old:
        refuse_top_k(parser)


def refuse_top_k(parser) -> None:
    """`--top-k`, the routing width's old spelling, refused with the new name."""
    parser.add_argument(
        "--top-k", type=_renamed_top_k, dest="renamed_top_k", help=argparse.SUPPRESS
    )


def add_engine_arguments(
    parser: argparse.ArgumentParser, *, samples: bool = False
) -> None:
    """The engine's flags. samples: the verb samples and defines `--top-k` itself."""
    g = parser.add_argument_group("engine")
    g.add_argument("--mode", default=_DEFAULTS.mode, choices=MODES)
    add_experts_per_token(
        g,
        "routing width: experts per token (default: the model's num_experts_per_tok)",
        refuse_old=not samples,
    )
    g.add_argument(
        "--expert-budget-mib",
        type=ct.positive_float,
        default=None,
        help="memory for expert slots across all MoE layers",
    )
    g.add_argument("--slots-per-layer", type=ct.positive_int, default=None)
    g.add_argument(
        "--lora",
        dest="lora_path",
        default=None,
        help=f"LoRA adapter safetensors (default: MODEL/{LORA_FILE} if present)",
    )
    g.add_argument(
        "--lora-alpha",
        type=ct.positive_float,
        default=None,
        help="the adapter's LoRA alpha (scale alpha/r), for a file whose metadata "
        "and adapter_config.json give none; overrides them when given",
    )
    g.add_argument(
        "--prerouter",
        dest="prerouter_path",
        default=None,
        help=f"prerouter heads safetensors (default: MODEL/{PREROUTER_FILE})",
    )
    g.add_argument("--no-lora", action="store_true")
    g.add_argument(
        "--no-prerouter",
        action="store_true",
        help="route every layer with its true router",
    )
    g.add_argument(
        "--hedge",
        dest="hedge_path",
        default=None,
        help=f"hedge for next-token heads, staged before the LM head: a draft "
        f"vocabulary (edge0-eval draft-vocab) (default: MODEL/{HEDGE_FILE} if "
        f"present)",
    )
    g.add_argument("--no-hedge", action="store_true", help="stage without a hedge")
    g.add_argument(
        "--hedge-layers",
        type=ct.positive_int,
        default=None,
        help="hedge only the first N hedge layers in step order (default: all)",
    )
    g.add_argument(
        "--measure-recall",
        action="store_true",
        help="prerouted: also run the true routers to report online recall (slower)",
    )
    g.add_argument("--io-workers", type=ct.positive_int, default=_DEFAULTS.io_workers)
    g.add_argument(
        "--io-throttle-mbps",
        type=ct.positive_float,
        default=None,
        help="emulate storage of this bandwidth (figures are labelled emulated)",
    )
    g.add_argument(
        "--verify-crc",
        action=argparse.BooleanOptionalAction,
        default=_DEFAULTS.verify_crc,
        help="crc32 of each expert bundle on its first read (default on)",
    )
    g.add_argument(
        "--compute-dtype",
        default=_DEFAULTS.compute_dtype,
        choices=COMPUTE_DTYPES,
        help="activation dtype (auto: float32 on CPU, checkpoint dtype elsewhere)",
    )
    g.add_argument(
        "--no-guard", action="store_true", help="disable hidden-state clipping"
    )
    g.add_argument("--seed", type=ct.seed, default=_DEFAULTS.seed)


def options_from_args(args: argparse.Namespace, **overrides) -> EngineOptions:
    names = {f.name for f in fields(EngineOptions)}
    values = {k: v for k, v in vars(args).items() if k in names}
    if getattr(args, "no_guard", False):
        values["clip_hidden"] = None
    values.update(overrides)
    options = EngineOptions(**values)
    options.validate()
    return options
