"""Training batches of stages 2 and 3: examples (prompt + completion ids), padded batches, and
which examples a step uses - pure functions of (seed, step), so a resumed run sees the same data."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import numpy as np


@dataclass
class Example:
    prompt: list[int]
    completion: list[int]


@dataclass
class Batch:
    tokens: np.ndarray  # [B, L] model input (sequence without its last token)
    targets: np.ndarray  # [B, L] next token
    valid: np.ndarray  # [B, L] real positions
    loss_mask: np.ndarray  # [B, L] positions that predict a completion token
    n_true: np.ndarray  # [B] positions routed with the true router (the prompt)

    @property
    def n_loss(self) -> int:
        return int(self.loss_mask.sum())


def fit(example: Example, seq_len: int) -> Example | None:
    """Cut the completion so prompt + completion <= seq_len; None if no completion token fits."""
    room = seq_len - len(example.prompt)
    if room < 1 or not example.completion:
        return None
    return Example(example.prompt, example.completion[:room])


def collate(examples: list[Example], pad_id: int = 0) -> Batch:
    seqs = [e.prompt + e.completion for e in examples]
    length = max(len(s) for s in seqs) - 1
    b = len(seqs)
    tokens = np.full((b, length), pad_id, np.int32)
    targets = np.full((b, length), pad_id, np.int32)
    valid = np.zeros((b, length), bool)
    loss_mask = np.zeros((b, length), bool)
    for i, (e, s) in enumerate(zip(examples, seqs)):
        n = len(s) - 1
        tokens[i, :n] = s[:-1]
        targets[i, :n] = s[1:]
        valid[i, :n] = True
        loss_mask[i, len(e.prompt) - 1 : n] = True
    n_true = np.array([len(e.prompt) for e in examples])
    return Batch(tokens, targets, valid, loss_mask, n_true)


def batch_indices(step: int, batch: int, n: int, seed: int) -> list[int]:
    """The train-example ids of `step`: consecutive seeded epoch permutations (pure in step)."""
    out = []
    start = step * batch
    for pos in range(start, start + batch):
        epoch, i = divmod(pos, n)
        out.append(int(np.random.default_rng([seed, 1, epoch]).permutation(n)[i]))
    return out


def stable_seed(*parts) -> int:
    h = hashlib.sha256(json.dumps(parts).encode()).digest()
    return int.from_bytes(h[:4], "little") & 0x7FFFFFFF
