"""One chat row, defined once for every way a model is asked: the OpenCompass wrappers
(model_wrappers/chat.py) and the OpenAI-compatible server (edge0_eval/server/). No OpenCompass
or torch here, so a server host needs neither.

A row is: its messages (`to_messages`) through the tokenizer's chat template (`chat_ids`), cut to
the context (`fit_prompt`); its sampling seed (`row_seed`); when it stops (`RowStop`,
`stop_token_ids`, `trim_at_stop`); and the per-sample stats a student row reports
(`sample_stats`), so a request served over HTTP equals and reports as the same row in-process.
"""

from __future__ import annotations

import hashlib
from typing import Any, Dict, List, Optional

# OpenCompass's PromptList roles and the OpenAI roles, onto chat template roles.
ROLE_MAP = {
    "HUMAN": "user",
    "BOT": "assistant",
    "SYSTEM": "system",
    "user": "user",
    "assistant": "assistant",
    "system": "system",
}

# Per-sample engine figures gathered under "pool" in each student sample's stats (in a batch,
# bytes_per_token and the hit rates are the batch's: its rows share every read).
POOL_KEYS = (
    "decode_hit_rate",
    "cache_hit_rate",
    "decode_bytes_read",
    "prefill_bytes_read",
    "bytes_per_token",
    "reads_per_token",
    "blocked_load_ms_per_step",
    "bytes_read",
    "evictions",
    "rss_gib",
    "mean_union_per_layer",
    "expert_buffer_mib",
)


def to_messages(prompt: Any) -> List[Dict[str, str]]:
    """Normalise what OpenCompass hands a model (or a request's messages) into chat messages.

    Accepts a plain string, a PromptList of {'role': HUMAN|BOT|SYSTEM, 'prompt': ...} items (the
    PromptTemplate configs) or a list of {'role', 'content'} dicts (the *_rawprompt_* configs,
    an OpenAI request). Consecutive turns of one role are merged, as OpenCompass's HF chat
    wrapper does; empty turns are dropped.
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


def chat_text(tokenizer, prompt: Any, chat_template_kwargs: Dict) -> str:
    """The prompt as the chat template writes it, ready for the assistant's turn."""
    return tokenizer.apply_chat_template(
        to_messages(prompt),
        add_generation_prompt=True,
        tokenize=False,
        **chat_template_kwargs,
    )


def chat_ids(tokenizer, prompt: Any, chat_template_kwargs: Dict) -> List[int]:
    # The chat template already holds any BOS/special tokens the model wants.
    return list(
        tokenizer.encode(
            chat_text(tokenizer, prompt, chat_template_kwargs), add_special_tokens=False
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


def trim_at_stop(text: str, stop_words: List[str]) -> tuple[str, Optional[str]]:
    """Cut `text` at the earliest occurrence of any stop word; returns (text, stop hit)."""
    best, hit = len(text), None
    for stop in stop_words:
        if not stop:
            continue
        pos = text.find(stop)
        if 0 <= pos < best:
            best, hit = pos, stop
    return text[:best], hit


def stop_token_ids(tokenizer, stop_words: List[str]) -> set:
    """EOS ids plus every stop word that is exactly one token (the engine stops on ids)."""
    ids = set(getattr(tokenizer, "eos_token_ids", None) or [])
    for word in stop_words:
        enc = tokenizer.encode(word, add_special_tokens=False)
        if len(enc) == 1:
            ids.add(int(enc[0]))
    return ids


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


class IncrementalText:
    """A row's text as its tokens arrive, decoded incrementally as vLLM does (the text of a few
    tokens before the last read one, decoded with the new ones, less what those few tokens
    read), so it follows `tokenizer.decode` of the whole row, which trims the answer at its stop
    word (trim_at_stop). mlx-lm's streaming detokenizer does not always: it drops the leading
    space of a row's first text (a stop word ' x' opening the answer was never seen, the row
    ran to max_tokens and said 'length') and shows a trailing space a token late."""

    def __init__(self, tokenizer):
        self.decode = tokenizer.decode
        self.tokens: List[int] = []
        self.prefix = self.read = 0  # token offsets: decoded context, already read
        self.text = ""

    def add(self, token: int) -> str:
        """Take the next token; the text it completes ('' while a character is incomplete)."""
        self.tokens.append(token)
        before = self.decode(self.tokens[self.prefix : self.read])
        after = self.decode(self.tokens[self.prefix :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        new = after[len(before) :]
        self.text += new
        self.prefix, self.read = max(self.read - 4, 0), len(self.tokens)
        return new


class RowStop:
    """When one row's generation ends, token by token; both arms and every path share it.

    A stop id ends the row without being output ('eos' for the tokenizer's EOS ids, else
    'stop_token'); `max_tokens` output tokens end it ('length'); a multi-token stop word ends it
    as soon as the row's text (IncrementalText) holds one ('stop_word'; the text is trimmed at
    it later).
    """

    def __init__(
        self, tokenizer, max_tokens: int, stop_ids: set, stop_words: List[str]
    ):
        self.max_tokens = max_tokens
        self.stop_ids = set(stop_ids)
        self.eos_ids = set(getattr(tokenizer, "eos_token_ids", None) or [])
        self.stop_words = [w for w in stop_words if w]
        # Its text; a stream of the row reads the same one (server/worker.py TextStream).
        self.reader = IncrementalText(tokenizer) if self.stop_words else None
        self.tail = ""  # the last characters of the text: enough to hold any stop word
        self.keep = max((len(w) for w in self.stop_words), default=0)
        self.tokens: List[int] = []
        self.finish: Optional[str] = None

    def add(self, token: int) -> bool:
        """Take the next sampled token; True when the row has ended."""
        if self.finish is not None:
            return True
        token = int(token)
        if token in self.stop_ids:
            self.finish = "eos" if token in self.eos_ids else "stop_token"
            return True
        self.tokens.append(token)
        if len(self.tokens) >= self.max_tokens:
            self.finish = "length"
            return True
        if self.reader is not None:
            text = self.tail + self.reader.add(token)
            if any(w in text for w in self.stop_words):
                self.finish = "stop_word"
                return True
            self.tail = text[-self.keep :]
        return False


def sample_stats(
    stats: Dict[str, Any], finish: Optional[str], cache: str
) -> Dict[str, Any]:
    """A student sample's stats from the engine's `stats` for its row: its speeds, how it ended,
    the page-cache label, the pool's figures and the engine's scalar figures."""
    return {
        "prefill_tok_s": stats.get("prefill_tok_s"),
        "decode_tok_s": stats.get("decode_tok_s"),
        "peak_memory_gib": stats.get("peak_memory_gib"),
        "finish_reason": finish or "length",
        "cache": cache,
        "pool": {k: stats[k] for k in POOL_KEYS if k in stats} or None,
        "engine": {k: v for k, v in stats.items() if isinstance(v, (int, float, str))},
    }
