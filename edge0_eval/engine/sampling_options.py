"""The sampling options both arms take, defined and checked once (no MLX here: the OpenCompass
wrappers check a model config before anything loads).

Filters are mlx-lm's `make_sampler` options, applied in its order: top_p, min_p, top_k, then
temperature. Penalties are mlx-lm's `make_logits_processors` options, with its semantics: each
acts on the row's last `*_context_size` tokens (mlx-lm's default: 20), the prompt included —
not, as in vLLM or the OpenAI API, on every generated token and none of the prompt.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from edge0_eval.errors import ConfigError

FILTER_KEYS = ("temperature", "top_p", "top_k", "min_p")
PENALTIES = ("repetition_penalty", "presence_penalty", "frequency_penalty")
PENALTY_KEYS = tuple(
    k for p in PENALTIES for k in (p, p.replace("penalty", "context_size"))
)


def check_filters(top_k, min_p) -> None:
    """top_k a whole number >= 0 (0: off), min_p in [0, 1) (0: off), as mlx-lm's sampler takes."""
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ConfigError(f"top_k must be a whole number >= 0 (0: off), not {top_k!r}")
    if (
        isinstance(min_p, bool)
        or not isinstance(min_p, (int, float))
        or not 0 <= min_p < 1
    ):
        raise ConfigError(f"min_p must be a number in [0, 1) (0: off), not {min_p!r}")


def _number(value) -> bool:
    return (
        not isinstance(value, bool)
        and isinstance(value, (int, float))
        and math.isfinite(value)
    )


def check_penalties(penalties: Mapping[str, Any]) -> dict:
    """The penalties that are set (None: off), as keyword arguments of mlx-lm's
    `make_logits_processors`; one clear error for an unknown key or a value it would misuse."""
    unknown = sorted(set(penalties) - set(PENALTY_KEYS))
    if unknown:
        raise ConfigError(
            f"unknown penalty options {unknown}; known: {', '.join(PENALTY_KEYS)}"
        )
    out = {k: v for k, v in penalties.items() if v is not None}
    rep = out.get("repetition_penalty")
    if rep is not None and not (_number(rep) and rep > 0):
        raise ConfigError(
            f"repetition_penalty must be a number > 0 (1: no effect; it divides "
            f"positive logits and multiplies negative ones), not {rep!r}"
        )
    for key in ("presence_penalty", "frequency_penalty"):
        if key in out and not _number(out[key]):
            raise ConfigError(
                f"{key} must be a finite number (subtracted from the logits of "
                f"recent tokens), not {out[key]!r}"
            )
    for penalty in PENALTIES:
        size = penalty.replace("penalty", "context_size")
        if size not in out:
            continue
        value = out[size]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(
                f"{size} must be a whole number >= 1 (the recent tokens the "
                f"penalty looks at), not {value!r}"
            )
        if penalty not in out:
            raise ConfigError(
                f"{size} has no effect without {penalty}; set both or neither"
            )
    return out


def penalties_of(options: Mapping[str, Any]) -> dict:
    """The penalty options in a resolved sampling dict (see model_wrappers.chat)."""
    return {k: options[k] for k in PENALTY_KEYS if options.get(k) is not None}
