"""Small accommodations for MLX backends, applied to model instances (never to classes)."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.generate import wired_limit as _mlx_lm_wired_limit
from mlx_lm.models.switch_layers import SwitchLinear
from mlx_lm.utils import infer_quant_config

from edge0_eval.formats.safetensors import checkpoint_float_dtype


def on_cpu() -> bool:
    return mx.default_device() == mx.cpu


def wired_limit(model: nn.Module):
    """Context: keep `model`'s buffers wired while it runs, as mlx-lm's `generate` does.

    Every entry point that runs a model (generate, bench, the OpenCompass arms, fidelity
    scoring) runs inside it. For the engine, `model` is `Engine.model`: its arrays are the
    resident weights and the slot pool. On Metal the limit is raised to the recommended working
    set (macOS otherwise compresses unwired buffers) and the previous limit is restored on exit;
    where the device reports no recommended working set (the CPU, CUDA) it does nothing.
    """
    return _mlx_lm_wired_limit(model)


def upcast_unquantized_experts_for_cpu(model: nn.Module) -> int:
    """MLX's CPU `gather_mm` only supports float32: upcast unquantized SwitchLinear weights.

    Quantized experts (`gather_qmm`) run in fp16/bf16 on every backend and are left alone.
    On Metal/CUDA nothing changes. Returns the number of modules changed.
    """
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


COMPUTE_DTYPES = ("auto", "float16", "bfloat16", "float32")


def resolve_compute_dtype(name: str = "auto"):
    """The activation dtype to run in; None keeps the checkpoint's.

    "auto" is float32 on the CPU and the checkpoint's dtype elsewhere: MLX's CPU backend emulates
    half precision, many times slower than float32 there. Int4 weights stay int4 either way.
    """
    if name not in COMPUTE_DTYPES:
        raise ValueError(f"compute dtype must be one of {COMPUTE_DTYPES}, not {name!r}")
    if name == "auto":
        return mx.float32 if on_cpu() else None
    return getattr(mx, name)


def activation_dtype(name: str, directory: str | Path) -> str | None:
    """The dtype a model loaded from `directory` under compute dtype `name` runs in on this
    device (resolve_compute_dtype, the checkpoint's where that keeps it), as a name; None when
    the checkpoint holds no floating tensor. What a fidelity set records of its teacher and
    the teacher arm must match (another dtype is another teacher to the exact sanity check)."""
    dtype = resolve_compute_dtype(name)
    return (
        str(dtype).removeprefix("mlx.core.")
        if dtype is not None
        else checkpoint_float_dtype(directory)
    )


def cast_floating(model: nn.Module, dtype, skip: str | None = None) -> None:
    """Cast floating parameters (norms, embeddings, quantization scales) to `dtype`.

    Packed integer weights are untouched. Parameter names containing `skip` are left alone.
    """
    if dtype is None:
        return
    changed = [
        (name, value.astype(dtype))
        for name, value in tree_flatten(model.parameters())
        if mx.issubdtype(value.dtype, mx.floating)
        and value.dtype != dtype
        and not (skip and skip in name)
    ]
    if changed:
        model.update(tree_unflatten(changed))


def quantize_like_mlx_lm(model: nn.Module, config: dict, weights: dict) -> None:
    """The same per-module quantization mlx_lm.utils.load_model applies, driven by the weights."""
    quantization = config.get("quantization")
    if quantization is None:
        return

    def predicate(path, module):
        if path in quantization:
            return quantization[path]
        if not hasattr(module, "to_quantized") or f"{path}.scales" not in weights:
            return False
        return infer_quant_config(path, module, weights)

    nn.quantize(
        model,
        group_size=quantization["group_size"],
        bits=quantization["bits"],
        mode=quantization.get("mode", "affine"),
        class_predicate=predicate,
    )
