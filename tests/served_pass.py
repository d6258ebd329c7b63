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

    def objective(model):
        logits = path.forward(mx.array(tokens), plan)
        return (logits.astype(mx.float32) ** 2).mean(), logits

    (loss, logits), g = nn.value_and_grad(engine.model, objective)(engine.model)
    mx.eval(loss, logits, g)
    return logits, dict(tree_flatten(g))


PROMPT_IDS = [1, 87, 85, 259, 201, 263, 312, 81]
CONTINUATION_IDS = [259, 71, 14, 223, 74, 294, 400]


def lora_engine_decode(
    engine,
    moe: list[int],
    prompt: list[int] = PROMPT_IDS,
    cont: list[int] = CONTINUATION_IDS,
) -> tuple[mx.array, list[dict]]:
    """Random LoRA on `engine`, then prefill `prompt` and decode the forced `cont`: (the logits of
    every step [len(cont) + 1, 1, vocab], each step's executed sets {layer: sorted ids})."""
    from edge0_eval.engine import lora

    lora.apply_lora(
        engine.model, r=4, alpha=8, init="random", family=engine.family.name
    )
    lora.mark_trainable(engine.model)
    for layer in moe:
        engine.blocks[layer].capture = True
    sequence = engine.sequence()
    served = [sequence.prefill(prompt)]
    executed = []
    for t in cont:
        served.append(sequence.step(t))
        executed.append(
            {
                n: sorted(np.array(engine.blocks[n].last[1]).reshape(-1).tolist())
                for n in moe
            }
        )
    return mx.stack(served), executed
