"""Harness of reports/perf/2026-12-07-one-sync.md and 2026-12-07-house.md: prerouted decode
with two or more engines, rounds rotated in one process, warm (nothing evicts the page cache).

argv: model heads rounds tokens [arm=package ...] [batch=B] [warmup=N]; the arms default to
base=edge0_base new=edge0_eval, batch to 1 (one row of 8 prompt tokens), warmup to 5 rounds
left out of the figures. An older engine is that commit's edge0_eval copied beside this file
under another package name (as for ab_house.py: base is 6a4e93e as edge0_base). Every later
arm is compared with every earlier one, round by round: decode ms a step, the generate's wall
time, and the host figures a step (the bench's host_ms and host_cpu_ms).
"""

import importlib
import math
import statistics
import sys
import time

path, heads = sys.argv[1], sys.argv[2]
rounds, tokens = map(int, sys.argv[3:5])
args = dict(a.split("=") for a in sys.argv[5:])
batch, warmup = int(args.pop("batch", 1)), int(args.pop("warmup", 5))
packages = args or {"base": "edge0_base", "new": "edge0_eval"}
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
prompts = [bench._prompt(engines[arms[0]].tokenizer, 8, r) for r in range(batch)]
figures = ("decode ms/step", "generate wall s", "host ms/step", "host cpu ms/step")
m, toks = {f: {a: [] for a in arms} for f in figures}, {}
for r in range(rounds):
    for arm in arms[r % len(arms) :] + arms[: r % len(arms)]:
        c = engines[arm].counters
        t0, host, cpu = time.perf_counter(), c.host_seconds, c.host_cpu_seconds
        rows = engines[arm].generate_batch(
            prompts, max_tokens=tokens, batch_size=batch, stop_token_ids=set()
        )
        wall = time.perf_counter() - t0
        s = rows[0].stats
        steps = s["batch_steps"]
        m["decode ms/step"][arm].append(1000 * s["batch_decode_s"] / steps)
        m["generate wall s"][arm].append(wall)
        m["host ms/step"][arm].append(1000 * (c.host_seconds - host) / steps)
        m["host cpu ms/step"][arm].append(1000 * (c.host_cpu_seconds - cpu) / steps)
        toks.setdefault(arm, [row.tokens for row in rows])
        assert toks[arm] == [row.tokens for row in rows]
print("same tokens", all(toks[a] == toks[arms[0]] for a in arms))
for name in figures:
    kept = {a: m[name][a][warmup:] for a in arms}
    print(name, "medians", {a: round(statistics.median(kept[a]), 4) for a in arms})
    for i, b in enumerate(arms):
        for a in arms[i + 1 :]:
            d = [x / y for y, x in zip(kept[b], kept[a])]
            diff = [x - y for y, x in zip(kept[b], kept[a])]
            print(
                "  paired %s/%s: median %.4f geomean %.4f difference %+.4f lower in %d of %d"
                % (
                    a,
                    b,
                    statistics.median(d),
                    math.exp(statistics.mean(map(math.log, d))),
                    statistics.median(diff),
                    sum(x < 1 for x in d),
                    len(d),
                )
            )
for engine in engines.values():
    engine.close()  # the I/O threads end before the interpreter does
