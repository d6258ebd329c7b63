"""The model-family registry: one module per supported mlx-lm `model_type` (as mlx-lm's
`models/<type>.py`), each holding its `FAMILY` entry (base.py: what an entry is), its
streaming MoE block and its layers' call arguments. Adding a family is one module here, one
line in `FAMILIES`, and its tiny shape (checkpoints/tiny_configs.py, keyed by the family's
name). `open_model_dir` and `check_model_dir` open a converted model with this registry (the
files' checks: formats/).
"""

from __future__ import annotations

from pathlib import Path

from edge0_eval.engine.families import bailing_hybrid, qwen2_moe, qwen3_5_moe
from edge0_eval.engine.families.base import Family
from edge0_eval.errors import CheckpointError
from edge0_eval.formats import model_dir
from edge0_eval.formats.layout import ExpertIndex

FAMILIES = {m.FAMILY.name: m.FAMILY for m in (qwen3_5_moe, bailing_hybrid, qwen2_moe)}


def family_for(config: dict, where: str = "config.json") -> Family:
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        raise CheckpointError(
            f"{where}: model_type {model_type!r} is not supported; supported: "
            f"{', '.join(FAMILIES)}"
        )
    return FAMILIES[model_type]


def open_model_dir(directory: str | Path) -> tuple[dict, Family, ExpertIndex]:
    """A converted model's config.json, family and expert index, checked against each other
    (formats/model_dir.py, with this registry)."""
    return model_dir.open_model_dir(directory, family_for)


def check_model_dir(directory: str | Path, verify_crc: bool = True) -> None:
    """What Engine.load checks before reading weights, without loading any (a preflight)."""
    model_dir.check_model_dir(directory, family_for, verify_crc)
