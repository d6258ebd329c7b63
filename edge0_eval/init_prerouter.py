"""`edge0-eval init-prerouter MODEL --out FILE`: untrained prerouter heads, warm-started.

Each head's linear part starts as the router of the layer it predicts, and its MLP part starts at
zero output, so an untrained head predicts "the next layer's router applied to this layer's
input". Such heads serve speed benchmarks (with prediction-as-routing the staged set always equals
the routed set, whatever the heads predict; with a draft hedge, speed depends on how often the
hedge misses, which `--embedding-scale` sets for untrained next-token heads) and are the
starting point stage 1 trains from.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from edge0_eval.arguments import value_types as ct
from edge0_eval.arguments.engine_flags import refuse_top_k
from edge0_eval.arguments.fields import add_fields
from edge0_eval.engine.engine import Engine
from edge0_eval.engine.heads import init_heads_from_routers, save_heads
from edge0_eval.engine.options import EngineOptions
from edge0_eval.training.models import model_facts, resolve_heads
from edge0_eval.training.stage_options import HEAD_LAYOUT, PrerouterOptions


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="converted model directory (edge0-eval convert)")
    parser.add_argument(
        "--out",
        required=True,
        type=ct.output_path,
        help="heads file to write (.safetensors)",
    )
    add_fields(
        parser,
        PrerouterOptions,
        only=(*HEAD_LAYOUT, "experts_per_token"),
        experts_per_token={
            "help": "serving K the heads are for (default: the tier's, else native)",
            "type": "positive_int",
        },
    )
    refuse_top_k(parser)
    parser.add_argument("--seed", type=ct.seed, default=0)
    parser.add_argument(
        "--embedding-scale",
        type=ct.positive_float,
        default=0.0,
        metavar="S",
        help="with --next-token: S x the consumer's router (rows shuffled) over the "
        "embedding columns instead of zeros, so the untrained heads route by the token "
        "too and a draft hedge (--hedge) misses their sets when its draft is wrong; "
        "for speed benchmarks of hedged staging",
    )


def run(args: argparse.Namespace) -> int:
    facts = model_facts(Path(args.model))
    experts_per_token, owners, width = resolve_heads(
        facts,
        experts_per_token=args.experts_per_token,
        start_layer=args.start_layer,
        width=args.width,
    )
    probe = Engine.load(
        args.model, EngineOptions(mode="reactive", no_lora=True, no_prerouter=True)
    )
    try:
        heads = init_heads_from_routers(
            probe,
            owners,
            width=width,
            seed=args.seed,
            experts_per_token=experts_per_token,
            next_token=args.next_token,
            embedding_scale=args.embedding_scale,
        )
        path = save_heads(
            args.out,
            heads,
            metadata={
                "source": "init-prerouter (untrained)",
                "model": Path(args.model).resolve().name,
                "model_type": facts.model_type,
            },
        )
    finally:
        probe.close()
    cfg = heads.config
    wrap = [f"{n} -> {c}" for n, c in zip(cfg.owners, cfg.consumers) if c != n + 1]
    print(
        f"wrote {path}: {len(cfg.owners)} heads, owners {cfg.owners[0]}..{cfg.owners[-1]} "
        f"(layers {sorted(cfg.consumers)[0]}..{max(cfg.consumers)} prerouted"
        f"{', wrap-around head ' + wrap[0] + ' of the next token' if wrap else ''}), "
        f"K={cfg.experts_per_token}, width {cfg.width}, "
        f"{'next-token' if cfg.next_token else 'context'} features, untrained"
        f"{f', embedding columns {args.embedding_scale:g} x shuffled routers' if args.embedding_scale else ''}"
    )
    return 0
