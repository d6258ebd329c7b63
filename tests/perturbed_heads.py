"""Prerouter heads for a tiny test model that are NOT the plain next-router baseline.

Untrained heads equal the next layer's router, whose plans would match the true routing; a
random fc2 makes the planned sets differ from it, so staged-vs-routed checks can see a mix-up.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from edge0_eval.engine.engine import Engine
from edge0_eval.engine.heads import default_owners, init_heads_from_routers, save_heads
from edge0_eval.engine.options import EngineOptions


def perturbed_heads(
    converted: Path, out_dir: Path, start_layer: int | None = None, key: int = 1
) -> tuple[Path, list[int]]:
    """(heads file, owners) for `converted`: owners from `start_layer` - 1 on (None: the first
    MoE layer + 1; 0 adds the wrap-around head)."""
    engine = Engine.load(converted, EngineOptions(mode="reactive"))
    start = engine.moe_layers[0] + 1 if start_layer is None else start_layer
    owners = default_owners(start, len(engine.model.layers), engine.moe_layers)
    heads = init_heads_from_routers(engine, owners, width=32, seed=0)
    heads.fc2 = mx.random.normal(heads.fc2.shape, key=mx.random.key(key)) * 0.5
    path = save_heads(Path(out_dir) / "prerouter.safetensors", heads)
    engine.close()
    return path, owners


def heads_of_kind(engine: Engine, path: Path, kind: str) -> Path:
    """Heads of `kind` (context, next_token, wrap) for `engine`, made to disagree with the
    true router (random fc2; next-token heads also weigh the token's embedding)."""
    n = len(engine.family.layers(engine.model))
    start = 0 if kind == "wrap" else engine.moe_layers[0] + 1
    heads = init_heads_from_routers(
        engine,
        default_owners(start, n, engine.moe_layers),
        width=32,
        seed=0,
        next_token=kind == "next_token",
    )
    heads.fc2 = mx.random.normal(heads.fc2.shape, key=mx.random.key(1)) * 0.5
    if kind == "next_token":
        cfg = heads.config
        lead = cfg.hidden + 2 * cfg.num_experts
        rand = mx.random.normal(heads.linear[:, :, lead:].shape, key=mx.random.key(2))
        heads.linear = mx.concatenate([heads.linear[:, :, :lead], rand * 2.0], axis=-1)
    return save_heads(path, heads)
