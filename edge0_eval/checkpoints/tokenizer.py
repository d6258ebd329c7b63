"""A small byte-level BPE tokenizer with a chat template, built offline and deterministically.

Tiny checkpoints need a tokenizer that `mlx_lm.load` and transformers' AutoTokenizer both load
without a hub; training one on a fixed embedded corpus gives the same files for every run.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# ChatML, the layout Qwen models use; `enable_thinking` is accepted and ignored so callers can
# pass it uniformly to teacher and student.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = """
The quick brown fox jumps over the lazy dog. A mixture of experts routes each token to a few experts.
def add(a, b):
    return a + b
Question: What is 2 + 2? Answer: 4. The answer is (A). Let's think step by step.
Write a function that returns the sum of a list of numbers. Respond in lowercase letters only.
import math
for i in range(10):
    print(i * i)
Experts are read from the disk on demand and kept in a small pool of slots in memory.
Which of the following is correct? (A) one (B) two (C) three (D) four
The prerouter predicts the next layer's experts one token ahead so reads overlap compute.
"""


def build_tokenizer(out_dir: str | Path, vocab_size: int = 512) -> int:
    """Train and save tokenizer.json, tokenizer_config.json and special_tokens_map.json.

    Returns the tokenizer's vocabulary size (the model's embedding rows must cover it).
    """
    out = Path(out_dir)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = [line for line in _CORPUS.splitlines() if line.strip()]
    tok.train_from_iterator(lines * 4, trainer=trainer)
    tok.save(str(out / "tokenizer.json"))

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": 32768,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {
            str(tok.token_to_id(t)): {
                "content": t,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for t in SPECIAL_TOKENS
        },
    }
    (out / "tokenizer_config.json").write_text(
        json.dumps(config, indent=2, sort_keys=True)
    )
    special = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    (out / "special_tokens_map.json").write_text(
        json.dumps(special, indent=2, sort_keys=True)
    )
    return tok.get_vocab_size()
