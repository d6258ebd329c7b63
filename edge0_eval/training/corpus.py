"""Training text of the three stages: stage 1's documents, stages 2 and 3's prompts, their
held-out splits and their encoding.

Stages 2 and 3, `--prompts` files: `.jsonl` gives one prompt per line from its string field
"prompt"; any other file gives one prompt per non-empty line. Every prompt is wrapped as a single
user turn in the student's chat template (`add_generation_prompt=True`), encoded exactly the way
the OpenCompass wrappers encode prompts (template text, then `encode(add_special_tokens=False)`).
Held-out prompts: `--eval-prompts FILE`, else a seeded `--heldout` fraction of `--prompts`
(at least one prompt each side).

Stage 1, `--text` files: plain text is one document per file; `.jsonl` gives one document per
line, from its "text" field, or else "prompt" + "completion" concatenated. Held out by document.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edge0_eval.errors import ConfigError
from edge0_eval.formats.jsonl import iter_jsonl


def _read(p: str | Path, what: str) -> tuple[Path, str]:
    path = Path(p)
    if not path.is_file():
        raise ConfigError(f"{what} {path}: no such file")
    return path, path.read_text(encoding="utf-8", errors="replace")


# -- stages 2 and 3: prompts -----------------------------------------------------------------------


def read_prompts(paths: list[str], what: str = "--prompts") -> list[str]:
    """Prompts from text files (one per non-empty line) and .jsonl files (field "prompt")."""
    prompts = []
    for p in paths:
        path, raw = _read(p, what)
        if path.suffix.lower() == ".jsonl":
            for lineno, record in iter_jsonl(path, raw):
                if not isinstance(record.get("prompt"), str):
                    raise ConfigError(
                        f'{path}:{lineno}: needs a string field "prompt" '
                        f"(got {sorted(record)})"
                    )
                if record["prompt"].strip():
                    prompts.append(record["prompt"])
        else:
            prompts.extend(line for line in raw.splitlines() if line.strip())
    if not prompts:
        raise ConfigError(
            f"{what} {' '.join(paths)}: the prompt set is empty (text files: one "
            f'prompt per non-empty line; .jsonl: a "prompt" field per line)'
        )
    return prompts


def encode_prompt(tokenizer, prompt: str) -> list[int]:
    """The prompt as one user turn in the chat template, encoded like the OpenCompass wrappers."""
    messages = [{"role": "user", "content": prompt}]
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        return list(tokenizer.encode(text, add_special_tokens=False))
    return list(tokenizer.encode(prompt))


def split_prompts(n: int, heldout: float, seed: int) -> tuple[list[int], list[int]]:
    """(train ids, held-out ids): a seeded shuffle, at least one each."""
    if n < 2:
        raise ConfigError(
            f"need at least 2 prompts to hold some out (got {n}); add prompts or "
            f"give --eval-prompts"
        )
    order = np.random.default_rng([seed, 7]).permutation(n).tolist()
    n_hold = min(n - 1, max(1, round(heldout * n)))
    return sorted(order[n_hold:]), sorted(order[:n_hold])


# -- stage 1: documents ----------------------------------------------------------------------------


@dataclass
class Document:
    name: str
    text: str


def read_documents(paths: list[str]) -> list[Document]:
    """Plain text: one document per file. JSONL: one per line, "text" else prompt+completion."""
    docs = []
    for p in paths:
        path, raw = _read(p, "--text")
        if path.suffix.lower() != ".jsonl":
            if raw.strip():
                docs.append(Document(str(path), raw))
            continue
        for lineno, record in iter_jsonl(path, raw):
            pair = (record.get("prompt"), record.get("completion"))
            if isinstance(record.get("text"), str):
                text = record["text"]
            elif any(isinstance(part, str) for part in pair):
                text = "".join(str(part or "") for part in pair)
            else:
                raise ConfigError(
                    f'{path}:{lineno}: no string field "text" (or "prompt"/'
                    f'"completion"); keys are {sorted(record)}'
                )
            if text.strip():
                docs.append(Document(f"{path}:{lineno}", text))
    return docs


def tokenize_documents(
    tokenizer, docs: list[Document], max_tokens: int, max_doc_tokens: int
) -> list[tuple[str, list[int]]]:
    """(name, ids) of each document of 2+ tokens: at most max_doc_tokens each, max_tokens in all."""
    out, budget = [], max_tokens
    for doc in docs:
        if budget < 2:
            break
        toks = encode_prefix(tokenizer, doc.text, min(max_doc_tokens, budget))
        if len(toks) < 2:
            continue
        out.append((doc.name, toks))
        budget -= len(toks)
    return out


def encode_prefix(tokenizer, text: str, n: int) -> list[int]:
    """The first n tokens of `text`, encoding only a growing character prefix (big files)."""
    chars = 8 * n
    while True:
        if chars >= len(text):
            return list(tokenizer.encode(text))[:n]
        toks = list(tokenizer.encode(text[:chars]))
        if len(toks) > n + 32:  # tokens near the cut may differ from a full encoding
            return toks[:n]
        chars *= 2


def split_documents(
    n_docs: int, holdout: float, seed: int
) -> tuple[list[int], list[int]]:
    """(train doc ids, held-out doc ids): a seeded shuffle, at least one document each."""
    order = list(range(n_docs))
    random.Random(seed).shuffle(order)
    n_hold = min(n_docs - 1, max(1, round(holdout * n_docs)))
    return sorted(order[n_hold:]), sorted(order[:n_hold])


def subset_documents(
    ids: list[int], lengths: list[int], max_tokens: int, seed: int
) -> list[int]:
    """A seeded random subset of documents `ids` holding about `max_tokens` tokens (whole
    documents, the last one that crosses the limit included), sorted; for learning curves."""
    order = list(ids)
    random.Random(f"subset-{seed}").shuffle(order)
    kept, have = [], 0
    for i in order:
        if have >= max_tokens:
            break
        kept.append(i)
        have += lengths[i]
    return sorted(kept)
