"""Stage 1's fast collector (`--collect float32`): the served model's own int4 weights,
dequantized once to float32, run in resident mode.

On a CPU, MLX's int4 kernels are slow (the served path collects ~10 tok/s on the testbed),
while float32 matmuls go to BLAS. Dequantizing the int4 weights gives the same linear maps
the int4 kernels compute (they dequantize on the fly), so routing and features differ from the
served path only by float summation order. That claim is checked, not assumed: before
collecting, both paths run on the first documents (`check_float32`) and collection is refused
when any MoE layer's executed top-K agrees with the served path's below `MIN_AGREEMENT`.

Memory: every weight is held in float32 (8x the int4 bytes), so this is for one-off builds of
models whose float32 weights fit in memory; the served path (`--collect served`) has no such
limit.
"""

from __future__ import annotations

import time

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_unflatten
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

from edge0_eval.engine.engine import Engine, EngineOptions
from edge0_eval.engine.mlx_compat import dequantized
from edge0_eval.errors import CheckpointError

COLLECT_MODES = ("served", "float32")
# Per MoE layer, mean |float32 set & served set| / K over the check tokens. Routing flips only
# on near-ties; a lower agreement means the float32 build is not the served model.
MIN_AGREEMENT = 0.98
CHECK_TOKENS = 384


def dequantize_model(model: nn.Module) -> int:
    """Replace every quantized linear, embedding and switch linear by its float32 equivalent
    (instance-level module replacement); returns how many were replaced."""
    replaced = []
    for path, module in model.named_modules():
        if isinstance(module, nn.QuantizedLinear):
            weight = dequantized(module)
            has_bias = "bias" in module
            linear = nn.Linear(weight.shape[1], weight.shape[0], bias=has_bias)
            linear.weight = weight
            if has_bias:
                linear.bias = module.bias.astype(mx.float32)
            replaced.append((path, linear))
        elif isinstance(module, nn.QuantizedEmbedding):
            weight = dequantized(module)
            embedding = nn.Embedding(weight.shape[0], weight.shape[1])
            embedding.weight = weight
            replaced.append((path, embedding))
        elif isinstance(module, QuantizedSwitchLinear):
            weight = dequantized(module)  # [experts, out, in]
            switch = SwitchLinear(
                weight.shape[2], weight.shape[1], weight.shape[0], bias="bias" in module
            )
            switch.weight = weight
            if "bias" in module:
                switch.bias = module.bias.astype(mx.float32)
            replaced.append((path, switch))
    if replaced:
        model.update_modules(tree_unflatten(replaced))
        mx.eval(model.parameters())
    return len(replaced)


def load_float32(model_dir, served: EngineOptions) -> Engine:
    """The served model in resident mode (every expert in its slot, slot = expert id), its
    quantized weights replaced by float32 copies; same K, no adapter."""
    options = EngineOptions(
        mode="resident", experts_per_token=served.experts_per_token, no_lora=True
    )
    engine = Engine.load(model_dir, options)
    dequantize_model(engine.model)
    return engine


def run_documents(
    engine: Engine, docs: list[list[int]]
) -> tuple[list[np.ndarray], list[np.ndarray], float]:
    """Every MoE layer's input [T, M, H] and executed top-K [T, M, K] over `docs`, and the
    tokens per second of the forward passes."""
    moe = list(engine.moe_layers)
    blocks = [engine.blocks[n] for n in moe]
    for b in blocks:
        b.capture = True
    hs, inds, tokens = [], [], 0
    chunk = max(1, engine.options.prefill_chunk)
    started = time.perf_counter()
    try:
        for d, doc in enumerate(docs):
            cache = engine.step.new_cache()
            for s in range(0, len(doc), chunk):
                piece = doc[s : s + chunk]
                where = f"collecting document {d}"
                engine.step(mx.array(piece)[None], cache, plan_next=False, where=where)
                h = mx.stack([b.last[0][0] for b in blocks], 1)
                ind = mx.stack([b.last[1][0] for b in blocks], 1)
                mx.eval(h, ind)
                hs.append(np.array(h.astype(mx.float32)))
                inds.append(np.array(ind))
                tokens += len(piece)
    finally:
        for b in blocks:
            b.capture = False
    seconds = time.perf_counter() - started
    return hs, inds, tokens / max(seconds, 1e-9)


def set_agreement(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per layer, mean |a & b| / K over tokens; a, b [T, M, K] expert ids."""
    hit = (a[..., :, None] == b[..., None, :]).any(axis=-1)  # [T, M, K]
    return hit.mean(axis=(0, 2))


def compare(
    served: tuple,
    fast: tuple,
    moe_layers: list[int],
    min_agreement: float = MIN_AGREEMENT,
) -> dict:
    """The check's figures from `run_documents` of both paths; `ok` when every layer agrees."""
    h_s, i_s = np.concatenate(served[0]), np.concatenate(served[1])
    h_f, i_f = np.concatenate(fast[0]), np.concatenate(fast[1])
    agree = set_agreement(i_f, i_s)
    diff = np.abs(h_f - h_s).max(axis=(0, 2))
    scale = np.abs(h_s).max(axis=(0, 2))
    worst = int(np.argmin(agree))
    return {
        "tokens": int(len(i_s)),
        "min_agreement": min_agreement,
        "agreement": [float(v) for v in agree],
        "mean_agreement": float(agree.mean()),
        "worst_layer": moe_layers[worst],
        "worst_agreement": float(agree[worst]),
        "feature_max_abs_diff": [float(v) for v in diff],
        "feature_max_rel_diff": float((diff / np.maximum(scale, 1e-12)).max()),
        "served_tok_s": served[2],
        "float32_tok_s": fast[2],
        "ok": bool(agree.min() >= min_agreement),
    }


def check_float32(
    model_dir,
    served_options: EngineOptions,
    fast: Engine,
    docs: list[list[int]],
    min_agreement: float = MIN_AGREEMENT,
) -> dict:
    """Run the served path and `fast` on `docs`; raise CheckpointError when they disagree."""
    served = Engine.load(model_dir, served_options)
    try:
        ref = run_documents(served, docs)
    finally:
        served.close()
    result = compare(
        ref, run_documents(fast, docs), list(fast.moe_layers), min_agreement
    )
    if not result["ok"]:
        raise CheckpointError(
            f"{model_dir}: the float32 collector routes layer {result['worst_layer']} like the "
            f"served int4 path on only {result['worst_agreement']:.3f} of top-K slots over "
            f"{result['tokens']} tokens (required {min_agreement}); collect with --collect "
            f"served"
        )
    return result
