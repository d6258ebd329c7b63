"""`edge0-eval generate MODEL --prompt TEXT`: generate with the streaming engine."""

from __future__ import annotations

import argparse
import json

from edge0_eval import cli_types as ct
from edge0_eval.cli_options import add_engine_arguments, options_from_args
from edge0_eval.engine.engine import Engine


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="converted model directory (edge0-eval convert)")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--raw", action="store_true", help="do not apply the chat template")
    parser.add_argument("--max-tokens", type=ct.positive_int, default=64)
    parser.add_argument("--temp", type=ct.nonneg_float, default=0.0)
    parser.add_argument("--top-p", type=ct.float_range(0.0, 1.0, low_open=True), default=1.0)
    parser.add_argument("--json", dest="json_path", default=None, type=ct.output_file,
                        help="write generated token ids, text and stats here")
    add_engine_arguments(parser)


def run(args: argparse.Namespace) -> int:
    engine = Engine.load(args.model, options_from_args(args))
    try:
        tok = engine.tokenizer
        if args.raw:
            prompt = tok.encode(args.prompt)
        else:
            prompt = tok.apply_chat_template([{"role": "user", "content": args.prompt}],
                                             add_generation_prompt=True)
        result = engine.generate(prompt, max_tokens=args.max_tokens, temperature=args.temp,
                                 top_p=args.top_p)
        text = tok.decode(result.tokens)
        print(text)
        s = result.stats
        label = " (emulated storage)" if s["emulated"] else ""
        print(f"-- {s['generated_tokens']} tokens, decode {s['decode_tok_s']:.1f} tok/s, "
              f"prefill {s['prefill_tok_s']:.1f} tok/s, peak {s['peak_memory_gib']:.3f} GiB, "
              f"{s['bytes_per_token'] / 2**20:.2f} MiB read/token, "
              f"blocked {s['blocked_load_ms_per_step']:.1f} ms/step{label}")
        if args.json_path:
            with open(args.json_path, "w") as f:
                json.dump({"prompt_tokens": prompt, "tokens": result.tokens, "text": text,
                           "stats": s}, f, indent=1)
    finally:
        engine.close()
    return 0
