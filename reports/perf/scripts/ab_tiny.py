"""Harness of reports/perf/2026-12-07-one-sync.md: base (6a4e93e) and changed solo decode on a
tiny model, interleaved in one process (warm: a tiny model's experts stay in the page cache).

The base is commit 6a4e93e's edge0_eval copied beside this file as the package edge0_base
(as for ab_house.py). argv: model heads rounds tokens. The first 5 rounds are warm-up.
"""

import math
import statistics
import sys

import edge0_base.engine.engine as be
import edge0_base.engine.options as bo
from edge0_base.bench import _prompt

from edge0_eval import Engine, EngineOptions

path, heads = sys.argv[1], sys.argv[2]
rounds, tokens = map(int, sys.argv[3:5])
kw = dict(
    mode="prerouted", experts_per_token=4, slots_per_layer=8, prerouter_path=heads
)
engines = {
    "base": be.Engine.load(path, bo.EngineOptions(**kw)),
    "new": Engine.load(path, EngineOptions(**kw)),
}
prompt = _prompt(engines["base"].tokenizer, 8, 0)
ms, toks = {"base": [], "new": []}, {}
for r in range(rounds):
    for arm in ("base", "new") if r % 2 == 0 else ("new", "base"):
        rows = engines[arm].generate_batch(
            [prompt], max_tokens=tokens, batch_size=1, stop_token_ids=set()
        )
        s = rows[0].stats
        ms[arm].append(1000 * s["batch_decode_s"] / s["batch_steps"])
        toks.setdefault(arm, rows[0].tokens)
        assert toks[arm] == rows[0].tokens
d = [n / b for b, n in zip(ms["base"][5:], ms["new"][5:])]
print("same tokens", toks["base"] == toks["new"])
print(
    "median ms/step base %.3f new %.3f"
    % (statistics.median(ms["base"][5:]), statistics.median(ms["new"][5:]))
)
print(
    "paired new/base: median %.4f geomean %.4f lower in %d of %d"
    % (
        statistics.median(d),
        math.exp(statistics.mean(map(math.log, d))),
        sum(x < 1 for x in d),
        len(d),
    )
)
