"""A row's prompt, defined once for every way a model is asked: the OpenCompass wrappers
(model_wrappers/chat.py) and the OpenAI-compatible server (edge0_eval/server/). No MLX,
OpenCompass or torch here.

A prompt is its messages through the tokenizer's chat template (`chat_ids`), cut to the
context (`fit_prompt`), and its sampling seed (`row_seed`). An OpenCompass prompt becomes
messages by `to_messages` (every OpenCompass arm: in-process and served alike, since the API
arm sends those messages); a served request's messages go to the template as sent. When the
row stops and what it reports are the row's own (rows.py).
"""

from __future__ import annotations

import hashlib
from typing import Any, Dict, List

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
