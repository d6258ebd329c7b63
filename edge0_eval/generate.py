"""`edge0-eval generate MODEL --prompt TEXT`: generate with the streaming engine.

`--prompts FILE --batch B`: every line of FILE (JSON lines) is one row, {"prompt": TEXT} with
an optional {"seed": N} (default --seed); rows decode B at a time (Engine.generate_batch,
continuous batching). `--json` then writes one entry per row with its `tokens`.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from mlx_lm.generate import wired_limit

from edge0_eval.arguments import value_types as ct
from edge0_eval.arguments.engine_flags import add_engine_arguments, options_from_args
from edge0_eval.arguments.fields import add_fields, option
from edge0_eval.engine.engine import Engine
from edge0_eval.engine.inputs import check_filters, check_penalties, check_temperature
from edge0_eval.errors import ConfigError
from edge0_eval.formats.jsonl import iter_jsonl


@dataclass
class GenerateOptions:
    """generate's own options, each declared once (the engine's are EngineOptions')."""

    model: str = option(
        help="converted model directory (edge0-eval convert)", flag="model"
    )
    prompt: str | None = option(None, "the prompt text")  # or --prompts: one of them
    prompts: Path | None = option(
        None, 'JSON lines, one {"prompt": TEXT[, "seed": N]} per row', type=Path
    )
    batch: int | None = option(
        None,
        "--prompts: rows decoded at once (default 1); the expert buffer "
        "grows to B x K slots per layer when the budget holds fewer",
        type=ct.positive_int,
    )
    raw: bool = option(False, "do not apply the chat template")
    chat_template_config: dict = option(
        help="extra arguments for the chat template as a JSON object, as in mlx-lm's "
        "generate: '{\"enable_thinking\": false}' turns thinking off",
        factory=dict,
        type=ct.json_object,
    )
    max_tokens: int = option(64, "tokens generated per row", type=ct.positive_int)
    temp: float = option(0.0, "sampling temperature (0: greedy)", type=ct.nonneg_float)
    top_p: float = option(
        1.0,
        "nucleus sampling: the most likely tokens up to this mass",
        type=ct.float_range(0.0, 1.0, low_open=True),
    )
    # Sampling filters and penalties as mlx-lm's (engine/inputs.py), under its names:
    # --top-k samples; the routing width is --experts-per-token.
    top_k: int = option(
        0,
        "sample among the k most likely tokens (0: off), as in mlx-lm",
        type=ct.nonneg_int,
    )
    min_p: float = option(
        0.0,
        "drop tokens below min-p x the top token's probability (0: off)",
        type=ct.float_range(0.0, 1.0),
    )
    presence_penalty: float | None = option(
        None,
        "mlx-lm's: subtracted from the logits of the last 20 tokens (prompt included)",
        type=ct.finite_float,
    )
    repetition_penalty: float | None = option(
        None,
        "mlx-lm's: divides (multiplies if negative) the logits of the last 20 tokens",
        type=ct.positive_float,
    )
    stop: list[str] = option(
        help="a string that ends a row as soon as its text holds one; the text is cut "
        "there (repeat for several)",
        factory=list,
        action="append",
        metavar="TEXT",
    )
    json_path: str | None = option(
        None,
        "write generated token ids, text and stats here",
        flag="--json",
        type=ct.output_file,
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = ("prompt", "prompts")
    add_fields(
        parser.add_mutually_exclusive_group(required=True), GenerateOptions, source
    )
    add_fields(parser, GenerateOptions, skip=source)
    parser.add_argument(
        "--sample-top-k", type=_renamed_sample_top_k, help=argparse.SUPPRESS
    )
    add_engine_arguments(parser, samples=True)


def _renamed_sample_top_k(text: str):
    raise argparse.ArgumentTypeError(
        "--sample-top-k is --top-k now, as in mlx-lm (the routing width is "
        "--experts-per-token)"
    )


ROW_KEYS = ("prompt", "seed")


def read_prompts(path: Path) -> list[tuple[str, int | None]]:
    """(prompt text, seed or None) per non-empty line of a --prompts file."""
    if not path.is_file():
        raise ConfigError(
            f"--prompts {path}: file not found; give a JSON-lines file with one "
            f'{{"prompt": ...}} per line'
        )
    rows = []
    for lineno, record in iter_jsonl(path):
        unknown = sorted(set(record) - set(ROW_KEYS))
        if unknown:
            # a per-row option this reader does not apply would be ignored silently
            raise ConfigError(
                f"--prompts {path}:{lineno}: unknown key "
                f"{', '.join(map(repr, unknown))}; the accepted keys are "
                f"{', '.join(map(repr, ROW_KEYS))} (sampling options such as "
                f"--temp apply to every row)"
            )
        prompt, seed = record.get("prompt"), record.get("seed")
        if not isinstance(prompt, str) or not prompt:
            raise ConfigError(
                f'--prompts {path}:{lineno}: needs a non-empty "prompt" string'
            )
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as exc:
            # a lone surrogate such as "\\ud800" from JSON
            raise ConfigError(
                f'--prompts {path}:{lineno}: "prompt" is not valid Unicode text '
                f"({exc.reason} at character {exc.start}); fix the line's escapes"
            ) from None
        if seed is not None and (
            isinstance(seed, bool)
            or not isinstance(seed, int)
            or not 0 <= seed <= ct.SEED_MAX
        ):
            raise ConfigError(
                f'--prompts {path}:{lineno}: "seed" must be a whole number in '
                f"[0, 2**64 - 1], not {seed!r}"
            )
        rows.append((prompt, seed))
    if not rows:
        raise ConfigError(f"--prompts {path}: no prompts in the file")
    return rows


def _encode(tok, text: str, raw: bool, template_kwargs: dict) -> list[int]:
    if raw:
        return tok.encode(text)
    return tok.apply_chat_template(
        [{"role": "user", "content": text}],
        add_generation_prompt=True,
        **template_kwargs,
    )


def _check_context(engine: Engine, prompt: list[int], where: str) -> None:
    limit = engine.family.text_config(engine.config).get("max_position_embeddings")
    if isinstance(limit, int) and len(prompt) >= limit:
        raise ConfigError(
            f"{where}: the prompt is {len(prompt)} tokens; the model's context is "
            f"{limit} (max_position_embeddings), leaving no room to generate; "
            f"shorten the prompt"
        )


def _summary(s: dict) -> str:
    label = " (emulated storage)" if s["emulated"] else ""
    return (
        f"decode {s['decode_tok_s']:.1f} tok/s, prefill {s['prefill_tok_s']:.1f} tok/s, "
        f"peak {s['peak_memory_gib']:.3f} GiB, {s['bytes_per_token'] / 2**20:.2f} MiB "
        f"read/token, blocked {s['blocked_load_ms_per_step']:.1f} ms/step{label}"
    )


def run(args: argparse.Namespace) -> int:
    if args.batch is not None and args.prompts is None:
        raise ConfigError("--batch needs --prompts FILE (one prompt per line)")
    if args.raw and args.chat_template_config:
        raise ConfigError(
            "--chat-template-config has no effect with --raw (no chat template is "
            "applied); drop one of them"
        )
    rows = read_prompts(args.prompts) if args.prompts is not None else None
    check_temperature(args.temp)
    check_filters(args.top_k, args.min_p)
    check_penalties(_penalties(args))
    engine = Engine.load(args.model, options_from_args(args))
    try:
        with wired_limit(engine.model):
            if rows is None:
                _run_one(engine, args)
            else:
                _run_batch(engine, args, rows)
    finally:
        engine.close()
    return 0


def _penalties(args) -> dict:
    given = {k: getattr(args, k) for k in ("presence_penalty", "repetition_penalty")}
    return {k: v for k, v in given.items() if v is not None}


def _sampling(args) -> dict:
    """The engine's sampling and stop arguments from the command line."""
    return dict(
        temperature=args.temp,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        penalties=_penalties(args),
        stop_words=args.stop,
    )


def _entry(result) -> dict:
    """A row as --json writes it: every token decoded, the answer and how it ended."""
    keys = ("tokens", "output", "text", "finish", "stop_word", "stats")
    return {k: getattr(result, k) for k in keys}


def _run_one(engine: Engine, args) -> None:
    tok = engine.tokenizer
    prompt = _encode(tok, args.prompt, args.raw, args.chat_template_config)
    _check_context(engine, prompt, "--prompt")
    result = engine.generate(prompt, max_tokens=args.max_tokens, **_sampling(args))
    print(result.text)
    s = result.stats
    print(f"-- {s['generated_tokens']} tokens ({result.finish}), {_summary(s)}")
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump({"prompt_tokens": prompt, **_entry(result)}, f, indent=1)


def _run_batch(engine: Engine, args, rows: list[tuple[str, int | None]]) -> None:
    tok = engine.tokenizer
    prompts = [
        _encode(tok, text, args.raw, args.chat_template_config) for text, _ in rows
    ]
    for row, prompt in enumerate(prompts, 1):
        _check_context(engine, prompt, f"--prompts {args.prompts} row {row}")
    seeds = [engine.options.seed if seed is None else seed for _, seed in rows]
    results = engine.generate_batch(
        prompts,
        max_tokens=args.max_tokens,
        batch_size=args.batch or 1,
        seeds=seeds,
        **_sampling(args),
    )
    entries = []
    for i, ((text, _), prompt, result) in enumerate(zip(rows, prompts, results)):
        print(f"[{i}] {result.text}")
        entries.append({"prompt": text, "prompt_tokens": prompt, **_entry(result)})
    s = results[0].stats
    label = " (emulated storage)" if s["emulated"] else ""
    union = s["mean_union_per_layer"]
    print(
        f"-- {len(rows)} rows, batch {s['batch_size']}: {s['batch_generated_tokens']} tokens, "
        f"aggregate decode {s['batch_decode_tok_s']:.1f} tok/s, "
        f"{s['bytes_per_token'] / 2**20:.2f} MiB read/token, "
        f"union {'-' if union is None else f'{union:.1f}'} experts/layer, "
        f"expert buffer {s['expert_buffer_mib']:.2f} MiB ({s['slots_per_layer']} slots/layer; "
        f"grown to batch x top-k when the budget holds fewer), "
        f"peak {s['peak_memory_gib']:.3f} GiB{label}"
    )
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(entries, f, indent=1)
