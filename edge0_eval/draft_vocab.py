"""`edge0-eval draft-vocab MODEL --text FILE --out FILE`: a draft vocabulary for a draft hedge.

Counts the tokens of the given text with the model's tokenizer and writes the N most frequent
ids, most frequent first (formats/draft_file.py). Passed as the hedge (`--hedge FILE`, or saved as
`prerouter_hedge.safetensors` beside the model) of next-token prerouter heads, it drafts each
next token from those N rows of the LM head before the LM head runs, and stages the heads' sets
at the draft. Counted frequency matters: on the testbed, ids taken in tokenizer order gave a
much worse draft (reports/hedge/, "A draft-token hedge").
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edge0_eval.arguments import value_types as ct
from edge0_eval.arguments.fields import add_fields, option
from edge0_eval.engine.engine import Engine
from edge0_eval.engine.options import EngineOptions
from edge0_eval.errors import ConfigError
from edge0_eval.formats.draft_file import save_draft_vocab
from edge0_eval.training.corpus import read_documents, tokenize_documents


@dataclass
class DraftVocabOptions:
    """draft-vocab's options, each declared once (its flag from the field)."""

    model: str = option(
        help="converted model directory (edge0-eval convert)", flag="model"
    )
    text: list[str] = option(
        help='text to count (.jsonl with a "text" field, or plain text); repeatable',
        required=True,
        action="append",
    )
    out: str = option(
        help="draft vocabulary to write (.safetensors)",
        type=ct.output_path,
        required=True,
    )
    tokens: int = option(
        4096, "ids to keep, most frequent first (default 4096)", type=ct.positive_int
    )
    max_tokens: int = option(2_000_000, "tokens to count at most", type=ct.positive_int)
    max_doc_tokens: int = option(
        4096, "tokens per document at most", type=ct.positive_int
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_fields(parser, DraftVocabOptions)


def run(args: argparse.Namespace) -> int:
    probe = Engine.load(
        args.model, EngineOptions(mode="reactive", no_lora=True, no_prerouter=True)
    )
    try:
        vocab = int(probe.family.embedding(probe.model).weight.shape[0])
        if args.tokens > vocab:  # before reading and tokenizing the text
            raise ConfigError(
                f"--tokens {args.tokens} exceeds the model's vocabulary of {vocab}"
            )
        texts = read_documents(args.text)
        docs = tokenize_documents(
            probe.tokenizer, texts, args.max_tokens, args.max_doc_tokens
        )
    finally:
        probe.close()
    if not docs:
        raise ConfigError(
            f"{', '.join(args.text)}: no document of two or more tokens to count"
        )
    ids = np.concatenate([np.asarray(t, dtype=np.int64) for _, t in docs])
    counts = np.bincount(ids, minlength=vocab)[:vocab]
    seen = int((counts > 0).sum())
    # Most frequent first; ids never seen follow in id order (a stable sort), so a small text
    # still gives the N asked for.
    ranked = np.argsort(-counts, kind="stable")[: args.tokens]
    path = save_draft_vocab(
        args.out,
        ranked,
        vocab,
        {
            "source": "draft-vocab",
            "model": Path(args.model).resolve().name,
            "tokens_counted": len(ids),
            "distinct_tokens": seen,
        },
    )
    covered = counts[ranked].sum() / len(ids)
    print(
        f"wrote {path}: {args.tokens} of {vocab} ids ({args.tokens / vocab:.1%} of the LM "
        f"head), most frequent first, from {len(ids):,} tokens ({seen:,} distinct); they "
        f"cover {covered:.1%} of the counted tokens"
        f"{'' if seen >= args.tokens else f'; the last {args.tokens - seen} were never seen'}"
    )
    return 0
