"""A MoE checkpoint mlx-lm loads -> the streaming layout (`edge0-eval convert SRC OUT`).

OUT holds `resident.safetensors` (every non-expert weight, mlx-lm names), `experts.bin` +
`experts.index.json` (one page-aligned bundle per (MoE layer, expert), see `layout.py`), the
config and the tokenizer files.

- SRC is read through the model's own mlx-lm `sanitize`, so mlx-community conversions (vision
  and MTP weights dropped) and original Hugging Face layouts convert alike.
- A quantized SRC (config has "quantization") is repacked bit for bit: nothing is requantized;
  each expert projection keeps its bits, group size and mode (affine, mxfp4, mxfp8, nvfp4), so
  mixed recipes (mlx-lm's mixed_4_6, per-layer and per-projection bits) stay as they are.
- An fp16/bf16/fp32 SRC is quantized exactly as `mlx_lm.utils.quantize_model` would (same
  predicate, so routers stay 8-bit; same config), but one tensor / one layer's experts at a time.

The whole model is never held in memory: source tensors are read one at a time, the mlx-lm model is
built lazily (its random init is never evaluated) only to learn names, shapes and the
quantization plan, and experts are converted and written one decoder layer at a time.

Reading SRC is `source.py`, deciding names, shapes and quantization `conversion_plan.py`,
writing the streaming layout `writer.py`; this module runs them in order and quantizes what
needs it.
"""

from __future__ import annotations

import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx
from mlx_lm.utils import save_config
from tqdm import tqdm

from edge0_eval.checkpoints.conversion_plan import Plan, make_plan, new_index
from edge0_eval.checkpoints.source import Checkpoint, to_numpy
from edge0_eval.checkpoints.writer import (
    BundleWriter,
    check_free_space,
    check_out_empty,
    copy_side_files,
    file_digests,
    output_dir,
)
from edge0_eval.formats.layout import EXPERTS_NAME, RESIDENT_NAME


def _write_resident(ckpt: Checkpoint, plan: Plan, path: Path) -> None:
    """Non-expert weights: copied, or quantized per tensor exactly as quantize_model does."""
    out = {}
    for name in plan.resident_names:
        module, _, leaf = name.rpartition(".")
        q = plan.quantize_resident.get(module)
        if q is not None and leaf == "weight":
            group, bits, mode = q
            # What QuantizedLinear/QuantizedEmbedding.from_* do with the weight.
            w, scales, *biases = mx.quantize(ckpt.take(name), group, bits, mode=mode)
            out[f"{module}.weight"], out[f"{module}.scales"] = w, scales
            if biases:
                out[f"{module}.biases"] = biases[0]
            mx.eval(w, scales, *biases)
        else:
            out[name] = ckpt.take(name)
    mx.save_safetensors(str(path), out, metadata={"format": "mlx"})


def _expert_source(ckpt: Checkpoint, plan: Plan, layer: int):
    """expert e -> its bundle arrays, for one layer (quantizing the layer first if SRC is fp)."""
    path, layout = plan.switches[layer].path, plan.layouts[layer]
    if ckpt.quantization is not None:
        stacked = {name: to_numpy(ckpt.take(f"{path}.{name}")) for name in layout.names}
    else:
        stacked = {}
        for proj, q in layout.quant.items():
            # Exactly what QuantizedSwitchLinear._quantize does with the stacked [E, out, in].
            parts = mx.quantize(
                ckpt.take(f"{path}.{proj}.weight"), q.group_size, q.bits, mode=q.mode
            )
            mx.eval(*parts)
            for part, value in zip(q.parts, parts):
                stacked[f"{proj}.{part}"] = to_numpy(value)
    return lambda e: {name: value[e] for name, value in stacked.items()}


def convert(
    src: str | Path,
    out: str | Path,
    bits: int | None = None,
    group_size: int | None = None,
    progress: bool = True,
) -> Path:
    """Convert checkpoint `src` into the streaming layout at `out`. Returns `out`.

    `bits`/`group_size` default to 4/64 for a float SRC; for a quantized SRC they must be
    omitted or match it (it is repacked, never requantized, whatever mix of bits, group sizes
    and modes mlx-lm loads it with).
    """
    check_out_empty(out)  # the cheapest check first
    ckpt = Checkpoint(src)
    plan = make_plan(ckpt, bits, group_size)
    index = new_index(plan, ckpt.model_type)
    with output_dir(out) as tmp:
        resident_bytes = sum(ckpt.nbytes(n) for n in plan.resident_names)
        check_free_space(tmp, index.file_size + resident_bytes)
        # Hash SRC in the background: hashlib releases the GIL, so it overlaps conversion.
        stop, pool = threading.Event(), ThreadPoolExecutor(max_workers=1)
        digests = pool.submit(file_digests, ckpt.source_files(), stop)
        try:
            _write_resident(ckpt, plan, tmp / RESIDENT_NAME)
            writer = BundleWriter(tmp / EXPERTS_NAME, index)
            try:
                for layer in tqdm(
                    plan.moe_layers,
                    desc="convert experts",
                    unit="layer",
                    disable=not progress,
                ):
                    writer.write_layer(layer, _expert_source(ckpt, plan, layer))
            finally:
                writer.close()
            index.source = digests.result()
        finally:
            stop.set()  # on failure, do not wait for a full hash of SRC
            pool.shutdown()
        index.validate(tmp)
        index.save(tmp)
        if plan.copy_config:
            shutil.copy2(ckpt.path / "config.json", tmp / "config.json")
        else:
            save_config(plan.config, tmp / "config.json")
        copy_side_files(ckpt.path, tmp)
    return Path(out)
