"""Scratch harness of reports/perf/2026-12-05-b8-host-time.md, as that page ran it.

It imports the engine's internals of its day: run it in a checkout of commit ec6fb37
(the commit that put it in the report), not against the current package.
"""

import importlib
import statistics
import sys

from edge0_eval.bench import _prompt
from edge0_eval.engine.engine import Engine
from edge0_eval.engine.options import EngineOptions

path, heads, b, tokens, rounds = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
variant = importlib.import_module(sys.argv[6])
opts = EngineOptions(
    mode="prerouted", experts_per_token=4, slots_per_layer=8, prerouter_path=heads
)
e = Engine.load(path, opts)
prompts, c = [_prompt(e.tokenizer, 8, r) for r in range(b)], e.counters
host, toks = {"old": [], "new": []}, {}
for r in range(rounds):
    for arm in ("old", "new") if r % 2 == 0 else ("new", "old"):
        variant.apply() if arm == "new" else variant.revert()
        h0 = c.host_seconds
        rows = e.generate_batch(
            prompts, max_tokens=tokens, batch_size=b, stop_token_ids=set()
        )
        host[arm].append(1000 * (c.host_seconds - h0) / rows[0].stats["batch_steps"])
        toks.setdefault(arm, [row.tokens for row in rows])
for arm, v in host.items():
    print(arm, statistics.median(v), min(v), max(v))
print("paired", [n - o for o, n in zip(host["old"], host["new"])])
print("same tokens", toks["old"] == toks["new"])
e.close()
