"""What a row is given, defined and checked once for every way a model is asked: its prompt
and its sampling options. The OpenCompass wrappers (model_wrappers/) and the OpenAI-compatible
server (edge0_eval/server/) read the same functions. No MLX, OpenCompass or torch here: the
wrappers check a model config before anything loads.

A prompt is its messages through the tokenizer's chat template (`chat_ids`), cut to the
context (`fit_prompt`), and its sampling seed (`row_seed`). An OpenCompass prompt becomes
messages by `to_messages` (every OpenCompass arm: in-process and served alike, since the API
arm sends those messages); a served request's messages go to the template as sent. When the
row stops, how it draws and what it reports are the row's own (batch.py).

Sampling options, the same for both arms: filters are mlx-lm's `make_sampler` options, applied
in its order: top_p, min_p, top_k, then temperature. Penalties are mlx-lm's
`make_logits_processors` options, with its semantics: each acts on the row's last
`*_context_size` tokens (mlx-lm's default: 20), the prompt included — not, as in vLLM or the
OpenAI API, on every generated token and none of the prompt. The ranges are vLLM's (and the
OpenAI API's): temperature in [0, 2], presence and frequency penalties in [-2, 2], so a value a
served arm would refuse is refused in-process too.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any, Dict, List, Mapping

from edge0_eval.errors import ConfigError

# -- prompts -----------------------------------------------------------------------------
# OpenCompass's PromptList roles and the OpenAI roles, onto chat template roles.
ROLE_MAP = {
    "HUMAN": "user",
    "BOT": "assistant",
    "SYSTEM": "system",
    "user": "user",
    "assistant": "assistant",
    "system": "system",
}


def to_messages(prompt: Any) -> List[Dict[str, str]]:
    """What OpenCompass hands a model, as chat messages (its arms' convention, not a server's).

    Accepts a plain string, a PromptList of {'role': HUMAN|BOT|SYSTEM, 'prompt': ...} items (the
    PromptTemplate configs) or a list of {'role', 'content'} dicts (the *_rawprompt_* configs).
    Consecutive turns of one role are merged, as OpenCompass's HF chat wrapper does; empty
    turns are dropped. The server never calls this: a request's messages are the client's.
    """
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    else:
        messages = []
        for item in prompt:
            if isinstance(item, str):
                if item.strip():
                    messages.append({"role": "user", "content": item})
                continue
            if "section" in item and "pos" in item:
                continue
            role = ROLE_MAP.get(item.get("role"))
            if role is None:
                raise ValueError(
                    f"unknown prompt role {item.get('role')!r} in {item!r}"
                )
            content = item["content"] if "content" in item else item.get("prompt", "")
            if content is None or content == "":
                continue
            messages.append({"role": role, "content": str(content)})
    merged: List[Dict[str, str]] = []
    for msg in messages:
        if merged and merged[-1]["role"] == msg["role"]:
            merged[-1] = {
                "role": msg["role"],
                "content": merged[-1]["content"] + "\n" + msg["content"],
            }
        else:
            merged.append(dict(msg))
    return merged


def chat_text(tokenizer, messages: List[Dict], chat_template_kwargs: Dict) -> str:
    """The messages, as given, as the chat template writes them, ready for the assistant's
    turn (the template decides what consecutive roles or a 'developer' turn mean)."""
    if not isinstance(messages, list):
        raise TypeError(
            f"chat_text takes a list of messages, not {type(messages).__name__} "
            f"(an OpenCompass prompt goes through to_messages first)"
        )
    return tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False, **chat_template_kwargs
    )


def chat_ids(tokenizer, messages: List[Dict], chat_template_kwargs: Dict) -> List[int]:
    # The chat template already holds any BOS/special tokens the model wants.
    return list(
        tokenizer.encode(
            chat_text(tokenizer, messages, chat_template_kwargs),
            add_special_tokens=False,
        )
    )


def fit_prompt(ids: List[int], max_seq_len: int, max_out_len: int) -> List[int]:
    """Keep the head and tail of an over-long prompt (OpenCompass's 'mid' truncation) so that
    prompt + output fit max_seq_len; the prompt as is when they fit (or max_out_len alone does
    not)."""
    budget = max_seq_len - max_out_len
    if budget <= 0 or len(ids) <= budget:
        return ids
    half = budget // 2
    return ids[:half] + ids[len(ids) - (budget - half) :]


def row_seed(seed: int, prompt_ids: List[int], sample: int = 0) -> int:
    """One sample's sampling seed, from the configured seed, its prompt and its sample index.

    So a sample never depends on its batch mates, its place in a batch or what ran before it:
    a run is reproducible at any `batch_size` and after a resume, and each question draws its
    own stream. `sample` tells a question's repeats apart (OpenCompass's dataset `n` copies a
    prompt unchanged; the inferencer passes each copy's index): copy j of a question draws the
    same stream in every run, and sample 0 keeps the seed it had before repeats existed.
    """
    text = f"{int(seed)}:" + ",".join(str(int(t)) for t in prompt_ids)
    if sample:
        text += f"#{int(sample)}"
    return (
        int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "little")
        & 0x7FFFFFFF
    )


# -- sampling options --------------------------------------------------------------------
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
    # A penalty that changes nothing (repetition 1, presence or frequency 0) is off: mlx-lm
    # would still run it, and a row with a processor leaves the batched greedy path.
    for penalty, neutral in zip(PENALTIES, (1, 0, 0)):
        if penalty in out and out[penalty] == neutral:
            del out[penalty]
            out.pop(penalty.replace("penalty", "context_size"), None)
    return out


def penalties_of(options: Mapping[str, Any]) -> dict:
    """The penalty options in a resolved sampling dict (see model_wrappers.models.chat)."""
    return {k: options[k] for k in PENALTY_KEYS if options.get(k) is not None}
