"""Batched decode: B rows per step, with continuous batching (`Engine.generate_batch`, the
server's worker).

Structure: mlx-lm's own batching, by composition. Each joining row is prefilled alone into its
own cache by the B = 1 path (`DecodeStep.prefill`), so its prefill is exactly its solo prefill; its
caches then join the batch through mlx-lm's cache classes: `KVCache.merge` -> `BatchKVCache`
(left padding, a per-row offset that RoPE and the masks read) and `ArraysCache.merge`
(GatedDeltaNet / GLA states), then `extend` into the running batch. A finishing or cancelled row
leaves with `filter`; a waiting row takes its place. Every step decodes the active rows as one
[B, 1] step (`Engine.step`, the same step as a solo decode). Rows join and leave only between
steps: `add` queues a row, `cancel` ends one, `step` runs one iteration (leave, join, decode);
`run` steps until every row has finished (generate_batch's fixed prompt list).

MoE layers. Reactive: a layer reads the union of its rows' routed experts once
(`StreamingSwitchGLU` takes the set over all rows). Prerouted: every row keeps its own
prediction as its routing ([B, 1, K] plans); each consuming layer stages the union of the rows'
predicted sets and each row executes its own set, so a row's staged set is its routed set.
As in a solo run, each step plans the next after its last layer, from the per-row features its
`Plans` carry in row order (feats, t-1 one-hots); when rows leave or join, that plan is
abandoned (its reads still land in the slots) and the new row set is planned at the start of the
next step, a joiner's features coming from its own prefill.

Slot pool. A layer's union can hold B x K experts. While a batch runs, each layer's pool holds
min(experts, B x K) slots when that exceeds the configured slots (expert_budget_mib /
slots_per_layer are the B = 1 budget); that buffer is the batch's `expert_buffer_mib` in the
stats (`Engine.batch_pool`). So prerouted never drops a planned expert, and reactive never
splits a decode step into waves (it still would for a longer prefill, as at B = 1).

Faults. A joiner whose prefill raises fails alone (its cache never joined). A decode step that
raises (an expert read's I/O or checksum error, non-finite logits) fails every row in it: their
caches were being written; the batch is emptied and the next rows start a fresh one. A failed
row carries the exception (`Row.error`); `run` raises it.

Numerics. Each row's decode is its own arithmetic: matmuls, gather_qmm and the recurrent
states are per row, and the padded keys a batch row attends over are masked to exact zeros. On
the CPU (MLX 0.32) every row's logits are bit-identical to its solo run, all families and
modes, whenever it joins or its mates leave (tests/test_batch.py). Fused attention kernels
elsewhere (Metal/CUDA SDPA with a mask over a longer, left-padded axis) may reduce in another
order: there a row is equal to rounding (the tests' tolerance off the CPU), and its greedy
tokens are still compared exactly.

Rows. A row is what `generate`, the OpenCompass arms and the server ask of one sequence and
read back. The batch decoder steps rows; each row owns the rest:

- its sampler (`RowSampler`): the row draws from its own key, never from MLX's global RNG. A
  row's key is `mx.random.key(seed)`, split once per generated token, so its samples depend on
  its seed, its prompt and its own logits only: the same prompt and seed give the same sample
  alone or in any batch, at any position in it (OpenCompass runs stay reproducible at any
  `batch_size`). Filters and penalties are mlx-lm's (its sampling options: sampling.py). The engine
  (`RowSampler`) and the mlx-lm teacher (model_wrappers/models/mlx_lm_model.py: `row_sampler`, with
  mlx-lm's own logits processors) share them;
- its stop rule (`StopRule`: stop ids, stop strings and max_tokens, with the one text reader the
  rule, a stream and the final text share): the batch decoder feeds a row each token it
  samples and the row decides when it ends, so a stop string ends decoding at the token that
  completes it: nothing after it is decoded, and no caller replays or re-trims a row;
- its figures (`RowFigures`, serialised once by `RowFigures.as_dict`) and its answer.
"""

from __future__ import annotations

import inspect
import numbers
import resource
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Mapping, Sequence

import mlx.core as mx
from mlx_lm.sample_utils import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    greedy_sampler,
    make_logits_processors,
)

from edge0_eval.engine.counters import Counters
from edge0_eval.engine.experts import evaluate
from edge0_eval.engine.inputs import PENALTIES, check_filters, check_penalties
from edge0_eval.engine.routing import Plans
from edge0_eval.engine.store import ExpertStore
from edge0_eval.errors import ConfigError

# -- the stop rule, figures and answer ---------------------------------------------------
# Per-sample engine figures gathered under "pool" in each student sample's stats (in a batch,
# the reads of a step are shared by its rows: a row's bytes are those of its own prefill and
# of the steps it took part in).
POOL_KEYS = (
    "decode_hit_rate cache_hit_rate decode_bytes_read prefill_bytes_read "
    "bytes_per_token reads_per_token blocked_load_ms_per_step bytes_read evictions "
    "rss_gib mean_union_per_layer expert_buffer_mib"
).split()


def trim_at_stop(text: str, stop_words: list[str]) -> tuple[str, str | None]:
    """Cut `text` at the earliest occurrence of any stop word; returns (text, stop hit)."""
    best, hit = len(text), None
    for stop in stop_words:
        if not stop:
            continue
        pos = text.find(stop)
        if 0 <= pos < best:
            best, hit = pos, stop
    return text[:best], hit


def stop_token_ids(tokenizer, stop_words: list[str]) -> set:
    """EOS ids plus every stop word that is exactly one token."""
    ids = set(getattr(tokenizer, "eos_token_ids", None) or [])
    for word in stop_words:
        enc = tokenizer.encode(word, add_special_tokens=False)
        if len(enc) == 1:
            ids.add(int(enc[0]))
    return ids


class IncrementalText:
    """A row's text as its tokens arrive, decoded incrementally as vLLM does (the text of a few
    tokens before the last read one, decoded with the new ones, less what those few tokens
    read), so it follows `tokenizer.decode` of the whole row. mlx-lm's streaming detokenizer
    does not always: it drops the leading space of a row's first text (a stop word ' x'
    opening the answer was never seen) and shows a trailing space a token late.

    Tokens are taken as they come (`add`) and read, one by one, when the text is wanted
    (`read_new`, `text`, `rest`): a row with no stop string to look for decodes nothing
    between decode steps, and its text is the same."""

    def __init__(self, tokenizer):
        self.decode = tokenizer.decode
        self.tokens: list[int] = []
        # token offsets: decoded context, already read, gone through by `read_new`
        self.prefix = self.read = self.seen = 0
        self._text = ""

    def add(self, token: int) -> None:
        """Take the next token."""
        self.tokens.append(token)

    def read_new(self) -> str:
        """Go through the tokens taken since the last call, one at a time: the text they
        complete ('' while a character is incomplete)."""
        new = ""
        while self.seen < len(self.tokens):
            self.seen += 1
            before = self.decode(self.tokens[self.prefix : self.read])
            after = self.decode(self.tokens[self.prefix : self.seen])
            if len(after) <= len(before) or after.endswith("\ufffd"):
                continue
            new += after[len(before) :]
            self.prefix, self.read = max(self.read - 4, 0), self.seen
        self._text += new
        return new

    @property
    def text(self) -> str:
        """The text read from every token taken so far."""
        self.read_new()
        return self._text

    def rest(self) -> str:
        """The text of the tokens not read yet (an incomplete character, as `decode` writes
        it): what ends the row's text when it stops there."""
        self.read_new()
        if self.read == len(self.tokens):
            return ""
        before = self.decode(self.tokens[self.prefix : self.read])
        return self.decode(self.tokens[self.prefix :])[len(before) :]


class StopRule:
    """When one row ends, token by token; every arm and path applies this one rule.

    A stop id ends the row without being output ('eos' for the tokenizer's EOS ids, else
    'stop_token'); `max_tokens` output tokens end it ('length'); a stop string ends it as soon
    as the row's text holds one ('stop_word'), also when the string completes in the text of
    the row's last token. The row's text is read once, by its `reader` (IncrementalText):
    the rule, a server's stream and the answer (`text()`: that text cut at its earliest stop
    string) all read the same characters, so a streamed answer is the whole one.
    """

    def __init__(
        self, tokenizer, max_tokens: int, stop_ids: set, stop_words: list[str] = ()
    ):
        self.tokenizer = tokenizer
        self.max_tokens = max_tokens
        self.stop_ids = set(stop_ids)
        self.eos_ids = set(getattr(tokenizer, "eos_token_ids", None) or [])
        self.stop_words = [w for w in stop_words if w]
        self.reader = IncrementalText(tokenizer)
        self.tail = ""  # the last characters of the text: enough to hold any stop word
        self.keep = max((len(w) for w in self.stop_words), default=0)
        self.tokens: list[int] = []  # the output: every token taken but a stop id
        self.finish: str | None = None if max_tokens > 0 else "length"

    def add(self, token: int) -> bool:
        """Take the next sampled token; True when the row has ended."""
        if self.finish is not None:
            return True
        token = int(token)
        if token in self.stop_ids:
            return self._end("eos" if token in self.eos_ids else "stop_token")
        self.tokens.append(token)
        self.reader.add(token)
        if self.stop_words:
            text = self.tail + self.reader.read_new()
            if any(w in text for w in self.stop_words):
                self.finish = "stop_word"
                return True
            self.tail = text[-self.keep :]
        if len(self.tokens) >= self.max_tokens:
            return self._end("length")
        return False

    def _end(self, finish: str) -> bool:
        # The reader holds back an incomplete character; the row's text ends with it as
        # `decode` writes it, and a stop string completed there ends the row as one.
        if self.stop_words:
            text = self.tail + self.reader.rest()
            if any(w in text for w in self.stop_words):
                finish = "stop_word"
        self.finish = finish
        return True

    def text(self) -> tuple[str, str | None]:
        """(the answer: the row's text cut at its earliest stop string, that string)."""
        return trim_at_stop(self.reader.text + self.reader.rest(), self.stop_words)


def decode_figures(d: dict, steps: int, tokens: int) -> dict:
    """A decode phase's figures from the difference `d` of two engine snapshots: per decoded
    token (every row's) and per step."""

    def per(x, n):
        return x / n if n else 0.0

    lookups = d["hits"] + d["misses"]
    return {
        "decode_bytes_read": d["bytes"],
        "bytes_per_token": per(d["bytes"], tokens),
        "reads_per_token": per(d["reads"], tokens),
        "blocked_load_ms_per_step": per(1000 * d["blocked"], steps),
        "blocked_loads_per_step": per(d["blocked_loads"], steps),
        # Bandwidth of the blocking (demand) reads while they ran: bytes / their wall time.
        "demand_read_gbps": (
            d["demand_read_bytes"] / d["demand_read_seconds"] / 1e9
            if d["demand_read_seconds"] > 0
            else None
        ),
        "decode_hit_rate": per(d["hits"], lookups),
        # Distinct experts a MoE layer needed per step (reactive: the rows' routed union;
        # prerouted: the staged union); None when resident (nothing is looked up).
        "mean_union_per_layer": (
            d["union"] / d["union_layers"] if d["union_layers"] else None
        ),
        # build: Python building the graph, including blocking reads/stage waits and any
        # compute a reactive layer forces (it syncs to learn its routing); eval: the rest.
        # host: a decode step's wall time outside MLX evaluation and read waits (sampling
        # included); host_cpu: the stepping thread's CPU time outside evaluation.
        "profile_ms_per_step": {
            f"{name}_ms": per(1000 * d[f"{name}_seconds"], d["steps"])
            for name in ("build", "eval", "host", "host_cpu")
        },
    }


@dataclass
class RowFigures:
    """What one row cost: its own prefill, and the decode steps it took part in (a step's
    reads and time are shared by its rows: `decode_s` is the row's share of the time, the
    reads and tokens are the whole steps'). Those steps' figures are the difference of the
    batch's step ledger (`BatchDecoder.reading`) as the row joined and as it left: a step
    adds to the batch's figures once, not to each row's."""

    prompt_tokens: int
    prefill_s: float = 0.0
    prefill: Counter = field(default_factory=Counter)  # engine snapshot difference
    joined: Counter | None = None  # the ledger as it joined the running rows
    left: Counter | None = None  # and as it left them (None: in, or never joined)

    def as_dict(self, generated: int) -> dict:
        """The row's figures, serialised (generated: the tokens it decoded)."""
        first, last, dec = self.joined, self.left, Counter()
        if first is not None and last is not None:
            dec = Counter({key: value - first[key] for key, value in last.items()})
        pre, steps = self.prefill, dec["batch_steps"]
        wall = dec["step_wall_s"]
        return {
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": generated,
            "prefill_s": self.prefill_s,
            "prefill_tok_s": (
                self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else 0.0
            ),
            "prefill_bytes_read": pre["bytes"],
            "decode_steps": steps,
            "decode_s": dec["step_share_s"],
            "decode_wall_s": wall,
            # The row's own stream rate: its tokens over the wall time of its steps.
            "decode_tok_s": steps / wall if wall > 0 else 0.0,
            **decode_figures(dec, steps, dec["batch_tokens"]),
            "bytes_read": pre["bytes"] + dec["bytes"],
            "reads": pre["reads"] + dec["reads"],
            "blocked_load_s": pre["blocked"] + dec["blocked"],
            "batch_mean_rows_per_step": dec["batch_tokens"] / steps if steps else 1.0,
        }


@dataclass
class Answer:
    """A finished row's answer, as every arm gives it (the engine, mlx-lm, the server)."""

    output: list[int]  # the answer's tokens: no stop id
    text: str  # its tokens decoded, cut at its stop string
    finish: str  # eos | stop_token | stop_word | length
    stop_word: str | None  # the stop string that ended it
    stats: dict  # its figures

    @classmethod
    def of(cls, stop: StopRule, stats: dict) -> "Answer":
        text, hit = stop.text()
        return cls(stop.tokens, text, stop.finish or "length", hit, stats)


def sample_stats(stats: dict[str, Any], finish: str | None, cache: str) -> dict:
    """A student sample's stats from its row's stats (`Row.stats`): its speeds, how it ended,
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


# -- the engine's figures, which every answer's stats carry ---------------------------
def rss_gib() -> float:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024 / 2**30
    except OSError:
        pass
    # macOS: ru_maxrss is the peak in bytes, the best cheap figure there
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**30


@dataclass
class Figures:
    """An engine's figures since it loaded, the ones every answer's stats carry (in-process
    through `Engine.stats`, served through the worker): its settings, the slots its pools hold
    now, memory, the store's reads, the pools' lookups, the counters and the prerouter's
    (`Prerouter.stats`)."""

    mode: str
    experts_per_token: int
    io_throttle_mbps: float | None
    clip: float | None
    lora: str | None  # the adapter's path
    slot_bytes: int  # one slot in every MoE layer
    counters: Counters
    store: ExpertStore
    blocks: dict
    prerouter: object = None  # a routing.Prerouter

    @property
    def slots_per_layer(self) -> int:
        """What each layer's pool holds now (batch_pool widens it while a batch runs)."""
        return max(
            (b.switch_mlp.slots.n_slots for b in self.blocks.values()), default=0
        )

    def __call__(self) -> dict:
        store, c = self.store.stats, self.counters
        pool = [b.switch_mlp.slots.stats for b in self.blocks.values()]
        hits, misses = sum(p.hits for p in pool), sum(p.misses for p in pool)
        slots = self.slots_per_layer
        out = {
            "mode": self.mode,
            "top_k": self.experts_per_token,
            "slots_per_layer": slots,
            "expert_buffer_mib": slots * self.slot_bytes / 2**20,
            "io_throttle_mbps": self.io_throttle_mbps,
            "emulated": self.io_throttle_mbps is not None,
            "peak_memory_gib": mx.get_peak_memory() / 2**30,
            "active_memory_gib": mx.get_active_memory() / 2**30,
            "rss_gib": rss_gib(),
            "bytes_read": store.bytes_read,
            "reads": store.reads,
            "read_seconds": store.read_seconds,
            "cache_hit_rate": hits / (hits + misses) if hits + misses else 0.0,
            "evictions": sum(p.evictions for p in pool),
            "blocked_load_s": c.blocked_seconds,
            "guard_clip": self.clip,
            "guard_events": c.guard_events,
            "nonfinite_events": c.nonfinite_events,
            "lora": self.lora,
        }
        if self.prerouter is not None:
            out.update(self.prerouter.stats())
        return out


# -- the sampler -------------------------------------------------------------------------
# mlx-lm's own default window of a penalty whose *_context_size is not given.
_MLX_CONTEXT = {
    p: inspect.signature(make_logits_processors)
    .parameters[p.replace("penalty", "context_size")]
    .default
    for p in PENALTIES
}


def row_sampler(
    seed: int,
    temperature: float,
    top_p: float = 1.0,
    min_p: float = 0.0,
    top_k: int = 0,
) -> Callable[[mx.array], mx.array]:
    """mlx-lm's sampler chain (make_sampler's filters, same order) drawing from its own key:
    logprobs -> token ids. Greedy needs no key: mlx-lm's argmax."""
    if temperature == 0:
        return greedy_sampler
    filters = []
    if 0 < top_p < 1.0:
        filters.append(lambda x: apply_top_p(x, top_p))
    if min_p != 0.0:
        filters.append(lambda x: apply_min_p(x, min_p))
    if top_k > 0:
        filters.append(lambda x: apply_top_k(x, top_k))
    return _KeyedSampler(mx.random.key(int(seed)), temperature, filters)


class _KeyedSampler:
    """Draws from its own key, split once per sample; `next_key` is the key the next sample
    will draw with (a draft hedge reproduces that sample's noise before the logits exist).

    One row, [V] (the engine) or [1, V] (mlx-lm's generate_step and BatchGenerator), is always
    drawn as a [V] vector: MLX 0.32's CPU categorical draws a [1, V] row by inverse CDF (one
    uniform) but [V] by Gumbel-max, so the shape would change the token drawn from the same
    logits and key. As [V] both arms draw alike and the draw is mlx-lm's `make_sampler` chain
    on that vector with MLX's global stream at this key."""

    def __init__(self, key: mx.array, temperature: float, filters: list):
        self._key, self.temperature, self._filters = key, temperature, filters

    def next_key(self) -> mx.array:
        return mx.random.split(self._key)[1]

    def __call__(self, logprobs: mx.array) -> mx.array:
        if logprobs.size != logprobs.shape[-1]:
            raise ValueError(
                f"a row sampler draws one row, not logprobs {logprobs.shape}"
            )
        self._key, key = mx.random.split(self._key)
        row = logprobs.reshape(-1)
        for f in self._filters:
            row = f(row)
        # categorical(x, key) of a [V] x is argmax(x + gumbel((V,), key)): `draft_noise`
        # relies on it
        token = mx.random.categorical(row * (1.0 / self.temperature), key=key)
        return token.reshape(logprobs.shape[:-1])


class RowSampler:
    """One engine row's sampler on logits, as mlx-lm's generate_step does it: the penalties
    (make_logits_processors) on the row's history, then the filter chain (top-p, min-p, top-k,
    temperature) drawing from the row's own key, as the teacher arm's.

    prompt: the row's prompt ids; the history a penalty sees is the prompt followed by every
    token this sampler drew (only the last tokens any penalty looks at are kept).
    penalties: `inputs.PENALTY_KEYS` options (None or {}: none).
    """

    def __init__(
        self,
        temperature: float,
        top_p: float,
        seed: int,
        top_k: int = 0,
        min_p: float = 0.0,
        *,
        prompt: Sequence[int] = (),
        penalties: Mapping | None = None,
    ):
        check_filters(top_k, min_p)
        penalties = check_penalties(penalties or {})
        self.temperature = float(temperature)
        self._sample = row_sampler(
            seed,
            self.temperature,
            top_p=float(top_p),
            min_p=float(min_p),
            top_k=int(top_k),
        )
        self._processors = make_logits_processors(**penalties)
        self._window = max(
            (
                penalties.get(p.replace("penalty", "context_size"), _MLX_CONTEXT[p])
                for p in PENALTIES
                if p in penalties
            ),
            default=0,
        )
        prompt = list(prompt)
        self._recent = (
            mx.array(prompt[max(len(prompt) - self._window, 0) :], dtype=mx.int32)
            if self._processors
            else None
        )

    @property
    def greedy(self) -> bool:
        """Draws the argmax of its logits, nothing else: `greedy_tokens` can draw for it."""
        return self.temperature == 0 and not self._processors

    def draft_noise(self, vocab: int) -> mx.array | None:
        """The Gumbel noise [vocab] the next sample adds to logits / temperature (the filters
        and penalties aside); None when greedy."""
        if self.temperature == 0:
            return None
        return mx.random.gumbel((vocab,), key=self._sample.next_key())

    def __call__(self, logits: mx.array) -> mx.array:
        """logits [V] (one row) -> the token id, a lazy scalar."""
        if self._processors:
            rows = logits[None]  # a new array: the processors write into it, not logits
            for processor in self._processors:
                rows = processor(self._recent, rows)
            logits = rows[0]
        token = self._sample(logits - mx.logsumexp(logits, keepdims=True))
        if self._processors:
            recent = mx.concatenate([self._recent, token.reshape(1).astype(mx.int32)])
            self._recent = recent[max(recent.shape[0] - self._window, 0) :]
        return token


def greedy_tokens(logits: mx.array) -> mx.array:
    """logits [B, V] -> [B]: each row's token as its greedy `RowSampler` draws it (the same
    arithmetic row by row: its logits less their logsumexp, then the argmax), for every row
    at once: a batch's step builds three operations rather than four a row."""
    return mx.argmax(logits - mx.logsumexp(logits, axis=-1, keepdims=True), axis=-1)


# -- the row -----------------------------------------------------------------------------
@dataclass(eq=False)  # rows are compared by identity
class Row:
    """One row of the batch decoder: its prompt, sampler, stop rule and figures.

    tokens: every token sampled for it (a final stop id included: the tokens it decoded);
    `stop.tokens` is its output. logprobs (the server's): None, none; k >= 0, per sampled
    token (its logprob, the top k (id, logprob)), of the model's distribution (log-softmax of
    the logits, before penalties and filters).
    """

    key: Hashable  # the caller's name for it (generate_batch: prompt index)
    prompt: list[int]
    sampler: RowSampler
    stop: StopRule
    figures: RowFigures
    tokens: list[int] = field(default_factory=list)
    top_logprobs: int | None = None
    logprobs: list = field(default_factory=list)
    done: bool = False
    cancelled: bool = False
    error: Exception | None = None  # the exception that ended it (batch.py: Faults)

    def take(self, token: int, logits: mx.array) -> None:
        """The token sampled for it from `logits`; the stop rule says whether it ended."""
        self.tokens.append(token)
        if self.top_logprobs is not None:
            self.logprobs.append(token_logprobs(logits, token, self.top_logprobs))
        self.done = self.stop.add(token)

    @property
    def output(self) -> list[int]:
        return self.stop.tokens

    @property
    def finish(self) -> str | None:
        return self.stop.finish

    def stats(self, engine_stats: dict) -> dict:
        """The engine's figures with the row's own over them."""
        return {**engine_stats, **self.figures.as_dict(len(self.tokens))}


def token_logprobs(logits: mx.array, token: int, k: int) -> tuple[float, list]:
    """(token's logprob, [(id, logprob)] of the k most likely, most likely first) of one row's
    logits [V] (log-softmax: before penalties, filters and temperature)."""
    logprobs = logits.astype(mx.float32) - mx.logsumexp(logits.astype(mx.float32))
    top = []
    if k:
        ids = mx.argpartition(-logprobs, kth=k - 1)[:k]
        values = logprobs[ids]
        top = sorted(zip(ids.tolist(), values.tolist()), key=lambda p: -p[1])
    return float(logprobs[token].item()), top


# -- the batch decoder -----------------------------------------------------------------
def snapshot(counters: Counters, store: ExpertStore, blocks: dict) -> dict:
    """An engine's counters now, with its store's reads and its MoE blocks' pool lookups (a
    phase's figures are the difference of two snapshots)."""
    pool = [b.switch_mlp.slots.stats for b in blocks.values()]
    c = counters
    # Counters holds scalars only: a shallow copy (asdict deep-copies, ~0.15 ms a call,
    # and a decode step takes four snapshots).
    return vars(c).copy() | {
        "bytes": store.stats.bytes_read,
        "reads": store.stats.reads,
        "hits": sum(p.hits for p in pool),
        "misses": sum(p.misses for p in pool),
        # Waiting for reads: demand reads, and staged reads not done when needed.
        "blocked": c.blocked_seconds + c.stage_wait_seconds,
        # Distinct experts per layer call, and such calls (reactive unions + staged sets).
        "union": c.union_experts + c.staged_experts,
        "union_layers": c.union_calls + c.staged_layers,
    }


def _waits(c: Counters) -> float:
    """The stepping thread's waits so far: for evaluation, demand reads and staged reads."""
    return c.eval_wait_seconds + c.demand_read_seconds + c.stage_wait_seconds


def merge_caches(caches: list[list]) -> list:
    """One B = 1 prompt cache per row (a list per layer) -> the batch's cache per layer."""
    return [type(layer[0]).merge(list(layer)) for layer in zip(*caches)]


def check_batch_args(prompts, max_tokens, batch_size, seeds) -> int:
    """Validate generate_batch's arguments; the number of concurrent rows."""
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ConfigError("generate_batch: prompts is empty; give at least one prompt")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ConfigError(
                f"generate_batch: prompt {i} is empty (no tokens); every prompt "
                f"needs at least one token"
            )
    check_rows_at_once(batch_size, "batch_size", none="all prompts at once")
    check_max_tokens(max_tokens)
    if seeds is not None and len(seeds) != len(prompts):
        raise ConfigError(
            f"seeds has {len(seeds)} entries for {len(prompts)} prompts; give one "
            f"seed per prompt (or None: options.seed for every row)"
        )
    for i, seed in enumerate(seeds or []):
        check_seed(seed, f"seeds[{i}]")
    return min(len(prompts), batch_size or len(prompts))


def check_rows_at_once(value, name: str, none: str | None = None) -> None:
    if value is None and none is not None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(
            f"{name} must be a whole number >= 1"
            + (f" (or None: {none})" if none else "")
            + f", not {value!r}"
        )


def check_max_tokens(max_tokens, name: str = "max_tokens") -> None:
    if (
        isinstance(max_tokens, bool)
        or not isinstance(max_tokens, int)
        or max_tokens < 0
    ):
        raise ConfigError(f"{name} must be a whole number >= 0, not {max_tokens!r}")


def check_seed(seed, name: str = "seed") -> None:
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
        raise ConfigError(f"{name} must be a whole number >= 0, not {seed!r}")


class BatchDecoder:
    """Continuous batching on one engine: rows are added, cancelled and stepped between steps.

    rows_at_once: the most rows decoded together; more wait (first come, first joined).
    logits_trace: a dict to fill (tests, fidelity): key -> the logits [V] each token came from.
    The caller owns the engine's thread: nothing here is thread-safe.
    """

    def __init__(self, engine, rows_at_once: int, logits_trace: dict | None = None):
        check_rows_at_once(rows_at_once, "rows_at_once")
        self.engine, self.rows_at_once, self.logits_trace = (
            engine,
            rows_at_once,
            logits_trace,
        )
        self.waiting: deque[Row] = deque()
        self.active: list[Row] = []
        self.cache: list | None = None
        self.plans: Plans | None = None if engine.prerouter is None else Plans()
        # The decode figures: snapshot differences (`snapshot`) summed over the steps and
        # the rows' leaving and joining between them; `moved`, the latter alone.
        self.decode, self.moved = Counter(), Counter()

    def _snapshot(self) -> dict:
        e = self.engine
        return snapshot(e.counters, e.store, e.blocks)

    def reading(self) -> Counter:
        """The step ledger now: the decode figures of the steps alone, so far."""
        moved = self.moved
        return Counter({key: value - moved[key] for key, value in self.decode.items()})

    # -- rows -------------------------------------------------------------------------------
    def add(
        self,
        key: Hashable,
        prompt: list[int],
        *,
        stop: StopRule,
        seed: int,
        sampling: dict,
        top_logprobs: int | None = None,
    ) -> Row:
        """Queue a row; it joins at the next step with room. stop: the row's stop rule (its
        max_tokens, stop ids and strings). sampling: RowSampler's keyword arguments
        (temperature, top_p, top_k, min_p, penalties); its penalties see its prompt.
        top_logprobs: keep each token's logprob and the top k (None: none)."""
        if len(prompt) == 0:
            raise ConfigError(f"row {key!r}: the prompt is empty (no tokens)")
        check_max_tokens(stop.max_tokens)
        check_seed(seed)
        row = Row(
            key,
            list(prompt),
            RowSampler(seed=int(seed), prompt=prompt, **sampling),
            stop,
            RowFigures(len(prompt)),
            top_logprobs=top_logprobs,
        )
        if self.logits_trace is not None:
            self.logits_trace[key] = []
        self.waiting.append(row)
        return row

    def cancel(self, row: Row) -> None:
        """End `row` now: a waiting row never joins; an active one leaves before the next step."""
        if row.done:
            return
        row.done = row.cancelled = True
        if row in self.waiting:
            self.waiting.remove(row)
        elif row in self.active:
            row.figures.left = self.reading()

    def between(self) -> None:
        """Another sequence runs on the engine before the next step (the server's prompt
        scoring): what was planned for that step is dropped, and the step plans again."""
        pr = self.engine.prerouter
        if pr is not None and self.active:
            pr.abandon(self.plans)
            self.plans = self.plans.take(list(range(len(self.active))))

    @property
    def pending(self) -> bool:
        """Rows are waiting or decoding."""
        return bool(self.waiting or self.active)

    def _join(self, row: Row, stage: bool):
        """Prefill `row` alone (the B = 1 path) into its own cache; sample its first token.
        stage: the row joins an empty batch alone, and its prefill plans its first step (with
        its sampler, for a draft hedge); else its plans are its features only: the batch
        plans its rows together."""
        e = self.engine
        cache = e.step.new_cache()
        before, t0 = self._snapshot(), time.perf_counter()
        logits, plans = e.step.prefill(
            row.prompt, cache, stage=stage, samplers=[row.sampler] if stage else None
        )
        if plans is not None:
            mx.eval(plans.feats, plans.onehot)
        row.figures.prefill_s = time.perf_counter() - t0
        row.figures.prefill = Counter(
            {k: v - before[k] for k, v in self._snapshot().items()}
        )
        if row.stop.finish is None:
            self._take(row, row.sampler(logits).item(), logits)
        else:  # max_tokens 0
            row.done = True
        return cache, plans

    def _take(
        self, row: Row, token: int, logits: mx.array, j: int | None = None
    ) -> None:
        """Give `row` its token, sampled from `logits`: the row's [V], or with `j` row j of
        a step's [B, V], sliced out only where it is kept (a trace, the row's logprobs)."""
        keep = self.logits_trace is not None or row.top_logprobs is not None
        if j is not None:
            logits = logits[j] if keep else None
        if self.logits_trace is not None:
            self.logits_trace[row.key].append(logits)
        row.take(int(token), logits)

    # -- the loop ---------------------------------------------------------------------------
    def run(self) -> list[Row]:
        """Step until every row has finished; the rows in the order they were added. The first
        failed row's exception is raised."""
        rows = list(self.waiting)
        while self.pending:
            for row in self.step():
                if row.error is not None:
                    raise row.error
        return rows

    def step(self) -> list[Row]:
        """One iteration: rows that finished leave, waiting rows join (prefilled alone), then
        one decode step of the active rows. Returns the rows that took a token or failed."""
        pr = self.engine.prerouter
        touched: list[Row] = []
        # Between steps: finished rows leave, waiting rows take their places (counted in
        # the decode figures; a step with neither takes no snapshot).
        keep = [j for j, r in enumerate(self.active) if not r.done]
        joining = bool(self.waiting) and len(keep) < self.rows_at_once
        moving = joining or len(keep) < len(self.active)
        if moving:
            t0, before = time.perf_counter(), self._snapshot()
        if pr is not None and moving:
            if keep or self.waiting:
                # Planned for the old rows inside the last step; a joiner's prefill must not
                # run it either. After the batch's last step the plan is left in flight (the
                # pool drops it on its next use), outside the decode figures, as a solo
                # generate's last plan is.
                pr.abandon(self.plans)
            self.plans = self.plans.take(keep)
        if len(keep) < len(self.active):
            self.active = [self.active[j] for j in keep]
            if keep:
                idx = mx.array(keep, dtype=mx.int32)
                for c in self.cache:
                    c.filter(idx)
            else:
                self.cache = None
        if moving:
            self._account(t0, before, self.decode, self.moved)
        joined = []
        # One row joining an empty batch plans its first step in its prefill, as a solo
        # sequence does (a batch of one is a solo run: Engine.generate).
        alone = not self.active and (len(self.waiting) == 1 or self.rows_at_once == 1)
        while self.waiting and len(self.active) + len(joined) < self.rows_at_once:
            row = self.waiting.popleft()
            try:
                row_cache, row_plans = self._join(row, stage=alone)
            except Exception as exc:  # noqa: BLE001 - the row fails alone (see Faults)
                row.error, row.done = exc, True
                touched.append(row)
                continue
            touched.append(row)
            if not row.done:  # stopped on its first token: never joins
                joined.append((row, row_cache, row_plans))
            elif alone and pr is not None:
                pr.abandon(row_plans)
        if joined:
            if self.active:
                self.decode["batch_joined"] += len(joined)
            new = merge_caches([c for _, c, _ in joined])
            if self.cache is None:
                self.cache = new
            else:
                for mine, theirs in zip(self.cache, new):
                    mine.extend(theirs)
            self.active += [r for r, _, _ in joined]
            mark = self.reading()
            for r, _, _ in joined:
                r.figures.joined = mark
            if pr is not None:
                parts = [self.plans] + [p for *_, p in joined]
                self.plans = parts[1] if alone else Plans.join(parts)
        if self.active:
            try:
                self._step()
            except Exception as exc:  # noqa: BLE001 - every row of the step fails
                mark = self.reading()
                for row in self.active:
                    row.error, row.done, row.figures.left = exc, True, mark
                touched += [r for r in self.active if r not in touched]
                self.active, self.cache = [], None
                self.plans = None if pr is None else Plans()
                return touched
            touched += [r for r in self.active if r not in touched]
        return touched

    def _step(self) -> None:
        """One decode step of the active rows (prerouted: planned inside the last step, or,
        after rows left or joined, at the start of this one); keeps the next step's plans."""
        e, active, c = self.engine, self.active, self.engine.counters
        t0, before = time.perf_counter(), self._snapshot()
        cpu0, waits = time.thread_time(), _waits(c)
        eval_cpu = c.eval_wait_cpu_seconds
        samplers = [r.sampler for r in active]
        # Greedy rows (evaluation's usual setting) are drawn together, in the step's own
        # evaluation; a row with its own key or penalties is drawn by its sampler.
        greedy = all(s.greedy for s in samplers)
        last, self.plans = e.step(
            mx.array([[r.tokens[-1]] for r in active]),
            self.cache,
            self.plans,
            samplers=samplers,
            where=f"at batched decode step {self.decode['batch_steps'] + 1}",
            rows=[r.key for r in active],
            draw=greedy_tokens if greedy else None,
        )
        if greedy:
            last, drawn = last
            tokens = drawn.tolist()
        else:
            drawn = [s(last[j]) for j, s in enumerate(samplers)]
            evaluate(c, *drawn)
            tokens = [t.item() for t in drawn]
        for j, (r, t) in enumerate(zip(active, tokens)):
            self._take(r, t, last, j)
        dt = time.perf_counter() - t0
        # Host work, on the critical path where compute is fast: the step's wall time outside
        # evaluation and read waits, and the thread's CPU time outside evaluation (what that
        # wall time is when other threads and processes leave this thread a core).
        c.host_seconds += dt - (_waits(c) - waits)
        c.host_cpu_seconds += (
            time.thread_time() - cpu0 - (c.eval_wait_cpu_seconds - eval_cpu)
        )
        d = self.decode
        d["batch_steps"] += 1
        d["batch_tokens"] += len(active)
        d["step_wall_s"] += dt
        d["step_share_s"] += dt / len(active)
        self._account(t0, before, d)
        ended = [r for r in active if r.done]
        if ended:
            mark = self.reading()
            for r in ended:
                r.figures.left = mark

    def _account(self, t0: float, before: dict, *ledgers: Counter) -> None:
        """Add the decode work since (t0, before) to each of `ledgers`."""
        after = self._snapshot()
        seconds = time.perf_counter() - t0
        for d in ledgers:
            d["batch_seconds"] += seconds
            for key, value in after.items():
                d[key] += value - before[key]

    # -- figures ----------------------------------------------------------------------------
    def batch_stats(self, rows: list[Row]) -> dict:
        """The batch's own figures (the same in every row's stats; with its decode figures)."""
        d = self.decode
        tokens, steps, seconds = d["batch_tokens"], d["batch_steps"], d["batch_seconds"]
        return {
            "batch_size": self.rows_at_once,  # rows at once: min(batch_size, prompts)
            "batch_rows": len(rows),
            "batch_steps": steps,
            "batch_joined_running": d["batch_joined"],  # rows that joined running rows
            "batch_mean_rows_per_step": tokens / steps if steps else 0.0,
            "batch_generated_tokens": sum(len(r.tokens) for r in rows),
            "batch_decode_tokens": tokens,
            "batch_decode_s": seconds,
            "batch_decode_tok_s": tokens / seconds if seconds > 0 else 0.0,
            "batch_prefill_s": sum(r.figures.prefill_s for r in rows),
            "batch_prefill_bytes_read": sum(r.figures.prefill["bytes"] for r in rows),
        }
