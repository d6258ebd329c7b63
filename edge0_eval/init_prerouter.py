"""`edge0-eval init-prerouter MODEL --out FILE`: untrained prerouter heads, warm-started.

Each head's linear part starts as the router of the layer it predicts, and its MLP part starts at
zero output, so an untrained head predicts "the next layer's router applied to this layer's
input". Such heads serve speed benchmarks (with prediction-as-routing the staged set always equals
the routed set, whatever the heads predict) and are the starting point stage 1 trains from.
"""

from __future__ import annotations

import argparse

from edge0_eval.engine.engine import Engine, EngineOptions
from edge0_eval.engine.prerouter import default_owners, init_heads_from_routers, save_heads, \
    tier_defaults


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="converted model directory (edge0-eval convert)")
    parser.add_argument("--out", required=True, help="heads file to write (.safetensors)")
    parser.add_argument("--start-layer", type=int, default=None,
                        help="first layer whose routing a head predicts (default: the tier's)")
    parser.add_argument("--top-k", type=int, default=None,
                        help="serving K the heads are for (default: the tier's, else native)")
    parser.add_argument("--width", type=int, default=None, help="fc1 width (default: the tier's)")
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    probe = Engine.load(args.model, EngineOptions(mode="reactive", no_lora=True,
                                                  no_prerouter=True))
    try:
        n_layers = len(probe.family.layers(probe.model))
        defaults = tier_defaults(probe.config["model_type"], n_layers,
                                 int(probe.family.hidden_size(probe.config)),
                                 int(probe.index.num_experts), probe.moe_layers)
        start = defaults["start_layer"] if args.start_layer is None else args.start_layer
        owners = default_owners(start, n_layers, probe.moe_layers)
        top_k = args.top_k or defaults["top_k"] or probe.top_k
        heads = init_heads_from_routers(probe, owners, width=args.width or defaults["width"],
                                        seed=args.seed, top_k=top_k)
        path = save_heads(args.out, heads, metadata={"source": "init-prerouter (untrained)",
                                                     "model": probe.config["model_type"]})
    finally:
        probe.close()
    cfg = heads.config
    print(f"wrote {path}: {len(cfg.owners)} heads, owners {cfg.owners[0]}..{cfg.owners[-1]} "
          f"(layers {cfg.start_layer}..{cfg.owners[-1] + 1} prerouted), K={cfg.top_k}, "
          f"width {cfg.width}, untrained")
    return 0
