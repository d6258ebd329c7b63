"""Harness of reports/perf/2026-12-07-one-sync.md: solo decode on a tiny model with two or
more engines, rounds rotated in one process (warm: a tiny model's experts stay in the page
cache).

argv: model heads rounds tokens [arm=package ...]; the arms default to base=edge0_base
new=edge0_eval. An older engine is that commit's edge0_eval copied beside this file under
another package name (as for ab_house.py: base is 6a4e93e as edge0_base). Every later arm is
compared with every earlier one, round by round. The first 5 rounds are warm-up.
"""

import importlib
import math
import statistics
import sys
import time

path, heads = sys.argv[1], sys.argv[2]
rounds, tokens = map(int, sys.argv[3:5])
packages = dict(
    a.split("=") for a in sys.argv[5:] or ["base=edge0_base", "new=edge0_eval"]
)
kw = dict(
    mode="prerouted", experts_per_token=4, slots_per_layer=8, prerouter_path=heads
)
engines = {}
for arm, package in packages.items():
    engine = importlib.import_module(package + ".engine.engine").Engine
    options = importlib.import_module(package + ".engine.options").EngineOptions
    engines[arm] = engine.load(path, options(**kw))
arms = list(engines)
bench = importlib.import_module(packages[arms[0]] + ".bench")
prompt = bench._prompt(engines[arms[0]].tokenizer, 8, 0)
ms, wall, toks = {a: [] for a in arms}, {a: [] for a in arms}, {}
for r in range(rounds):
    for arm in arms[r % len(arms) :] + arms[: r % len(arms)]:
        t0 = time.perf_counter()
        rows = engines[arm].generate_batch(
            [prompt], max_tokens=tokens, batch_size=1, stop_token_ids=set()
        )
        wall[arm].append(time.perf_counter() - t0)
        s = rows[0].stats
        ms[arm].append(1000 * s["batch_decode_s"] / s["batch_steps"])
        toks.setdefault(arm, rows[0].tokens)
        assert toks[arm] == rows[0].tokens
print("same tokens", all(toks[a] == toks[arms[0]] for a in arms))
for name, m in (("decode ms/step", ms), ("generate wall s", wall)):
    print(name, "medians", {a: round(statistics.median(m[a][5:]), 4) for a in arms})
    for i, b in enumerate(arms):
        for a in arms[i + 1 :]:
            d = [x / y for y, x in zip(m[b][5:], m[a][5:])]
            print(
                "  paired %s/%s: median %.4f geomean %.4f lower in %d of %d"
                % (
                    a,
                    b,
                    statistics.median(d),
                    math.exp(statistics.mean(map(math.log, d))),
                    sum(x < 1 for x in d),
                    len(d),
                )
            )
for engine in engines.values():
    engine.close()  # the I/O threads end before the interpreter does
