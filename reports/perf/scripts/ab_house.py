"""Harness of reports/perf/2026-12-07-house.md: base (6a4e93e) and changed decode, interleaved
in one process, the page cache evicted before every run.

The base is commit 6a4e93e's edge0_eval copied beside this file as the package edge0_base:
`git archive 6a4e93e edge0_eval | tar -x && mv edge0_eval edge0_base`, then every
`edge0_eval` inside it renamed to `edge0_base`. argv: model heads rounds tokens batch
"""

import statistics
import sys

import edge0_base.engine.engine as be
import edge0_base.engine.options as bo
from edge0_base.bench import _prompt as base_prompt

from edge0_eval import Engine, EngineOptions

path, heads = sys.argv[1], sys.argv[2]
rounds, tokens, batch = map(int, sys.argv[3:6])
kw = dict(
    mode="prerouted", experts_per_token=4, slots_per_layer=8, prerouter_path=heads
)
engines = {
    "base": be.Engine.load(path, bo.EngineOptions(**kw)),
    "new": Engine.load(path, EngineOptions(**kw)),
}
prompts = [base_prompt(engines["base"].tokenizer, 8, r) for r in range(batch)]
ms, host, toks = {"base": [], "new": []}, {"base": [], "new": []}, {}
for r in range(rounds):
    for arm in ("base", "new") if r % 2 == 0 else ("new", "base"):
        e = engines[arm]
        e.store.evict_page_cache()
        h0 = e.counters.host_seconds
        rows = e.generate_batch(
            prompts, max_tokens=tokens, batch_size=batch, stop_token_ids=set()
        )
        s = rows[0].stats
        steps = s.get("batch_steps") or tokens
        ms[arm].append(
            1000 * s["batch_decode_s"] / steps
            if "batch_decode_s" in s
            else 1000 / s["decode_tok_s"]
        )
        host[arm].append(1000 * (e.counters.host_seconds - h0) / steps)
        toks.setdefault(arm, [row.tokens for row in rows])
        print(r, arm, f"{ms[arm][-1]:.1f} ms/step host {host[arm][-1]:.2f}", flush=True)
later = slice(1, None)
for arm in ms:
    print(
        arm,
        "ms/step median",
        statistics.median(ms[arm][later]),
        "host",
        statistics.median(host[arm][later]),
    )
d = [n / b for b, n in zip(ms["base"][later], ms["new"][later])]
print(
    "new/base step ratio per round",
    [round(x, 3) for x in d],
    "median",
    statistics.median(d),
)
print("same tokens", toks["base"] == toks["new"])
for e in engines.values():
    e.close()
