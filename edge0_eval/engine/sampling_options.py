"""The sampling options both arms take, defined and checked once (no MLX here: the OpenCompass
wrappers check a model config before anything loads).

Filters are mlx-lm's `make_sampler` options, applied in its order: top_p, min_p, top_k, then
temperature. Penalties are mlx-lm's `make_logits_processors` options, with its semantics: each
acts on the row's last `*_context_size` tokens (mlx-lm's default: 20), the prompt included —
not, as in vLLM or the OpenAI API, on every generated token and none of the prompt. The ranges
are vLLM's (and the OpenAI API's): temperature in [0, 2], presence and frequency penalties in
[-2, 2], so a value a served arm would refuse is refused in-process too.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from edge0_eval.errors import ConfigError

FILTER_KEYS = ("temperature", "top_p", "top_k", "min_p")
MAX_TEMPERATURE = 2.0  # vLLM's and the OpenAI API's bound
MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-2, 2], as in vLLM
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


def check_temperature(temperature) -> None:
    """temperature a number in [0, 2] (0: greedy), as vLLM checks it."""
    if not (_number(temperature) and 0 <= temperature <= MAX_TEMPERATURE):
        raise ConfigError(
            f"temperature must be a number in [0, {MAX_TEMPERATURE:g}] (0: greedy), "
            f"not {temperature!r}"
        )


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
        if key in out and not (_number(out[key]) and abs(out[key]) <= MAX_PENALTY):
            raise ConfigError(
                f"{key} must be a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}] "
                f"(subtracted from the logits of recent tokens), not {out[key]!r}"
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
