"""Small accommodations for MLX backends, applied to model instances (never to classes)."""

from __future__ import annotations

import functools
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models.switch_layers import SwitchLinear
from mlx_lm.utils import _takes_global_scale, infer_quant_config

from edge0_eval.errors import CheckpointError
from edge0_eval.formats.layout import ExpertIndex, Quant
from edge0_eval.formats.safetensors import checkpoint_float_dtype


def on_cpu() -> bool:
    return mx.default_device() == mx.cpu


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


def dequantized(module) -> mx.array:
    """A quantized module's weight, dequantized in its own mode, as float32."""
    return mx.dequantize(
        module.weight,
        module.scales,
        module.get("biases"),
        group_size=module.group_size,
        bits=module.bits,
        mode=getattr(module, "mode", "affine"),
    ).astype(mx.float32)


def backend_name() -> str:
    """MLX's backend for the default device, in words: 'cpu', 'Metal' or 'CUDA'."""
    if on_cpu():
        return "cpu"
    if mx.metal.is_available():
        return "Metal"
    return "CUDA" if mx.cuda.is_available() else "gpu"


@functools.cache
def _gather_qmm_problem(quant: Quant, dtype, device) -> str | None:
    """MLX's own answer to running gather_qmm for `quant` on `device`: None when it runs,
    else its error. Asked once per quantization (a 2-expert, 32x128 product)."""
    del device  # part of the cache key: MLX runs on the default device
    w = mx.zeros((2, 32, 128), dtype=mx.float32)
    gs = mx.ones((2,), dtype=mx.float32) if quant.global_scale else None
    try:
        wq, scales, *biases = mx.quantize(
            w, quant.group_size, quant.bits, mode=quant.mode
        )
        y = mx.gather_qmm(
            mx.zeros((1, 1, 128), dtype=dtype),
            wq,
            scales.astype(dtype) if quant.mode == "affine" else scales,
            biases[0].astype(dtype) if biases else None,
            rhs_indices=mx.array([[1]], dtype=mx.uint32),
            transpose=True,
            group_size=quant.group_size,
            bits=quant.bits,
            mode=quant.mode,
            global_scale=gs,
        )
        mx.eval(y)
    except Exception as exc:  # MLX raises ValueError/RuntimeError with its reason
        return str(exc)
    return None


def refuse_unserved_experts(index: ExpertIndex, where, dtype: str | None) -> None:
    """Every expert quantization of `index` runs on this MLX backend (gather_qmm with
    activations in `dtype`, a name; float32 when None), or one error naming the mode, the
    backend and the layers."""
    dtype = getattr(mx, dtype or "float32")
    for layout in index.layouts:
        for quant in set(layout.quant.values()):
            problem = _gather_qmm_problem(quant, dtype, mx.default_device())
            if problem is None:
                continue
            layers = [
                layer
                for layer, w in zip(index.moe_layers, index.layer_layouts)
                if quant in index.layouts[w].quant.values()
            ]
            raise CheckpointError(
                f"{where}: the routed experts of layer(s) {', '.join(map(str, layers))} "
                f"are quantized {quant.describe()}, which MLX {mx.__version__} does not "
                f"run on its {backend_name()} backend ({problem}); serve this model on a "
                f"backend that runs mode {quant.mode!r}, or convert a checkpoint "
                f"quantized in a mode this one runs"
            )


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


def quantize_like_mlx_lm(model: nn.Module, config: dict, weights) -> None:
    """The same per-module quantization mlx_lm.utils.load_model applies, driven by the weights:
    the config's entry for a module if it has one, else what the stored tensors were packed
    with (and a per-expert nvfp4 global scale where one is stored)."""
    quantization = config.get("quantization")
    if quantization is None:
        return

    def predicate(path, module):
        if path in quantization:
            return quantization[path]
        if not hasattr(module, "to_quantized") or f"{path}.scales" not in weights:
            return False
        params = infer_quant_config(path, module, weights)
        if f"{path}.global_scale" in weights and _takes_global_scale(module):
            params["global_scale"] = True
        return params

    nn.quantize(
        model,
        group_size=quantization.get("group_size"),
        bits=quantization.get("bits"),
        mode=quantization.get("mode", "affine"),
        class_predicate=predicate,
    )
