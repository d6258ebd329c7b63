"""The testbed's corpus: docstring/function pairs from Python's own standard library, as chat
texts and prompts for the later stages, and token batches for the build's checks."""

from __future__ import annotations

import ast
import json
import re
import sysconfig
from pathlib import Path

import numpy as np

from edge0_eval.errors import ConfigError


def stdlib_pairs(held_out_every: int = 10) -> tuple[list[dict], list[dict]]:
    """(docstring, function source) pairs from Python's own standard library: text that ships
    with every Python, mixes English and code, and is not a benchmark. Every tenth file is
    held out."""
    root = Path(sysconfig.get_paths()["stdlib"])
    fit, held = [], []
    for n, path in enumerate(sorted(root.glob("*.py"))):
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError):
            continue
        lines = _split_lines(source)
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef):
                continue
            doc = ast.get_docstring(node)
            code = _source_segment(lines, node) if doc else None
            if doc and code and len(code) <= 2000:
                pair = {"prompt": doc.split("\n\n")[0], "completion": code}
                (held if n % held_out_every == 0 else fit).append(pair)
    return fit, held


def _split_lines(source: str) -> list[str]:
    """Lines with their ends, split only on \\r\\n, \\n and \\r, as ast.get_source_segment does
    (which re-splits the whole file on every call: 43 s over the stdlib instead of <1 s)."""
    return re.findall(r"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+\Z", source)


def _source_segment(lines: list[str], node: ast.AST) -> str:
    """ast.get_source_segment(source, node) from pre-split lines (column offsets are UTF-8)."""
    first, last = node.lineno - 1, node.end_lineno - 1
    if first == last:
        return lines[first].encode()[node.col_offset : node.end_col_offset].decode()
    head = lines[first].encode()[node.col_offset :].decode()
    tail = lines[last].encode()[: node.end_col_offset].decode()
    return "".join([head, *lines[first + 1 : last], tail])


def chat_texts(tokenizer, pairs: list[dict]) -> list[str]:
    return [
        tokenizer.apply_chat_template(
            [
                {"role": "user", "content": p["prompt"]},
                {"role": "assistant", "content": p["completion"]},
            ],
            tokenize=False,
        )
        for p in pairs
    ]


def write_corpus(directory: Path, tokenizer, fit: list[dict], held: list[dict]) -> None:
    """The corpus for the later stages: chat texts (train-prerouter --text) and prompts
    (train-lora / distill --prompts), fit and held-out files apart."""
    directory.mkdir(parents=True)
    for name, pairs in (("fit", fit), ("held", held)):
        with open(directory / f"{name}_text.jsonl", "w") as f:
            for text in chat_texts(tokenizer, pairs):
                f.write(json.dumps({"text": text}) + "\n")
        with open(directory / f"{name}_prompts.jsonl", "w") as f:
            for pair in pairs:
                f.write(json.dumps({"prompt": pair["prompt"]}) + "\n")


def token_batches(tokenizer, texts: list[str], seq_len: int, count: int) -> np.ndarray:
    """[count, seq_len] token ids from the texts concatenated (deterministic order)."""
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer.encode(text, add_special_tokens=False))
        if len(ids) >= seq_len * count:
            break
    if len(ids) < seq_len * count:
        raise ConfigError(f"corpus too small: {len(ids)} tokens for {count}x{seq_len}")
    return np.array(ids[: seq_len * count], dtype=np.int32).reshape(count, seq_len)
