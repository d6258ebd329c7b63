"""The teacher's side of stages 2 and 3: its completions (cached per prompt in
`<out>.ckpt/teacher.jsonl`, resumable) and its log-probabilities of a batch."""

from __future__ import annotations

import json
import os
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler
from tqdm import tqdm

from edge0_eval.training.batches import Example
from edge0_eval.training.state import write_json

TEACHER_DATA = "teacher.jsonl"
TEACHER_META = "teacher.meta.json"


class TeacherData:
    """Teacher completions per prompt, cached in `<ckpt>/teacher.jsonl` (resumable per prompt).

    A line: {"key": K, "prompt": [...], "completion": [...]}. A line cut short by a kill is
    dropped and regenerated. `teacher.meta.json` holds the fingerprint; another teacher, prompt
    set or generation setting starts the file over.
    """

    def __init__(self, directory: Path, fingerprint: dict):
        self.path = directory / TEACHER_DATA
        self.meta = directory / TEACHER_META
        self.fingerprint = fingerprint
        directory.mkdir(parents=True, exist_ok=True)
        self.records: dict[str, dict] = {}
        same = False
        if self.meta.is_file():
            try:
                same = (
                    json.loads(self.meta.read_text()).get("fingerprint") == fingerprint
                )
            except ValueError:
                same = False
        if not same:
            self.path.unlink(missing_ok=True)
            write_json(self.meta, {"fingerprint": fingerprint})
        if self.path.is_file():
            good = []
            for line in self.path.read_text().splitlines():
                try:
                    rec = json.loads(line)
                    self.records[rec["key"]] = rec
                    good.append(line)
                except (ValueError, KeyError, TypeError):
                    break  # a torn last line
            tmp = self.path.with_name(f".{self.path.name}.tmp")
            tmp.write_text("".join(g + "\n" for g in good))
            os.replace(tmp, self.path)

    def fill(
        self, jobs: list[tuple[str, list[int]]], generate, progress: bool, desc: str
    ) -> None:
        # A record made for another encoding of the prompt (e.g. a changed chat template) is
        # made again.
        todo = [
            (k, p)
            for k, p in jobs
            if k not in self.records or self.records[k]["prompt"] != list(p)
        ]
        if not todo:
            return
        with (
            open(self.path, "a") as f,
            tqdm(
                total=len(jobs),
                initial=len(jobs) - len(todo),
                desc=desc,
                unit="prompt",
                disable=not progress,
            ) as bar,
        ):
            for key, prompt in todo:
                completion = generate(key, prompt)
                rec = {"key": key, "prompt": prompt, "completion": completion}
                f.write(json.dumps(rec) + "\n")
                f.flush()
                os.fsync(f.fileno())
                self.records[key] = rec
                bar.update(1)

    def example(self, key: str) -> Example:
        rec = self.records[key]
        return Example(list(rec["prompt"]), list(rec["completion"]))


def teacher_generate(
    teacher,
    prompt: list[int],
    max_new: int,
    temperature: float,
    seed: int,
    stop: set[int],
) -> list[int]:
    """The teacher's completion (mlx-lm generate_step; seeded, greedy at temperature 0)."""
    mx.random.seed(seed)
    sampler = make_sampler(temp=temperature)
    out = []
    for token, _ in generate_step(
        mx.array(prompt), teacher, max_tokens=max_new, sampler=sampler
    ):
        token = int(token)
        out.append(token)
        if token in stop:
            break
    return out


def teacher_log_probs(teacher, tokens: np.ndarray) -> mx.array:
    """Teacher log-probabilities [B, L, V] (float32) for a padded batch (cache-less pass)."""
    logits = teacher(mx.array(tokens)).astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)
