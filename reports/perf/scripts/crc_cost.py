"""Scratch harness of reports/perf/2026-12-01-expert-crc.md, as that page ran it.

It imports the engine's internals of its day: run it in a checkout of commit 2096461
(the commit that put it in the report), not against the current package.
"""

import json
import sys

import numpy as np

from edge0_eval.engine.engine import Engine, EngineOptions

model, warm_tokens, cold_tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
engines = {
    v: Engine.load(model, EngineOptions(mode="reactive", top_k=4, verify_crc=v))
    for v in (True, False)
}
prompt = [int(t) for t in np.random.default_rng(0).integers(10, 1000, 32)]


def one(verify, cache, n):
    e = engines[verify]
    e.store._verified[:] = False  # a fresh process: nothing verified yet
    if cache == "cold":
        e.store.evict_page_cache()
    else:
        with open(
            e.store.path, "rb"
        ) as f:  # warm: the whole expert file in the page cache
            while f.read(64 << 20):
                pass
    e.store.reset_stats()
    s = e.generate(prompt, max_tokens=n, stop_token_ids=set()).stats
    out = {
        "verify_crc": verify,
        "cache": cache,
        "tokens": n,
        "decode_tok_s": s["decode_tok_s"],
        "decode_s": s["decode_s"],
        "crc_bundles": e.store.stats.crc_bundles,
        "crc_s": e.store.stats.crc_seconds,
        "reads": e.store.stats.reads,
    }
    print(json.dumps(out), flush=True)
    return out


for e in engines.values():  # MLX warm-up (first-call costs), not measured
    e.generate(prompt[:8], max_tokens=4, stop_token_ids=set())
runs = []
order = (
    [v == "on" for v in sys.argv[5].split(",")] if len(sys.argv) > 5 else [True, False]
)
if cold_tokens:
    for verify in (True, False, False, True):
        runs.append(one(verify, "cold", cold_tokens))
for verify in order:
    runs.append(one(verify, "warm", warm_tokens))
json.dump(runs, open(sys.argv[4], "w"), indent=1)
