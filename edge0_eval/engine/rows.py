"""A row: what `generate`, the OpenCompass arms and the server ask of one sequence and read back.
The batch decoder (batch.py) steps rows; each row owns the rest:

- its sampler (`RowSampler`): the row draws from its own key, never from MLX's global RNG. A
  row's key is `mx.random.key(seed)`, split once per generated token, so its samples depend on
  its seed, its prompt and its own logits only: the same prompt and seed give the same sample
  alone or in any batch, at any position in it (OpenCompass runs stay reproducible at any
  `batch_size`). Filters and penalties are mlx-lm's (sampling options: prompts.py). The engine
  (`RowSampler`) and the mlx-lm teacher (model_wrappers/mlx_lm_model.py: `row_sampler`, with
  mlx-lm's own logits processors) share them;
- its stop rule (`StopRule`: stop ids, stop strings and max_tokens, with the one text reader the
  rule, a stream and the final text share): the batch decoder feeds a row each token it
  samples and the row decides when it ends, so a stop string ends decoding at the token that
  completes it: nothing after it is decoded, and no caller replays or re-trims a row;
- its figures (`RowFigures`, serialised once by `RowFigures.as_dict`) and its answer.
"""

from __future__ import annotations

import inspect
from collections import Counter
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

from edge0_eval.engine.prompts import PENALTIES, check_filters, check_penalties

# -- the stop rule, figures and answer ---------------------------------------------------
# Per-sample engine figures gathered under "pool" in each student sample's stats (in a batch,
# the reads of a step are shared by its rows: a row's bytes are those of its own prefill and
# of the steps it took part in).
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
        self,
        tokenizer,
        max_tokens: int,
        stop_ids: set,
        stop_words: list[str] = (),
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
    reads and time are shared by its rows: `decode_share_s` is the row's share of the time,
    `decode` and `step_tokens` the whole steps')."""

    prompt_tokens: int
    prefill_s: float = 0.0
    prefill: Counter = field(default_factory=Counter)  # engine snapshot difference
    steps: int = 0
    decode_share_s: float = 0.0
    decode_wall_s: float = 0.0
    decode: Counter = field(default_factory=Counter)  # summed over its steps
    step_tokens: int = 0  # tokens those steps decoded, every row's

    def add_step(self, diff: dict, seconds: float, rows: int) -> None:
        self.steps += 1
        self.decode_share_s += seconds / rows
        self.decode_wall_s += seconds
        self.decode.update(diff)
        self.step_tokens += rows

    def as_dict(self, generated: int) -> dict:
        """The row's figures, serialised (generated: the tokens it decoded)."""
        pre, dec, steps = self.prefill, self.decode, self.steps
        return {
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": generated,
            "prefill_s": self.prefill_s,
            "prefill_tok_s": (
                self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else 0.0
            ),
            "prefill_bytes_read": pre["bytes"],
            "decode_steps": steps,
            "decode_s": self.decode_share_s,
            "decode_wall_s": self.decode_wall_s,
            # The row's own stream rate: its tokens over the wall time of its steps.
            "decode_tok_s": (
                steps / self.decode_wall_s if self.decode_wall_s > 0 else 0.0
            ),
            **decode_figures(dec, steps, self.step_tokens),
            "bytes_read": pre["bytes"] + dec["bytes"],
            "reads": pre["reads"] + dec["reads"],
            "blocked_load_s": pre["blocked"] + dec["blocked"],
            "batch_mean_rows_per_step": self.step_tokens / steps if steps else 1.0,
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
    penalties: `prompts.PENALTY_KEYS` options (None or {}: none).
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
