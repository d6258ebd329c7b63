"""OpenAI request bodies -> one checked `RequestSpec`, or one `RequestError` naming the field.

Fields (null is the same as absent):
  model                      the served name (`--served-model-name`); absent: that one (vLLM)
  messages (chat)            [{role: system|developer|user|assistant, content: str | [{type:
                             text, text}] (null: an assistant turn's only), name?}], given to
                             the chat template as sent: the template decides what consecutive
                             roles, empty turns or a developer turn mean
  prompt (completions)       a string or a list of token ids, or a list of either (one choice
                             per prompt and `n`: choice p * n + i is prompt p's i-th)
  max_tokens / max_completion_tokens   whole number in 0..`--max-model-len` (0: no new token,
                             e.g. with echo; default: the rest of the row, `--max-model-len`
                             less the prompt, at most `--max-tokens` when that is given, as
                             vLLM); with the prompt's tokens, at most `--max-model-len`
                             (checked once the prompt is tokenized: worker.py)
  temperature, top_p, top_k, min_p     mlx-lm's filters, checked as the in-process arms check
                             them (edge0_eval/engine/inputs.py: vLLM's ranges;
                             top_k 0 or -1 and min_p 0: off; sampling, top_k below the
                             vocabulary size, as mlx-lm's top-k needs); absent: the server's
                             defaults (`generation_defaults`: the model's generation_config.json
                             as vLLM reads it), else temperature 1.0, the rest off (OpenAI's)
  repetition_penalty, presence_penalty, frequency_penalty, and each *_context_size
                             mlx-lm's penalties, with mlx-lm's meaning (the last
                             `*_context_size` tokens, the prompt included; not OpenAI's); a
                             context size at most 2**31 - 1 (MLX takes no larger)
  stop                       a string or a list of strings (UTF-8 text: no lone surrogates);
                             the text is cut at the first
  seed                       whole number >= 0 (absent, null or -1: a fresh one, drawn for
                             this request and returned in `edge0.request_seed`, so the answer
                             can be replayed): the run's seed, as in a model config's
                             generation_kwargs; choice i draws from `row_seed(seed, prompt
                             ids, edge0_sample + i)` (edge0_eval/engine/inputs.py), as the
                             in-process arms draw sample edge0_sample + i
  n                          choices per prompt, 1..MAX_CHOICES in all: rows of the running
                             batch, choice i sample edge0_sample + i (n > 1 needs a
                             temperature > 0, as vLLM)
  edge0_sample               whole number >= 0 (default 0): which of a question's repeats this
                             is (OpenCompass's dataset `n`); an extension
  edge0_max_seq_len          whole number >= 1: cut the prompt as the in-process arms do for
                             their max_seq_len (head and tail kept); an extension
  chat_template_kwargs       an object for the chat template, e.g. {"enable_thinking": false}
  logprobs, top_logprobs     chat: a bool and 0..20; completions: logprobs 0..5 (legacy)
  echo (completions)         the prompt before the answer; with logprobs, the prompt tokens'
                             teacher-forced log-probs too (the first token's null)
  stream, stream_options     a bool; {"include_usage": bool}
  best_of, user              best_of only n; user is accepted and unused
Fields that would change the answer and are not built are refused unless harmless: `tools`
or `functions` (unless their choice is "none"), a `tool_choice` other than none/auto, a
`response_format` other than text, a `logit_bias`, a `suffix`, a chat `echo`. Any other field
is ignored and named in `RequestSpec.ignored` (the server logs it, as vLLM does).
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, field
from typing import Any

from edge0_eval.engine.inputs import (
    PENALTIES,
    PENALTY_KEYS,
    check_filters,
    check_penalties,
    check_temperature,
)
from edge0_eval.errors import ConfigError

ROLES = ("system", "developer", "user", "assistant")
MAX_CHOICES = 128  # n: choices per request (each a row of the batch)
# A request without a seed draws one below this: every row seed is 31 bits (row_seed).
SEED_RANGE = 2**31
# MLX reads a *_context_size as int32 (std::bad_cast above)
MAX_CONTEXT_SIZE = 2**31 - 1
# A row's most tokens (prompt and answer) when neither --max-model-len nor the model's config
# (max_position_embeddings) gives one.
DEFAULT_MAX_MODEL_LEN = 32768
MAX_TOP_LOGPROBS = {"chat": 20, "completion": 5}
COMMON = (
    "model",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    *PENALTY_KEYS,
    "stop",
    "seed",
    "edge0_sample",
    "edge0_max_seq_len",
    "logprobs",
    "stream",
    "stream_options",
    "n",
    "user",
)
FIELDS = {
    "chat": COMMON + ("messages", "top_logprobs", "chat_template_kwargs"),
    "completion": COMMON + ("prompt", "best_of", "echo"),
}
# Not built: each field's harmless values (any other is refused: it would change the answer).
NOT_BUILT = {
    "tools": lambda v, b: not v or b.get("tool_choice") == "none",
    "functions": lambda v, b: not v or b.get("function_call") == "none",
    "tool_choice": lambda v, b: v == "none" or (v == "auto" and not b.get("tools")),
    "function_call": lambda v, b: (
        v == "none" or (v == "auto" and not b.get("functions"))
    ),
    "response_format": lambda v, b: v == {"type": "text"},
    "logit_bias": lambda v, b: not v,
    "suffix": lambda v, b: not v,
    "echo": lambda v, b: not v,  # chat's (vLLM's extension); completions' is built
}
# Sampling defaults without a generation config: OpenAI's and vLLM's (temperature 1.0).
OPENAI_DEFAULTS = {"temperature": 1.0}
# generation_config.json's keys vLLM takes as defaults (its max_new_tokens is not read here).
GENERATION_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


# OpenAI's error code for a request beyond the context, which clients test for.
CONTEXT_EXCEEDED = "context_length_exceeded"


class RequestError(Exception):
    """A request the server refuses: an OpenAI error object with this status."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        status: int = 400,
        kind: str = "invalid_request_error",
        code: str | None = None,
    ):
        super().__init__(message)
        self.message, self.param, self.status, self.kind, self.code = (
            message,
            param,
            status,
            kind,
            code,
        )

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }


@dataclass
class RequestSpec:
    kind: str  # 'chat' | 'completion'
    model: str
    prompts: list  # chat: [the messages]; completion: [str | list[int]]
    max_tokens: int | None  # None: the rest of the row (worker.py)
    sampling: dict  # RowSampler's keyword arguments
    seed: int  # the request's (drawn when it gave none)
    sample: int  # choice i is sample `sample + i`
    n: int = 1
    stop: list[str] = field(default_factory=list)
    max_seq_len: int | None = None
    chat_template_kwargs: dict = field(default_factory=dict)
    logprobs: int | None = None  # None: none; k >= 0: the token's and the top k
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    ignored: list[str] = field(default_factory=list)  # fields not read (logged)

    @property
    def choices(self) -> int:
        return len(self.prompts) * self.n


def _whole(body: dict, key: str, low: int, high: int | None = None) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value < low
        or (high is not None and value > high)
    ):
        span = f">= {low}" if high is None else f"in {low}..{high}"
        raise RequestError(f"{key} must be a whole number {span}, not {value!r}", key)
    return value


def _number(body: dict, key: str) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
    ):
        raise RequestError(f"{key} must be a finite number, not {value!r}", key)
    return value


def _flag(body: dict, key: str) -> bool | None:
    value = body.get(key)
    if value is not None and not isinstance(value, bool):
        raise RequestError(f"{key} must be true or false, not {value!r}", key)
    return value


def _checked(check, key: str, *args):
    try:
        check(*args)
    except ConfigError as exc:
        raise RequestError(str(exc), key) from None


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(
            "messages must be a non-empty list of {role, content} objects", "messages"
        )
    out = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise RequestError(
                f"{where} must be an object with role and content", where
            )
        role, content = msg.get("role"), msg.get("content")
        if role not in ROLES:
            raise RequestError(
                f"{where}.role must be one of {', '.join(ROLES)}, not {role!r}",
                f"{where}.role",
            )
        # An assistant turn may come without content (OpenAI's spec, vLLM): empty text.
        if content is None and role == "assistant":
            content = ""
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not (
                    isinstance(part, dict)
                    and part.get("type") == "text"
                    and isinstance(part.get("text"), str)
                ):
                    raise RequestError(
                        f"{where}.content[{j}] must be a text part "
                        f'{{"type": "text", "text": ...}} (this server reads '
                        f"text only)",
                        f"{where}.content[{j}]",
                    )
                parts.append(part["text"])
            content = "".join(parts)
        if not isinstance(content, str):
            raise RequestError(
                f"{where}.content must be a string or a list of text parts, "
                f"not {type(content).__name__}",
                f"{where}.content",
            )
        message = {"role": role, "content": content}
        name = msg.get("name")
        if name is not None:
            if not isinstance(name, str):
                raise RequestError(f"{where}.name must be a string", f"{where}.name")
            message["name"] = name  # the template may use it
        out.append(message)
    return out


def _ids(prompt, vocab: int) -> bool:
    return (
        isinstance(prompt, list)
        and bool(prompt)
        and all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
            for t in prompt
        )
    )


def _prompts(body: dict, vocab: int) -> list:
    """prompt: a string or token ids, or a non-empty list of either -> the list of prompts."""
    prompt = body.get("prompt")
    if (isinstance(prompt, str) and prompt) or _ids(prompt, vocab):
        return [prompt]
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        for i, p in enumerate(prompt):
            if not ((isinstance(p, str) and p) or _ids(p, vocab)):
                raise RequestError(
                    f"prompt[{i}] must be a non-empty string or a non-empty list of "
                    f"token ids in 0..{vocab - 1}",
                    "prompt",
                )
        return list(prompt)
    raise RequestError(
        f"prompt must be a non-empty string, a non-empty list of token ids in "
        f"0..{vocab - 1}, or a list of such prompts",
        "prompt",
    )


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise RequestError("stop must be a non-empty string or a list of them", "stop")
    for s in stops:
        try:
            s.encode("utf-8")  # the tokenizer takes UTF-8 text only
        except UnicodeEncodeError as exc:
            raise RequestError(
                f"stop {s!r} is not UTF-8 text ({exc.reason} at character "
                f"{exc.start}: a lone surrogate escape); send whole characters",
                "stop",
            ) from None
    return list(dict.fromkeys(stops))


def _sampling(body: dict, vocab: int) -> dict:
    temperature = _number(body, "temperature")
    if temperature is not None:
        _checked(check_temperature, "temperature", temperature)
    top_p = _number(body, "top_p")
    if top_p is not None and not 0 < top_p <= 1:
        raise RequestError(
            f"top_p must be a number in (0, 1] (1: off), not {top_p!r}", "top_p"
        )
    top_k = body.get("top_k")
    if top_k == -1:
        top_k = 0  # vLLM's (and many clients') spelling of off
    if top_k is not None:
        _checked(check_filters, "top_k", top_k, 0.0)
        if (
            top_k >= vocab and temperature
        ):  # mlx-lm's apply_top_k takes 0 < k < vocab only
            raise RequestError(
                f"top_k must be below the vocabulary size {vocab} (0: off), not "
                f"{top_k}",
                "top_k",
            )
    min_p = body.get("min_p")
    if min_p is not None:
        _checked(check_filters, "min_p", 0, min_p)
    penalties = {k: body[k] for k in PENALTY_KEYS if body.get(k) is not None}
    for key, value in penalties.items():
        if key in PENALTIES:
            _checked(check_penalties, key, {key: value})
    for key, value in penalties.items():
        if key not in PENALTIES:  # a context size: its penalty must be set too
            penalty = key.replace("context_size", "penalty")
            _checked(
                check_penalties, key, {key: value, penalty: penalties.get(penalty)}
            )
            if value > MAX_CONTEXT_SIZE:
                raise RequestError(
                    f"{key} must be at most {MAX_CONTEXT_SIZE} (the recent "
                    f"tokens the penalty looks at), not {value}",
                    key,
                )
    return dict(
        temperature=float(temperature or 0.0),
        top_p=float(1.0 if top_p is None else top_p),
        top_k=int(top_k or 0),
        min_p=float(min_p or 0.0),
        penalties=penalties,
    )


def fresh_seed() -> int:
    """A seed for a request that gave none: each such request draws its own (so k requests
    are k samples), from the system's entropy (two hosts never share a sequence)."""
    return secrets.randbelow(SEED_RANGE)


def generation_defaults(generation: dict | None, vocab: int, source: str) -> dict:
    """The sampling defaults of a request that gives none, as vLLM's `--generation-config
    auto` takes them: generation_config.json's keys (GENERATION_KEYS) over OpenAI's (None:
    OpenAI's alone, vLLM's `--generation-config vllm`); checked as a request's are."""
    keys = {k: generation[k] for k in GENERATION_KEYS if k in (generation or {})}
    defaults = {**OPENAI_DEFAULTS, **keys}
    try:
        _sampling(defaults, vocab)
    except RequestError as exc:
        raise ConfigError(
            f"{source}: {exc.message}; fix the file, or serve with --generation-config "
            f"vllm to ignore it"
        ) from None
    return defaults


def _unread(body: dict, kind: str) -> list[str]:
    """The fields not read here: refused where the value would change the answer
    (NOT_BUILT), else returned, to be logged."""
    ignored = []
    for key in sorted(k for k in body if k not in FIELDS[kind]):
        harmless = NOT_BUILT.get(key)
        if harmless is not None and not harmless(body[key], body):
            raise RequestError(
                f"{key} {repr(body[key])[:80]} is not supported by this server (the answer would "
                f"ignore it); drop the field or send a value that changes nothing "
                f'(e.g. tool_choice "none", response_format {{"type": "text"}})',
                key,
            )
        if body[key] is not None:
            ignored.append(key)
    return ignored


def _model(body: dict, served: str) -> str:
    model = body.get("model")
    if model is None:
        return served  # as vLLM: the one served model
    if not isinstance(model, str):
        raise RequestError(f"model must be a string: {served!r} is served", "model")
    if model != served:
        raise RequestError(
            f"model {model!r} is not served here; this server serves {served!r}",
            "model",
            status=404,
            code="model_not_found",
        )
    return model


def _max_tokens(body: dict, max_model_len: int | None) -> int | None:
    key = (
        "max_completion_tokens"
        if body.get("max_completion_tokens") is not None
        else "max_tokens"
    )
    max_tokens = _whole(body, key, 0)
    if (
        max_tokens is not None
        and max_model_len is not None
        and max_tokens >= max_model_len
    ):
        # Equal leaves no room for a prompt (one token at least).
        raise RequestError(
            f"{key} is {max_tokens}, leaving no room for a prompt in the "
            f"{max_model_len} tokens a row may hold on this server, prompt "
            f"included (--max-model-len); ask for fewer",
            key,
            code=CONTEXT_EXCEEDED,
        )
    return max_tokens


def _stream(body: dict, ignored: list[str]) -> tuple[bool, bool]:
    """(stream, include_usage); stream_options' other keys join `ignored`."""
    stream = bool(_flag(body, "stream"))
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not isinstance(options, dict) or not isinstance(
        options.get("include_usage", False), bool
    ):
        raise RequestError(
            'stream_options must be an object, e.g. {"include_usage": true}',
            "stream_options",
        )
    if not stream:
        raise RequestError("stream_options is only for stream: true", "stream_options")
    ignored += [f"stream_options.{k}" for k in sorted(options) if k != "include_usage"]
    return stream, bool(options.get("include_usage"))


def _chat(body: dict) -> tuple[list, int | None, dict]:
    """A chat request's (prompts, logprobs, chat_template_kwargs)."""
    want = _flag(body, "logprobs")
    top = _whole(body, "top_logprobs", 0, MAX_TOP_LOGPROBS["chat"])
    if top is not None and not want:
        raise RequestError("top_logprobs needs logprobs: true", "top_logprobs")
    template = body.get("chat_template_kwargs")
    if template is not None and not isinstance(template, dict):
        raise RequestError(
            'chat_template_kwargs must be an object, e.g. {"enable_thinking": false}',
            "chat_template_kwargs",
        )
    return [_messages(body)], (top or 0) if want else None, dict(template or {})


def _choices(body: dict, sampling: dict, prompts: int) -> int:
    n = _whole(body, "n", 1, MAX_CHOICES) or 1
    best_of = body.get("best_of")
    if best_of is not None and (isinstance(best_of, bool) or best_of != n):
        raise RequestError(
            f"best_of must equal n ({n}): every row drawn is returned, none is ranked "
            f"out; not {best_of!r}",
            "best_of",
        )
    if n > 1 and sampling["temperature"] == 0:
        raise RequestError(
            f"n is {n} at temperature 0: greedy choices are all the same; give a "
            f"temperature > 0 for {n} samples (as vLLM)",
            "n",
        )
    if n * prompts > MAX_CHOICES:
        raise RequestError(
            f"{prompts} prompts x n {n} is {n * prompts} choices; at most "
            f"{MAX_CHOICES} a request: send fewer prompts or a smaller n",
            "n",
        )
    return n


def parse_request(
    body: Any,
    kind: str,
    *,
    served: str,
    vocab: int,
    max_model_len: int | None = None,
    defaults: dict | None = None,
) -> RequestSpec:
    """A request body of `kind` ('chat' or 'completion') -> its RequestSpec. max_model_len:
    the most tokens a row may hold, prompt and answer (None: no bound). defaults: the
    sampling fields of a request that gives none (generation_defaults; None: greedy)."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    ignored = _unread(body, kind)
    model = _model(body, served)
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise RequestError("user must be a string", "user")
    max_tokens = _max_tokens(body, max_model_len)
    seed = None if body.get("seed") == -1 else _whole(body, "seed", 0)
    stream, include_usage = _stream(body, ignored)
    echo = False
    if kind == "chat":
        prompts, logprobs, template = _chat(body)
    else:
        prompts, template = _prompts(body, vocab), {}
        logprobs = _whole(body, "logprobs", 0, MAX_TOP_LOGPROBS["completion"])
        echo = bool(_flag(body, "echo"))
    given = {k: v for k, v in body.items() if v is not None}
    sampling = _sampling({**(defaults or {}), **given}, vocab)
    return RequestSpec(
        kind=kind,
        model=model,
        prompts=prompts,
        max_tokens=max_tokens,
        sampling=sampling,
        seed=fresh_seed() if seed is None else seed,
        sample=_whole(body, "edge0_sample", 0) or 0,
        n=_choices(body, sampling, len(prompts)),
        stop=_stop(body),
        max_seq_len=_whole(body, "edge0_max_seq_len", 1),
        chat_template_kwargs=template,
        logprobs=logprobs,
        stream=stream,
        include_usage=include_usage,
        echo=echo,
        ignored=ignored,
    )
