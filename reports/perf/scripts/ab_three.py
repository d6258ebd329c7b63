"""Harness of reports/perf/2026-12-07-one-sync.md's step-ledger table: base (6a4e93e), head
(the commit before a change) and new (the checkout) solo decode on a tiny model, rounds
rotated in one process (warm: a tiny model's experts stay in the page cache).

base and head are those commits' edge0_eval copied beside this file as the packages
edge0_base and edge0_head (as for ab_house.py). argv: model heads rounds tokens. The first 5
rounds are warm-up.
"""

import math
import statistics
import sys
import time

import edge0_base.engine.engine as be
import edge0_base.engine.options as bo
import edge0_head.engine.engine as he
import edge0_head.engine.options as ho
from edge0_base.bench import _prompt

from edge0_eval import Engine, EngineOptions

path, heads = sys.argv[1], sys.argv[2]
rounds, tokens = map(int, sys.argv[3:5])
kw = dict(
    mode="prerouted", experts_per_token=4, slots_per_layer=8, prerouter_path=heads
)
engines = {
    "base": be.Engine.load(path, bo.EngineOptions(**kw)),
    "head": he.Engine.load(path, ho.EngineOptions(**kw)),
    "new": Engine.load(path, EngineOptions(**kw)),
}
arms = list(engines)
prompt = _prompt(engines["base"].tokenizer, 8, 0)
ms, wall, toks = {a: [] for a in arms}, {a: [] for a in arms}, {}
for r in range(rounds):
    for arm in arms[r % 3 :] + arms[: r % 3]:
        t0 = time.perf_counter()
        rows = engines[arm].generate_batch(
            [prompt], max_tokens=tokens, batch_size=1, stop_token_ids=set()
        )
        wall[arm].append(time.perf_counter() - t0)
        s = rows[0].stats
        ms[arm].append(1000 * s["batch_decode_s"] / s["batch_steps"])
        toks.setdefault(arm, rows[0].tokens)
        assert toks[arm] == rows[0].tokens
print("same tokens", toks["base"] == toks["head"] == toks["new"])


def paired(m: dict, a: str, b: str) -> str:
    d = [x / y for y, x in zip(m[b][5:], m[a][5:])]
    return "%s/%s median %.4f geomean %.4f lower in %d of %d" % (
        a,
        b,
        statistics.median(d),
        math.exp(statistics.mean(map(math.log, d))),
        sum(x < 1 for x in d),
        len(d),
    )


for name, m in (("decode ms/step", ms), ("generate wall s", wall)):
    print(name, {a: round(statistics.median(m[a][5:]), 4) for a in arms})
    for a, b in (("head", "base"), ("new", "base"), ("new", "head")):
        print("  " + paired(m, a, b))
