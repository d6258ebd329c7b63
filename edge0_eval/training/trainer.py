"""The optimizer step of stages 2 and 3 on the served path, the LoRA state it trains, and stage
1's learning-rate schedule.

The step (see served.py): a no-gradient pass learns which experts every layer routes the batch
to, the union per layer is loaded into the slot pool (this *is* the memory bound: only the
batch's experts are resident), switches are pinned and `mx.value_and_grad` runs over the LoRA
matrices only (base weights frozen, experts int4 and never trained). If some layer's union
exceeds `--slots-per-layer`, the batch is split into micro-batches whose unions fit and the
gradients are accumulated (the loss is normalised by the whole batch's token count, so the
result is the full-batch gradient).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map

from edge0_eval.engine.lora import lora_modules
from edge0_eval.errors import CheckpointError
from edge0_eval.training.batches import Batch
from edge0_eval.training.served import pack_rows


@dataclass
class StepStats:
    loss: float
    tokens: int
    micro_batches: int
    max_union: int  # most experts one layer held for the batch
    bundles_read: int


class Trainer:
    """value_and_grad over the LoRA matrices on the served path, with the expert bound kept."""

    def __init__(self, engine, path, optimizer):
        self.engine, self.path, self.optimizer = engine, path, optimizer
        self.model = engine.model
        self.n_slots = engine.slots_per_layer

    def step(self, batch: Batch, loss_fn, aux: dict | None = None) -> StepStats:
        """loss_fn(logits [b, L, V] float32, rows, batch, aux) -> summed per-token loss."""
        path = self.path
        disc = path.discover(batch.tokens, batch.valid, batch.n_true)
        groups = pack_rows(disc, self.n_slots)
        total = max(1, batch.n_loss)
        grads_sum, loss_sum, max_union, read = None, 0.0, 0, 0
        for rows in groups:
            unions = disc.unions(rows)
            max_union = max(max_union, max(len(u) for u in unions.values()))
            read += path.load_routed(unions)
            plan = path.replay_plan(disc, rows, unions)
            tokens = mx.array(batch.tokens[rows])

            def objective(model):
                logits = path.forward(tokens, plan).astype(mx.float32)
                return loss_fn(logits, rows, batch, aux) / total

            loss, grads = nn.value_and_grad(self.model, objective)(self.model)
            mx.eval(loss, grads)
            loss_sum += float(loss.item())
            grads_sum = (
                grads
                if grads_sum is None
                else tree_map(lambda a, b: a + b, grads_sum, grads)
            )
        self.optimizer.update(self.model, grads_sum)
        mx.eval(self.model.trainable_parameters(), self.optimizer.state)
        return StepStats(loss_sum, total, len(groups), max_union, read)


def lora_state(model) -> dict[str, mx.array]:
    out = {}
    for p, m in lora_modules(model).items():
        out[f"{p}.lora_A"], out[f"{p}.lora_B"] = m.lora_A, m.lora_B
    return out


def set_lora_state(model, arrays: dict[str, mx.array]) -> None:
    modules = lora_modules(model)
    names = {f"{p}.lora_{x}" for p in modules for x in "AB"}
    if names != set(arrays):
        raise CheckpointError(
            "the checkpoint's LoRA layers do not match the model's; rerun with --fresh"
        )
    for p, m in modules.items():
        m.lora_A = arrays[f"{p}.lora_A"].astype(mx.float32)
        m.lora_B = arrays[f"{p}.lora_B"].astype(mx.float32)


def warmup_cosine(step: int, steps: int, lr: float) -> float:
    """Linear warmup over min(50, steps/10) steps, then cosine to 10% of --lr."""
    warm = max(1, min(50, steps // 10))
    if step < warm:
        return lr * (step + 1) / warm
    frac = (step - warm) / max(1, steps - warm)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))
