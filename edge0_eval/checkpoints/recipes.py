"""Named mixed-quantization recipes, as the `quant_predicate` mlx-lm's `quantize_model` and
`mlx_lm.convert` take: mlx-lm's own (`mixed_2_6` ... `mixed_4_6`, built by mlx-lm) and two
shaped after the low-bit uploads made for 16-24 GB Macs:

  experts_2_3   routed experts' gate/up 2-bit and down 3-bit (affine, group 64); everything
                else as the model's own predicate and the default bits say
  config_i      Config-I style: the first and last decoder layers 8-bit throughout, routed
                experts of the layers between as experts_2_3, routers (`mlp.gate`,
                `shared_expert_gate`) left in float; the rest at the default bits

`make-synthetic --recipe NAME` writes a checkpoint quantized by one, and tests build tiny
checkpoints with `mlx_lm.convert(quant_predicate=recipe_predicate(NAME, model))`.
"""

from __future__ import annotations

import re

from mlx_lm.convert import QUANT_RECIPES, mixed_quant_predicate_builder

from edge0_eval.errors import ConfigError

RECIPES = (*QUANT_RECIPES, "experts_2_3", "config_i")
EXPERT_BITS = {
    "gate_proj": 2,
    "up_proj": 2,
    "down_proj": 3,
}  # experts_2_3, per projection
EXPERT_GROUP_SIZE = 64
BOUNDARY_BITS = 8  # config_i's first and last layers
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_ROUTERS = (".mlp.gate", ".shared_expert_gate")


def _layer(path: str) -> int | None:
    match = _LAYER.search(path)
    return int(match.group(1)) if match else None


def _expert_bits(path: str) -> dict | None:
    """experts_2_3's entry for a routed-expert projection; None for any other module."""
    if ".switch_mlp." not in path:
        return None
    proj = path.rsplit(".", 1)[-1]
    return {
        "group_size": EXPERT_GROUP_SIZE,
        "bits": EXPERT_BITS[proj],
        "mode": "affine",
    }


def recipe_predicate(name: str, model, group_size: int | None = None):
    """The quant_predicate of recipe `name` for mlx-lm model `model` (its layer count and
    its own predicate, which keeps routers at 8 bits, are read from it)."""
    if name in QUANT_RECIPES:
        return mixed_quant_predicate_builder(name, model, group_size)
    if name not in RECIPES:
        raise ConfigError(
            f"unknown quantization recipe {name!r}; choose one of {', '.join(RECIPES)}"
        )
    own = getattr(model, "quant_predicate", None)
    last = len(model.layers) - 1

    def experts_2_3(path, module):
        expert = _expert_bits(path)
        if expert is not None:
            return expert
        return own(path, module) if own is not None else True

    def config_i(path, module):
        if path.endswith(_ROUTERS):
            return False
        if _layer(path) in (0, last):
            return {"group_size": 64, "bits": BOUNDARY_BITS, "mode": "affine"}
        return _expert_bits(path) or True

    return experts_2_3 if name == "experts_2_3" else config_i
