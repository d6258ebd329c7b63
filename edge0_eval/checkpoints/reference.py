"""mlx-lm's own model over a converted directory, with every expert resident.

The numerical and speed reference for the engine: the same quantized weights, loaded into mlx-lm's
model class with the experts re-stacked from `experts.bin` (so it needs memory for all of them).
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.utils import _get_classes, load_tokenizer

from edge0_eval.engine.families import FAMILIES
from edge0_eval.engine.mlx_compat import (
    activation_dtype,
    cast_floating,
    quantize_like_mlx_lm,
    refuse_unserved_experts,
    resolve_compute_dtype,
)
from edge0_eval.engine.store import ExpertStore
from edge0_eval.formats.config import eos_token_ids
from edge0_eval.formats.layout import (
    INDEX_NAME,
    RESIDENT_NAME,
    ExpertIndex,
    unpack_bundle,
)


def load_reference(
    directory: str | Path,
    compute_dtype: str = "auto",
    experts_per_token: int | None = None,
):
    """Returns (mlx-lm model, tokenizer) for a converted directory, all experts in memory.

    `compute_dtype` applies the engine's dtype policy (see mlx_compat) so both run alike.
    """
    directory = Path(directory)
    config = json.loads((directory / "config.json").read_text())
    index = ExpertIndex.load(directory)
    refuse_unserved_experts(
        index, directory / INDEX_NAME, activation_dtype(compute_dtype, directory)
    )
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    weights = dict(mx.load(str(directory / RESIDENT_NAME)))
    store = ExpertStore(directory, index)
    try:
        for layer in index.moe_layers:
            layout = index.layout(layer)
            bundles = [
                unpack_bundle(layout, store.read(layer, e))
                for e in range(index.num_experts)
            ]
            prefix = index.module_path.format(layer=layer)
            for spec in layout.tensors:
                stacked = mx.array(np.stack([b[spec.name] for b in bundles]))
                if spec.dtype == "bfloat16":
                    stacked = stacked.view(mx.bfloat16)
                weights[f"{prefix}.{spec.name}"] = stacked
    finally:
        store.close()
    quantize_like_mlx_lm(model, config, weights)
    model.load_weights(list(weights.items()), strict=True)
    cast_floating(model, resolve_compute_dtype(compute_dtype))
    if experts_per_token is not None:
        set_experts_per_token(model, experts_per_token)
    model.eval()
    mx.eval(model.parameters())
    tokenizer = load_tokenizer(
        directory, eos_token_ids=eos_token_ids(directory, config)
    )
    return model, tokenizer


def set_experts_per_token(model, experts_per_token: int) -> None:
    """Serve mlx-lm's MoE blocks at `experts_per_token` (instance attributes; classes untouched)."""
    family = FAMILIES[model.model_type]
    for i in family.moe_layers(model):
        block = model.layers[i].mlp
        # where the family's mlx-lm block keeps its k: its gate module (bailing) or itself
        (block.gate if family.gate_selects else block).top_k = experts_per_token
