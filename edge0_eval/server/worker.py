"""The engine's one thread: it owns the engine, its tokenizer and the batch; HTTP only queues.

MLX and the engine are single-threaded, so every request is handed to `Worker` as a `Job`
(`submit`, `cancel`: thread-safe) and everything that touches the model or the tokenizer runs
here: the chat template and tokenization when the job is admitted (and, for an echo with
logprobs, the prompt's teacher-forced log-probs, scored there between two decode steps), then
the batch decoder (engine/batch.py), between whose steps rows join and leave. A job is its
request's prompts x `n` choices, each a row of the batch; each row carries its stop rule (engine/batch.py: stop ids,
stop words and max_tokens end it inside the decoder, and a row that ended leaves before the
next step) and its one text reader. After each step every row that took a token advances its
choice: logprobs, streamed text read from the row's reader, and at the end the row's answer
(its text cut at the stop word) and figures. A job hears back through its `post` callback
(thread-safe), with
  ('started', prompt_tokens) | ('delta', index, text, logprobs) | ('done', Finished)
  | ('error', RequestError)
one 'done' per choice. An exception in a decode step (an expert read's I/O or checksum error,
non-finite logits) fails every row in that step, and a failed row fails its whole request,
with a 500 error, never a partial answer marked complete; the worker goes on with the next
requests. If the thread itself ends (a fault outside those guards, or close), every request it
still holds or has queued is failed the same way and later ones are refused (503): no caller
waits forever.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx
import numpy as np
from mlx_lm.generate import wired_limit

from edge0_eval.engine.batch import (
    BatchDecoder,
    IncrementalText,
    Row,
    StopRule,
    sample_stats,
    stop_token_ids,
)
from edge0_eval.engine.inputs import chat_ids, fit_prompt, row_seed
from edge0_eval.evaluation.fidelity.scoring import EngineRunner, forced_logprobs
from edge0_eval.server.requests import (
    CONTEXT_EXCEEDED,
    DEFAULT_MAX_MODEL_LEN,
    RequestError,
    RequestSpec,
)

log = logging.getLogger("edge0_eval.server")


@dataclass
class Finished:
    index: int  # the choice's
    text: str
    finish_reason: str  # 'stop' | 'length' (OpenAI's)
    prompt_tokens: int
    tokens: list[int]  # the answer's: no stop id
    generated: int  # every token sampled for it, a final stop id included (usage)
    logprobs: list  # per output token: its chat API logprobs entry
    stats: dict  # the sample's stats (rows.sample_stats and more)


@dataclass(eq=False)
class Choice:
    """One of a job's rows as its answer goes out: choice `index` is sample `sample`, drawn
    from `seed` (row_seed of the request's seed, its prompt and the sample)."""

    index: int
    row: Row
    sample: int
    seed: int
    stream: "TextStream | None"
    seen: int = 0  # the row's tokens taken so far
    logprobs: list = field(default_factory=list)
    echo: tuple[str, list] | None = None  # the prompt's text and logprobs (echo)
    echoed: bool = False  # streamed: the echo has gone out

    def echoing(self, text: str, logprobs: list) -> tuple[str, list]:
        """Streamed: the echo before the choice's first text (once)."""
        if self.echo is None or self.echoed:
            return text, logprobs
        self.echoed = True
        return self.echo[0] + text, self.echo[1] + logprobs


@dataclass(eq=False)
class Job:
    spec: RequestSpec
    post: Callable[[tuple], None]
    submitted: float = field(default_factory=time.perf_counter)
    # The worker's, once admitted:
    choices: list[Choice] = field(default_factory=list)
    started: bool = False
    left: int = 0  # choices still decoding
    ended: bool = False  # answered, failed or cancelled: nothing more is posted


class TextStream:
    """Streamed text: the row's text as its reader reads it (the reader the stop rule and the
    answer read: StopRule.reader). Held back: what could still become a stop word (the
    longest one's length - 1 characters; the reader holds an incomplete character itself).
    Never sent: a stop word this text holds, and what follows it. The hold applies after a
    first stop word too: a longer one completing in a later token can start before it, and
    the answer is cut at the earliest. So what is sent is always a prefix of the answer
    (StopRule.text: the same text, cut at its earliest stop word), and `finish` sends the
    rest of it."""

    def __init__(self, stop_words: list[str], reader: IncrementalText):
        self.stop_words = list(stop_words)
        self.hold = max((len(w) for w in stop_words), default=1) - 1
        self.reader = reader
        self.searched = 0  # characters of the text seen by the last update
        self.cut: int | None = None  # where the earliest stop word in it starts
        self.sent = 0

    @property
    def text(self) -> str:
        return self.reader.text

    def update(self) -> str:
        """The text to send of what the reader has read since the last update."""
        seen, self.searched = self.searched, len(self.text)
        if self.searched > seen:
            # A stop word that ends in the new text starts at most `hold` characters before
            # it; one wholly in the older text was found already.
            start = max(0, seen - self.hold)
            hits = [i for w in self.stop_words if (i := self.text.find(w, start)) >= 0]
            self.cut = min(
                hits + ([] if self.cut is None else [self.cut]), default=None
            )
        end = len(self.text) - self.hold
        end = max(self.sent, end if self.cut is None else min(end, self.cut))
        out, self.sent = self.text[self.sent : end], end
        return out

    def finish(self, final: str) -> str:
        """The rest of `final` (the whole answer: StopRule.text)."""
        return final[self.sent :]


def model_context(engine) -> int | None:
    """The model's context length from its config (max_position_embeddings), if it gives one."""
    limit = engine.family.text_config(engine.config).get("max_position_embeddings")
    return (
        limit
        if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0
        else None
    )


def stopped_error() -> RequestError:
    return RequestError(
        "the engine thread has stopped (its error is in the server's log); "
        "this server answers no more requests: restart it",
        status=503,
        kind="server_error",
        code="engine_stopped",
    )


def finish_reason(stop: StopRule) -> str:
    return "length" if stop.finish in (None, "length") else "stop"


class Worker(threading.Thread):
    """The engine thread. load: makes the engine, on this thread (MLX 0.32 keeps its streams
    per thread: arrays made on one thread cannot be evaluated on another). rows_at_once: the
    most rows decoded together (more wait). max_model_len: the most tokens a row may hold,
    prompt and answer (None: the model's context, max_position_embeddings, once loaded;
    DEFAULT_MAX_MODEL_LEN if its config gives none). max_tokens: the most new tokens of a
    request that gives no max_tokens (None: the rest of the row, as vLLM)."""

    def __init__(
        self,
        load: Callable[[], object],
        *,
        rows_at_once: int,
        identity: dict,
        name: str,
        max_model_len: int | None = None,
        max_tokens: int | None = None,
    ):
        super().__init__(name="edge0-engine", daemon=True)
        self._load, self.rows_at_once = load, rows_at_once
        self.max_model_len, self.max_tokens = max_model_len, max_tokens
        self.identity, self.served_name = identity, name
        self.engine = self.tokenizer = self.decoder = None
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.jobs: dict = {}  # row -> (its job, its choice)
        self.counts = Counter()  # served, failed, cancelled, refused
        self.ready = threading.Event()
        self.load_error: BaseException | None = None
        # Once the thread is leaving nothing reads the inbox: `stopped`, set under the lock
        # before the last drain, makes a later submit fail at once instead of waiting forever.
        self._lock = threading.Lock()
        self.stopped = False

    def start_engine(self) -> None:
        """Start the thread and wait until the engine has loaded; its load error is raised."""
        self.start()
        self.ready.wait()
        if self.load_error is not None:
            raise self.load_error

    # -- the HTTP side's calls (any thread) ------------------------------------------------
    def submit(self, job: Job) -> None:
        with self._lock:
            if not self.stopped:
                self.inbox.put(("add", job))
                return
        job.post(("error", stopped_error()))

    def cancel(self, job: Job) -> None:
        self.inbox.put(("cancel", job))

    def close(self) -> None:
        self.inbox.put(("close", None))

    def load(self) -> dict:
        """Rows decoding and waiting, and the counts (read without a lock: a snapshot)."""
        decoder = self.decoder
        return {
            "rows": len(decoder.active) if decoder else 0,
            "waiting": len(decoder.waiting) if decoder else 0,
            "rows_at_once": self.rows_at_once,
            **{k: self.counts[k] for k in ("served", "failed", "cancelled", "refused")},
        }

    # -- the thread ------------------------------------------------------------------------
    def run(self) -> None:
        error = None
        try:
            self.engine = self._load()
            self.tokenizer = self.engine.tokenizer
            self.decoder = BatchDecoder(self.engine, self.rows_at_once)
            if self.max_model_len is None:
                self.max_model_len = model_context(self.engine) or DEFAULT_MAX_MODEL_LEN
            self._serve()
        except BaseException as exc:  # noqa: BLE001 - raised by start_engine, or told
            error = exc  # to every request still waiting (_leave)
            if self.ready.is_set():
                log.exception(
                    "the engine thread failed; every request is refused from now on"
                )
            else:  # the load, or entering the batch pool
                self.load_error = exc
        finally:
            self._leave(error)
            self.ready.set()  # after load_error: start_engine reads it
            if self.engine is not None:
                self.engine.close()
            # This thread's MLX streams go with it: left to the process's exit, a stream's
            # thread can be torn down running ("terminate called", SIGABRT) after a clean stop.
            mx.clear_streams()

    def _leave(self, error: BaseException | None) -> None:
        """The thread is leaving: fail every request that would otherwise wait forever, those
        decoding or waiting for a row and those still queued (later ones: `submit`)."""
        with self._lock:
            self.stopped = True
        reason = error or RuntimeError(
            "the server stopped before this answer was complete"
        )
        for job in self._held():
            self._fail(job, reason)
        while True:
            try:
                kind, job = self.inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self._fail(job, reason)

    def _serve(self) -> None:
        with self.engine.batch_pool(self.rows_at_once), wired_limit(self.engine.model):
            self.ready.set()
            while self._drain(block=not self.decoder.pending):
                if not self.decoder.pending:
                    continue
                try:
                    touched = self.decoder.step()
                except Exception as exc:  # noqa: BLE001 - a fault outside a step: start over
                    log.exception("batch decoder failed")
                    self._restart(exc)
                    continue
                for row in touched:
                    held = self.jobs.get(row)
                    if held is not None:
                        self._guarded(self._advance, *held)

    def _held(self) -> list[Job]:
        """The jobs with rows in the decoder, each once."""
        return list({id(job): job for job, _ in self.jobs.values()}.values())

    def _guarded(self, call, job: Job, *args) -> None:
        """A fault in one job's handling fails that job (500), never the thread."""
        try:
            call(job, *args)
        except Exception as exc:  # noqa: BLE001 - answered, and logged
            log.exception("request handling failed")
            self._fail(job, exc)

    def _drain(self, block: bool) -> bool:
        """Take every queued call (waiting for one when idle); False on close."""
        try:
            item = self.inbox.get() if block else self.inbox.get_nowait()
        except queue.Empty:
            return True
        while True:
            kind, job = item
            if kind == "close":
                return False
            if kind == "add":
                self._guarded(self._admit, job)
            elif not job.ended and job.choices:
                self._drop(job)
                self.counts["cancelled"] += 1
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return True

    def _restart(self, exc: Exception) -> None:
        for job in self._held():
            self._fail(job, exc)
        self.decoder = BatchDecoder(self.engine, self.rows_at_once)

    def _drop(self, job: Job) -> None:
        """End a job: its rows still decoding or waiting leave the batch."""
        job.ended = True
        for choice in job.choices:
            if self.jobs.pop(choice.row, None) is not None:
                self.decoder.cancel(choice.row)

    def _admit(self, job: Job) -> None:
        """Tokenize the request's prompts and queue their rows, `n` per prompt (choice
        p * n + i: prompt p's i-th); a prompt refused refuses the request, before any row."""
        spec, tok = job.spec, self.tokenizer
        rows = []
        for prompt in spec.prompts:
            ids = self._tokens(job, prompt)
            max_tokens = None if ids is None else self._room(job, ids)
            if max_tokens is None:
                return
            rows.append((prompt, ids, max_tokens))
        stop_ids = stop_token_ids(tok, spec.stop)
        for p, (prompt, ids, max_tokens) in enumerate(rows):
            echo = self._echo(prompt, ids, spec.logprobs) if spec.echo else None
            for i in range(spec.n):
                sample = spec.sample + i
                seed = row_seed(spec.seed, ids, sample)
                stop = StopRule(tok, max_tokens, stop_ids, spec.stop)
                row = self.decoder.add(
                    (id(job), p * spec.n + i),
                    ids,
                    stop=stop,
                    seed=seed,
                    sampling=spec.sampling,
                    top_logprobs=spec.logprobs,
                )
                stream = TextStream(spec.stop, stop.reader) if spec.stream else None
                choice = Choice(p * spec.n + i, row, sample, seed, stream, echo=echo)
                job.choices.append(choice)
                self.jobs[row] = (job, choice)
        job.left = spec.choices

    def _tokens(self, job: Job, prompt) -> list[int] | None:
        """A prompt's token ids (fitted to edge0_max_seq_len); None: refused."""
        spec, tok = job.spec, self.tokenizer
        try:
            if spec.kind == "chat":
                ids = chat_ids(tok, prompt, spec.chat_template_kwargs)
            elif isinstance(prompt, str):
                # as mlx-lm's server encodes a prompt
                ids = list(tok.encode(prompt))
            else:
                ids = list(prompt)
        except Exception as exc:  # noqa: BLE001 - the template refused the messages
            if spec.kind == "chat":
                param = (
                    "chat_template_kwargs" if spec.chat_template_kwargs else "messages"
                )
                what = "the chat template refused the request"
            else:
                param, what = "prompt", "the tokenizer refused the prompt"
            self._refuse(
                job, RequestError(f"{what}: {type(exc).__name__}: {exc}", param)
            )
            return None
        if spec.max_seq_len is not None:
            ids = fit_prompt(ids, spec.max_seq_len, spec.max_tokens or 0)
        if not ids:
            self._refuse(job, RequestError("the prompt has no tokens", "prompt"))
            return None
        return ids

    def _room(self, job: Job, ids: list[int]) -> int | None:
        """The row's max_tokens: the request's, or the rest of the row (as vLLM); None:
        refused, the row would not fit."""
        spec = job.spec
        param = "messages" if spec.kind == "chat" else "prompt"
        room = self.max_model_len - len(ids)
        max_tokens = spec.max_tokens
        if max_tokens is None:  # as vLLM: the rest of the row
            max_tokens = room if self.max_tokens is None else min(room, self.max_tokens)
        if 1 <= max_tokens <= room or (spec.max_tokens == 0 and room >= 0):
            return max_tokens
        asked = (
            f"and max_tokens {max_tokens}: {len(ids) + max_tokens} in all"
            if spec.max_tokens is not None
            else "leaving no room for an answer"
        )
        self._refuse(
            job,
            RequestError(
                f"the prompt ({param}) is {len(ids)} tokens {asked}, more than the "
                f"{self.max_model_len} a row may hold on this server "
                f"(--max-model-len); shorten the prompt, ask for fewer tokens, or "
                f"give edge0_max_seq_len to cut the prompt",
                param,
                code=CONTEXT_EXCEEDED,
            ),
        )
        return None

    def _echo(self, prompt, ids: list[int], k: int | None) -> tuple[str, list]:
        """An echoed prompt: its text and, with logprobs, each token's entry (the first's
        null, as OpenAI and vLLM give it), teacher-forced on the engine's served path as
        the fidelity scorer forces a continuation (scoring.forced_logprobs)."""
        text = prompt if isinstance(prompt, str) else self.tokenizer.decode(ids)
        if k is None:
            return text, []
        first = self._logprob_entry(ids[0], 0.0, [])
        entries = [{**first, "logprob": None, "top_logprobs": None}]
        self.decoder.between()
        forced = forced_logprobs(EngineRunner(self.engine), ids[:1], ids[1:])
        for token, lp in zip(ids[1:], forced):
            top = np.argpartition(-lp, k - 1)[:k] if k else []
            top = sorted(((int(t), float(lp[t])) for t in top), key=lambda p: -p[1])
            entries.append(self._logprob_entry(token, float(lp[token]), top))
        return text, entries

    def _refuse(self, job: Job, error: RequestError) -> None:
        self.counts["refused"] += 1
        job.ended = True
        job.post(("error", error))

    def _advance(self, job: Job, choice: Choice) -> None:
        """The row's new tokens (its stop rule has taken them) through its choice: logprobs,
        streamed text, the end."""
        row = choice.row
        if row.error is not None:
            self._fail(job, row.error)
            return
        if not job.started:
            job.started = True
            job.post(("started", len(row.prompt)))
        logprobs = []
        if job.spec.logprobs is not None:
            # Output tokens only: a final stop id is sampled but not part of the answer.
            for i in range(choice.seen, len(row.output)):
                logprobs.append(self._logprob_entry(row.tokens[i], *row.logprobs[i]))
        choice.seen = len(row.tokens)
        choice.logprobs += logprobs
        if row.done:
            self._finish(job, choice, logprobs)
        elif choice.stream is not None:
            text, logprobs = choice.echoing(choice.stream.update(), logprobs)
            if text or logprobs:
                job.post(("delta", choice.index, text, logprobs))

    def _finish(self, job: Job, choice: Choice, logprobs: list) -> None:
        """A choice's answer: its text trimmed at its stop word (streamed: the rest of it,
        with the last tokens' logprobs), then its `done`; the job ends with its last."""
        row = choice.row
        del self.jobs[row]
        text, hit = row.stop.text()
        if choice.stream is not None:
            rest, logprobs = choice.echoing(choice.stream.finish(text), logprobs)
            if rest or logprobs:
                job.post(("delta", choice.index, rest, logprobs))
        echo, echoed = choice.echo or ("", [])
        job.left -= 1
        if job.left == 0:
            job.ended = True
            self.counts["served"] += 1
        job.post(
            (
                "done",
                Finished(
                    choice.index,
                    echo + text,
                    finish_reason(row.stop),
                    len(row.prompt),
                    row.output,
                    len(row.tokens),
                    echoed + choice.logprobs,
                    self._stats(job, choice, hit),
                ),
            )
        )

    def _logprob_entry(self, token: int, logprob: float, top: list) -> dict:
        """One output token's logprobs, as the chat API writes them (plus mlx-lm's `id`)."""

        def one(t: int, lp: float) -> dict:
            text = self.tokenizer.decode([t])
            return {"id": t, "token": text, "logprob": lp, "bytes": list(text.encode())}

        return {**one(token, logprob), "top_logprobs": [one(t, lp) for t, lp in top]}

    def _fail(self, job: Job, exc: Exception) -> None:
        """Fail the whole request (a choice's fault ends its siblings too: no partial
        answer); once."""
        if job.ended:
            return
        self._drop(job)
        self.counts["failed"] += 1
        log.error("request failed in the engine: %s: %s", type(exc).__name__, exc)
        job.post(
            (
                "error",
                RequestError(
                    f"the engine failed while generating this answer ({type(exc).__name__}: {exc}); "
                    f"no partial answer is returned",
                    status=500,
                    kind="server_error",
                    code="engine_error",
                ),
            )
        )

    def _stats(self, job: Job, choice: Choice, stop_word: str | None) -> dict:
        """The sample's stats, as an in-process student sample's (rows.sample_stats): the
        engine's figures with the row's own (Row.stats: its prefill and the decode steps it
        took part in, shared with its batch mates); `seed` is the row's draw, `request_seed`
        the request's (given or drawn: it replays the answer)."""
        row = choice.row
        stats = row.stats(self.engine.figures())
        wall = time.perf_counter() - job.submitted
        busy = stats["prefill_s"] + stats["decode_wall_s"]
        return {
            "prompt_tokens": len(row.prompt),
            "tokens": len(row.output),
            "wall_s": round(wall, 4),
            "queue_s": round(max(0.0, wall - busy), 4),
            "stop_word": stop_word,
            "seed": choice.seed,
            "request_seed": job.spec.seed,
            "sample": choice.sample,
            "batch_size": self.decoder.rows_at_once,
            **sample_stats(stats, row.finish, "not evicted"),
            "model_identity": self.identity,
            "served_model": self.served_name,
        }
