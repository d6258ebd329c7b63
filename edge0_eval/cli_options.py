"""Engine options on the command line: one place maps flags onto `EngineOptions`."""

from __future__ import annotations

import argparse
from dataclasses import fields

from edge0_eval import cli_types as ct
from edge0_eval.engine.engine import MODES, EngineOptions


def add_engine_arguments(parser: argparse.ArgumentParser, mode_default: str = "reactive") -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--mode", default=mode_default, choices=MODES)
    g.add_argument("--top-k", type=ct.positive_int, default=None,
                   help="routing width (default: native)")
    g.add_argument("--expert-budget-mib", type=ct.positive_float, default=None,
                   help="memory for expert slots across all MoE layers")
    g.add_argument("--slots-per-layer", type=ct.positive_int, default=None)
    g.add_argument("--lora", dest="lora_path", default=None, help="LoRA adapter safetensors")
    g.add_argument("--prerouter", dest="prerouter_path", default=None,
                   help="prerouter heads safetensors (default: MODEL/prerouter.safetensors)")
    g.add_argument("--no-lora", action="store_true")
    g.add_argument("--no-prerouter", action="store_true",
                   help="route every layer with its true router")
    g.add_argument("--prerouted-weights", default="head", choices=("head", "router"))
    g.add_argument("--measure-recall", action="store_true",
                   help="prerouted: also run the true routers to report online recall (slower)")
    g.add_argument("--io-workers", type=ct.positive_int, default=4)
    g.add_argument("--io-throttle-mbps", type=ct.positive_float, default=None,
                   help="emulate storage of this bandwidth (figures are labelled emulated)")
    g.add_argument("--verify-crc", action=argparse.BooleanOptionalAction, default=True,
                   help="crc32 of each expert bundle on its first read (default on)")
    g.add_argument("--compute-dtype", default="auto",
                   choices=("auto", "float16", "bfloat16", "float32"),
                   help="activation dtype (auto: float32 on CPU, checkpoint dtype elsewhere)")
    g.add_argument("--no-guard", action="store_true", help="disable hidden-state clipping")
    g.add_argument("--seed", type=ct.nonneg_int, default=0)


def options_from_args(args: argparse.Namespace, **overrides) -> EngineOptions:
    names = {f.name for f in fields(EngineOptions)}
    values = {k: v for k, v in vars(args).items() if k in names}
    if getattr(args, "no_guard", False):
        values["clip_hidden"] = None
    values.update(overrides)
    options = EngineOptions(**values)
    options.validate()
    return options
