"""The stage 2/3 gradient pass over a discovered sequence, shared by the served-path tests."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten


def replay_gradients(path, engine, disc, tokens: np.ndarray) -> tuple[mx.array, dict]:
    """Replay `disc`'s routing in one full-sequence pass; (logits, {name: gradient})."""
    unions = disc.unions()
    path.load_routed(unions)
    plan = path.replay_plan(disc, np.arange(1), unions)
    mask = mx.array(disc.mask)
    path.pin(True)

    def objective(model):
        logits = path.forward(mx.array(tokens), mask, plan)
        return (logits.astype(mx.float32) ** 2).mean(), logits

    (loss, logits), g = nn.value_and_grad(engine.model, objective)(engine.model)
    mx.eval(loss, logits, g)
    path.clear_plans()
    path.pin(False)
    return logits, dict(tree_flatten(g))
