"""Small accommodations for MLX backends, applied to model instances (never to classes)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn


def on_cpu() -> bool:
    return mx.default_device() == mx.cpu


def upcast_unquantized_experts_for_cpu(model: nn.Module) -> int:
    """MLX's CPU `gather_mm` only supports float32: upcast unquantized SwitchLinear weights.

    Quantized experts (`gather_qmm`) run in fp16/bf16 on every backend and are left alone.
    On Metal/CUDA nothing changes. Returns the number of modules changed.
    """
    from mlx_lm.models.switch_layers import SwitchLinear

    if not on_cpu():
        return 0
    changed = 0
    for _, module in model.named_modules():
        if isinstance(module, SwitchLinear) and module.weight.dtype != mx.float32:
            module.weight = module.weight.astype(mx.float32)
            if "bias" in module:
                module.bias = module.bias.astype(mx.float32)
            changed += 1
    return changed
