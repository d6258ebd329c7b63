"""OpenCompass model for an arm served over an OpenAI-compatible API: the student on one or
several `edge0-eval serve` hosts, the teacher on `mlx_lm.server` (or any such engine).

It is OpenCompass's `OpenAISDK` (the `openai` client) with the in-process arms' settings, so an
API arm's settings fingerprint is theirs: the same `generation_kwargs` (mlx-lm's filters and
penalties, `seed`), `stop_words`, `chat_template_kwargs`, `max_seq_len` and meta template, and
every request carries them. What stock `OpenAISDK` cannot do, this class does:

- Hosts. Stock OpenAISDK picks one of its `openai_api_base` URLs at random per task. Here each
  request goes to the listed host with the fewest requests in flight; a host that refuses a
  connection or answers 5xx, 408, 409 or 429 (busy, as the openai client retries them) is
  left for `retry_wait` seconds and the request is retried on
  another (`retry` attempts in all); then the call fails and OpenCompass's `-r` resumes it.
- Seeds. Each request sends the configured `seed` and, as the extension `edge0_sample`, which
  of its question's repeats it is (the inferencer passes the indices); `edge0-eval serve`
  draws the row from `row_seed(seed, prompt ids, sample)`, as the in-process arm does, so a
  prediction equals the in-process `Edge0Model` arm's. (Stock OpenAISDK can carry the seed in
  `openai_extra_kwargs=dict(seed=0)`, never a per-prompt sample index: repeats would draw
  alike.) mlx-lm's server seeds its global generator instead: its sampled rows differ.
- Text. An `edge0-eval serve` host's answer is taken as it is (its text, finish reason and
  token count, in its `edge0` field): the server applied the arm's one stop rule to the row
  (engine/batch.py), so it is the in-process arm's answer. Any other server (mlx_lm.server) is
  the one case read through the stop rule here: requests ask for logprobs, and the answer's
  token ids go through the arm's stop rule and its text reader, as in-process (mlx-lm's server
  detokenizes some bytes otherwise, e.g. byte 0 as 'Ā'); one that returns no ids is read
  from its text.
- Length. A host that reports its `max_model_len` (edge0-eval serve's /v1/models) is asked
  for at most the rest of the row after the prompt, as that host counts it: a `max_out_len`
  beyond the model's context would otherwise be refused (400) where the in-process arm
  answers; an answer that ends within the context is the same either way.
- Stats. `edge0-eval serve` returns each answer's engine stats (the extension field `edge0`):
  they become the sample's stats, as an in-process student's, with the model identity of the
  host that served it; another server's samples record what the response says.

tokenizer_path: the model's directory, or a local copy of its tokenizer files with config.json
and generation_config.json (its stop ids): the inferencer reads the chat template's thinking
opener through it, and answers are decoded and stopped with it, as in-process. Prompts are cut
to `max_seq_len` by the server (`edge0_max_seq_len`), as in-process; mlx-lm's server does not.
"""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Dict, List, Optional

from mlx_lm.utils import load_config, load_tokenizer
from openai import (
    APIConnectionError,
    APIError,
    APIStatusError,
    APITimeoutError,
    OpenAI,
)
from opencompass.models import OpenAISDK
from opencompass.registry import MODELS

from edge0_eval.engine.batch import StopRule, stop_token_ids, trim_at_stop
from edge0_eval.engine.inputs import (
    chat_ids,
    chat_text,
    fit_prompt,
    penalties_of,
    to_messages,
)
from edge0_eval.errors import ConfigError

from .chat import (
    DEFAULT_META_TEMPLATE,
    SampleStatsLog,
    check_sample_indices,
    sampling_options,
)

# 4xx statuses that say the host is busy, not that the request is wrong (the openai client
# retries these too): handled as a 5xx, another host tried.
HOST_BUSY = (408, 409, 429)


def api_problems(name: str, cfg: Dict[str, Any], timeout: float = 10.0) -> List[str]:
    """What would stop an API arm (the preflight's check, before any task): a missing tokenizer
    copy, a host that does not answer GET /models, or one that serves another model (a server
    that lists no such name, as mlx-lm's for 'default_model', is taken at its word)."""
    problems = []
    tokenizer = cfg.get("tokenizer_path")
    if not tokenizer or not Path(str(tokenizer)).is_dir():
        problems.append(
            f"{name}: tokenizer_path {tokenizer!r} is not a directory (a local copy "
            f"of the model's tokenizer files, config.json and "
            f"generation_config.json)"
        )
    bases = cfg.get("openai_api_base")
    for base in [bases] if isinstance(bases, str) else list(bases or []):
        try:
            with urllib.request.urlopen(
                f"{str(base).rstrip('/')}/models", timeout=timeout
            ) as r:
                body = r.read()
        except (OSError, ValueError) as exc:
            problems.append(
                f"{name}: {base} does not answer GET /models ({exc}); start the "
                f"server there (edge0-eval serve, mlx_lm.server) or fix the URL"
            )
            continue
        try:
            served = [m.get("id") for m in json.loads(body).get("data", [])]
        except (ValueError, AttributeError):
            continue  # it answers, but lists nothing readable: not checked
        if cfg.get("path") != "default_model" and cfg.get("path") not in served:
            problems.append(
                f"{name}: {base} serves {served}, not {cfg.get('path')!r}; start it "
                f"with --served-model-name {cfg.get('path')}"
            )
    return problems


class Hosts:
    """The listed API bases: a request takes the least busy one that is up; a host that
    failed is down for `cool` seconds (when every host is, the request waits for the first)."""

    def __init__(self, bases: List[str], cool: float):
        self.bases, self.cool = list(bases), cool
        self.busy = {b: 0 for b in self.bases}
        self.down_until = {b: 0.0 for b in self.bases}
        self.lock = threading.Lock()

    def take(self, avoid: Optional[str] = None) -> tuple[str, float]:
        """(a base, seconds to wait before using it); `avoid`: the one that just failed."""
        with self.lock:
            now = time.monotonic()
            candidates = [b for b in self.bases if b != avoid] or self.bases
            base = min(
                candidates, key=lambda b: (max(self.down_until[b], now), self.busy[b])
            )
            self.busy[base] += 1
            return base, max(0.0, self.down_until[base] - now)

    def give(self, base: str, failed: bool) -> None:
        with self.lock:
            self.busy[base] -= 1
            if failed:
                self.down_until[base] = time.monotonic() + self.cool


@MODELS.register_module()
class Edge0APIModel(SampleStatsLog, OpenAISDK):
    """An OpenAI-compatible API arm with the in-process arms' generation settings.

    Config example (configs/tiers/edge0_api.py)::

        dict(type=Edge0APIModel, abbr='edge0-35b-student-api', path='edge0-student',
             openai_api_base=['http://host-a:8001/v1', 'http://host-b:8001/v1'],
             tokenizer_path='/models/student', **generation)
    """

    arm = "api"

    def __init__(
        self,
        path: str,
        openai_api_base,
        tokenizer_path: str,
        max_seq_len: int = 32768,
        meta_template: Optional[Dict] = None,
        generation_kwargs: Optional[Dict] = None,
        stop_words: Optional[List[str]] = None,
        chat_template_kwargs: Optional[Dict] = None,
        key: Optional[str] = None,
        retry: int = 3,
        retry_wait: float = 5.0,
        timeout: int = 3600,
        max_workers: Optional[int] = None,
        stats_jsonl: Optional[str] = None,
        **kwargs,
    ):
        bases = (
            [openai_api_base] if isinstance(openai_api_base, str) else openai_api_base
        )
        if not bases or not all(
            isinstance(b, str) and b.startswith(("http://", "https://")) for b in bases
        ):
            raise ConfigError(
                f"api: openai_api_base must be a URL or a list of URLs "
                f"(http://HOST:PORT/v1), not {openai_api_base!r}"
            )
        if not tokenizer_path or not Path(tokenizer_path).is_dir():
            raise ConfigError(
                f"api: tokenizer_path {tokenizer_path!r} is not a directory; give "
                f"a local copy of the model's tokenizer files (the chat "
                f"template's thinking opener and prompt lengths are read from it)"
            )
        if isinstance(retry, bool) or not isinstance(retry, int) or retry < 1:
            raise ConfigError(f"api: retry must be a whole number >= 1, not {retry!r}")
        # The key `edge0-eval serve --api-key` reads from the same variable, kept out of configs
        # (and so out of the config dump a run leaves).
        key = key or os.environ.get("EDGE0_API_KEY") or "EMPTY"
        self.sampling = sampling_options(dict(generation_kwargs or {}), "api")
        self.stop_words = [s for s in (stop_words or []) if s]
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.stats_jsonl = stats_jsonl
        self.sample_stats: List[Dict[str, Any]] = []
        self.hosts = Hosts(bases, retry_wait)
        self.concurrency = max_workers  # None: every prompt of a call at once
        super().__init__(
            path=path,
            max_seq_len=max_seq_len,
            query_per_second=10**6,
            retry=retry,
            key=key,
            meta_template=meta_template or DEFAULT_META_TEMPLATE,
            openai_api_base=bases,
            tokenizer_path=tokenizer_path,
            max_workers=max_workers,
            timeout=timeout,
            **kwargs,
        )
        self.generation_kwargs = dict(generation_kwargs or {})
        # The client OpenAISDK uses, one per host, without its own retries (ours go elsewhere).
        self.clients = {
            b: OpenAI(base_url=b, api_key=key, max_retries=0, timeout=timeout)
            for b in bases
        }
        self.contexts: Dict[str, Optional[int]] = {}  # host -> its max_model_len

    # -- the tokenizer: the arm's own, as in-process ----------------------------------------
    def _init_tokenizer(self):
        """mlx-lm's tokenizer with the stop ids mlx_lm.load gives it (generation_config.json's
        eos over config.json's), as both in-process arms have it."""
        path = Path(self.tokenizer_path)
        config = load_config(path) if (path / "config.json").is_file() else {}
        self.tokenizer = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
        self.tokenizer_type = "mlx-lm"

    def chat_text(self, prompt: Any) -> str:
        return chat_text(self.tokenizer, to_messages(prompt), self.chat_template_kwargs)

    def get_token_len(self, prompt: Any) -> int:
        return len(
            chat_ids(self.tokenizer, to_messages(prompt), self.chat_template_kwargs)
        )

    # -- generation --------------------------------------------------------------------------
    def generate(
        self,
        inputs: List[Any],
        max_out_len: int,
        stopping_criteria: Optional[List[str]] = None,
        sample_indices: Optional[List[int]] = None,
        **kwargs,
    ) -> List[str]:
        samples = check_sample_indices(sample_indices, len(inputs), self.arm)
        stop_words = list(
            dict.fromkeys(self.stop_words + list(stopping_criteria or []))
        )
        jobs = [(p, j, max_out_len, stop_words) for p, j in zip(inputs, samples)]
        workers = min(len(jobs), self.concurrency or len(jobs)) or 1
        with ThreadPoolExecutor(max_workers=workers) as pool:
            rows = list(pool.map(lambda job: self._generate_row(*job), jobs))
        outputs = []
        for text, stats in rows:
            self._record(stats)
            outputs.append(text)
        return outputs

    def _request(
        self, prompt: Any, sample: int, max_out_len: int, stop_words: List[str]
    ) -> Dict[str, Any]:
        s = self.sampling
        body = dict(
            model=self.path,
            messages=to_messages(prompt),
            max_tokens=max_out_len,
            temperature=s["temperature"],
            top_p=s["top_p"],
            seed=s["seed"],
            logprobs=True,
        )
        # Every sampling field explicit: a server's generation_config.json defaults (as
        # vLLM's and edge0-eval serve's) must not reach rows the in-process arms draw without.
        extra = dict(
            top_k=s["top_k"],
            min_p=s["min_p"],
            **{"repetition_penalty": 1.0, **penalties_of(s)},
            chat_template_kwargs=self.chat_template_kwargs,
            edge0_sample=sample,
            edge0_max_seq_len=self.max_seq_len,
        )
        if stop_words:
            body["stop"] = stop_words
        return dict(body, extra_body=extra)

    def _context(self, base: str) -> Optional[int]:
        """The host's max_model_len, if its /v1/models gives one (edge0-eval serve's does);
        asked once per host."""
        if base not in self.contexts:
            try:
                models = self.clients[base].models.list().data
            except (APIConnectionError, APITimeoutError):
                return None  # unknown for now: asked again with the next request
            except (APIError, ValueError):
                # It answers, but not a list to read (mlx_lm.server's listing can fail
                # offline, leaving an empty body): no length to go by.
                models = []
            lengths = [
                getattr(m, "max_model_len", None)
                for m in models
                if getattr(m, "id", None) == self.path
            ]
            self.contexts[base] = next(
                (n for n in lengths if isinstance(n, int) and n > 0), None
            )
        return self.contexts[base]

    def _max_tokens(self, base: str, prompt_len: int, max_out_len: int) -> int:
        """max_out_len, or the rest of the host's row after the prompt when that is less."""
        context = self._context(base)
        if context is None or prompt_len + max_out_len <= context:
            return max_out_len
        room = max(1, context - prompt_len)
        self.logger.warning(
            f"api: {base} holds {context} tokens a row (max_model_len): this "
            f"{prompt_len}-token prompt is asked for {room} new tokens, not "
            f"max_out_len {max_out_len}"
        )
        return room

    def _generate_row(
        self, prompt: Any, sample: int, max_out_len: int, stop_words: List[str]
    ) -> tuple[str, Dict[str, Any]]:
        request = self._request(prompt, sample, max_out_len, stop_words)
        # The prompt as the server counts it: templated and cut as in-process.
        ids = chat_ids(self.tokenizer, request["messages"], self.chat_template_kwargs)
        prompt_len = len(fit_prompt(ids, self.max_seq_len, max_out_len))
        last, base = None, None
        for attempt in range(self.retry):
            base, wait = self.hosts.take(avoid=base)
            time.sleep(wait)
            request["max_tokens"] = self._max_tokens(base, prompt_len, max_out_len)
            start = time.perf_counter()
            failed = True
            try:
                response = self.clients[base].chat.completions.create(**request)
                failed = False
            except APIStatusError as exc:
                if exc.status_code < 500 and exc.status_code not in HOST_BUSY:
                    failed = False  # the request is at fault, not the host: keep it up
                    raise ConfigError(
                        f"api: {base} refused the request ({exc.status_code}): "
                        f"{exc.message}"
                    ) from None
                last = exc
            except (APIConnectionError, APITimeoutError) as exc:
                last = exc
            finally:
                self.hosts.give(base, failed)
            if not failed:
                return self._answer(
                    response,
                    base,
                    prompt,
                    sample,
                    max_out_len,
                    stop_words,
                    time.perf_counter() - start,
                )
            self.logger.warning(
                f"api: {base}: {type(last).__name__}: {last} (attempt "
                f"{attempt + 1} of {self.retry})"
            )
        raise RuntimeError(
            f"api: no host answered after {self.retry} attempts (last: {base}: "
            f"{type(last).__name__}: {last}); restart the server(s) and resume "
            f"with opencompass -r"
        )

    def _answer(
        self,
        response,
        base: str,
        prompt: Any,
        sample: int,
        max_out_len: int,
        stop_words: List[str],
        wall: float,
    ) -> tuple[str, Dict[str, Any]]:
        """The prediction as the in-process arm writes it, and the sample's stats."""
        choice = response.choices[0]
        served = getattr(response, "edge0", None)
        if isinstance(served, dict):  # edge0-eval serve: the row's own answer
            stats = dict(served)
            stats.update(arm=self.arm, api_base=base, client_wall_s=round(wall, 4))
            return choice.message.content or "", stats
        # Another server: its token ids through the arm's stop rule, as in-process.
        entries = (
            choice.logprobs.content if choice.logprobs is not None else None
        ) or []
        ids = [getattr(e, "id", None) for e in entries]
        usage = response.usage
        tokens = getattr(usage, "completion_tokens", None)
        if entries and all(isinstance(i, int) for i in ids):
            row = StopRule(
                self.tokenizer,
                max_out_len,
                stop_token_ids(self.tokenizer, stop_words),
                stop_words,
            )
            for token in ids:
                if row.add(token):
                    break
            (text, hit), finish = row.text(), row.finish or choice.finish_reason
            tokens = len(row.tokens)
        else:
            message = choice.message
            reasoning = (
                getattr(message, "reasoning_content", None)
                or getattr(message, "reasoning", None)
                or ""
            )
            content = message.content or ""
            text = (
                reasoning + self.think_tag + content
                if reasoning and content
                else reasoning or content
            )
            text, hit = trim_at_stop(text, stop_words)
            finish = choice.finish_reason
        stats = {
            "prompt_tokens": getattr(usage, "prompt_tokens", None),
            "tokens": tokens,
            "seed": self.sampling["seed"],
            "sample": sample,
            "finish_reason": finish,
            "stop_word": hit,
            "model_identity": {"served_model": self.path},
            "arm": self.arm,
            "api_base": base,
            "client_wall_s": round(wall, 4),
        }
        return text, stats
