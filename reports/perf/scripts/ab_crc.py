"""Harness of reports/perf/2026-12-08-crc.md: the expert bundles' first-read checksum by
Python's zlib module (the engine's before that page), by zlib-ng (the same CRC-32, the
engine's since) and not at all, interleaved in one engine.

Imports the store's `crc32` (3b4bf80 and later; before it the store called `zlib.crc32`, and
the page's runs swapped that). Every run starts as a fresh process would: no bundle verified
yet; with `cold`, the expert file evicted from the page cache before it (real disk). argv:
model heads rounds tokens batch cold|warm [arms, comma-separated: zlib, zlib-ng, off; all
three when left out]
"""

import statistics
import sys
import zlib

import edge0_eval.engine.store as store
from edge0_eval import Engine, EngineOptions
from edge0_eval.bench import _prompt
from edge0_eval.formats.layout import crc32

path, heads = sys.argv[1], sys.argv[2]
rounds, tokens, batch = map(int, sys.argv[3:6])
cold = sys.argv[6] == "cold"
engine = Engine.load(
    path,
    EngineOptions(
        mode="prerouted", experts_per_token=4, slots_per_layer=8, prerouter_path=heads
    ),
)
arms = {"zlib": zlib.crc32, "zlib-ng": crc32, "off": None}
if len(sys.argv) > 7:
    arms = {a: arms[a] for a in sys.argv[7].split(",")}
prompts = [_prompt(engine.tokenizer, 8, r) for r in range(batch)]
ms, host, crc_ms, blocked = ({a: [] for a in arms} for _ in range(4))
toks = {}
names = list(arms)
for r in range(rounds):
    for arm in names[r % len(names) :] + names[: r % len(names)]:
        s = engine.store
        s.verify_crc = arms[arm] is not None
        store.crc32 = arms[arm] or crc32
        s._verified[:] = False
        if cold:
            s.evict_page_cache()
        s.reset_stats()
        h0 = engine.counters.host_seconds
        rows = engine.generate_batch(
            prompts, max_tokens=tokens, batch_size=batch, stop_token_ids=set()
        )
        st = rows[0].stats
        steps = st["batch_steps"]
        ms[arm].append(1000 * st["batch_decode_s"] / steps)
        host[arm].append(1000 * (engine.counters.host_seconds - h0) / steps)
        crc_ms[arm].append(1000 * s.stats.crc_seconds / steps)
        blocked[arm].append(st["blocked_load_ms_per_step"])
        toks.setdefault(arm, [row.tokens for row in rows])
        assert toks[arm] == [row.tokens for row in rows], (
            f"round {r}: {arm}'s tokens moved"
        )
        print(
            r,
            arm,
            f"{ms[arm][-1]:.1f} ms/step host {host[arm][-1]:.2f} "
            f"blocked {blocked[arm][-1]:.2f} crc {crc_ms[arm][-1]:.2f} ms/step "
            f"({s.stats.crc_bundles} bundles)",
            flush=True,
        )
later = slice(1, None)  # round 0: MLX's first-use costs
for arm in arms:
    print(
        f"{arm}: ms/step median {statistics.median(ms[arm][later]):.1f}, host "
        f"{statistics.median(host[arm][later]):.2f}, blocked "
        f"{statistics.median(blocked[arm][later]):.2f}, crc "
        f"{statistics.median(crc_ms[arm][later]):.2f}"
    )
for a, b in (("zlib-ng", "zlib"), ("off", "zlib")):
    if a in arms and b in arms:
        for name, xs in (("host", host), ("blocked", blocked)):
            d = [x - y for x, y in zip(xs[a][later], xs[b][later])]
            lower = sum(x < 0 for x in d)
            print(
                f"{name} {a} - {b}: paired median {statistics.median(d):+.2f} ms "
                f"(lower in {lower} of {len(d)})"
            )
for a, b in (("zlib-ng", "zlib"), ("off", "zlib"), ("zlib-ng", "off")):
    if a not in arms or b not in arms:
        continue
    d = [x / y for x, y in zip(ms[a][later], ms[b][later])]
    lower = sum(x < 1 for x in d)
    print(
        f"{a}/{b} per round {[round(x, 3) for x in d]}: median "
        f"{statistics.median(d):.4f}, lower in {lower} of {len(d)}"
    )
print("same tokens", len({str(t) for t in toks.values()}) == 1)
engine.close()
