"""Recall of mixed heads for every split m from two stage-1 reports on the same store, and the
plot of recall (and the scored arms' KL) against m.

Heads train independently, so a split m <= M takes the first m consumers' rows from the
`--context-layers M` report and the rest from the `--next-token` report (assemble.py builds the
matching files). Usage:
    frontier.py MIXED_REPORT NT_REPORT OUT_JSON OUT_PNG [COMPARISON_JSON m=ARM ...]
with the scored arms' KL taken from compare_arms.py's output, arm ARM plotted at split m.
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

mixed, nt = (json.load(open(p)) for p in sys.argv[1:3])
out_json, out_png = sys.argv[3:5]
arms = {}
if len(sys.argv) > 5:
    comparison = json.load(open(sys.argv[5]))
    specs = [a.split("=", 1) for a in sys.argv[6:]]
    base = specs[0][1]           # error bars: the paired 95% interval of (first arm - arm)
    arms = {int(k): comparison["arms"][v] | {"arm": v, "half_width": 0.0 if v == base else
                                             comparison["pairs"][f"{base} - {v}"]["all"]["kl"]
                                             ["half_width"]}
            for k, v in specs}
order = sorted(range(len(nt["layers"])), key=lambda i: nt["layers"][i]["consumer"])
context = mixed["context_consumers"]
assert [r["consumer"] for r in mixed["layers"]] == [r["consumer"] for r in nt["layers"]]
rows = []
for m in range(len(context) + 1):
    first = {nt["layers"][i]["consumer"] for i in order[:m]}
    per = [(mr if r["consumer"] in first else nr)["recall_heads"]
           for mr, nr, r in zip(mixed["layers"], nt["layers"], nt["layers"])]
    beats = all((mr if r["consumer"] in first else nr)["beats_baselines"]
                for mr, nr, r in zip(mixed["layers"], nt["layers"], nt["layers"]))
    rows.append({"context_layers": m, "context_consumers": sorted(first),
                 "mean_recall": sum(per) / len(per), "min_recall": min(per),
                 "all_layers_beat_baselines": beats})
layers = [{"consumer": r["consumer"], "context": mr["recall_heads"], "next_token": r["recall_heads"],
           "best_context_baseline": max(mr["recall_prev_token"], mr["recall_next_router"])}
          for mr, r in zip(mixed["layers"], nt["layers"])]
json.dump({"frontier": rows, "layers": sorted(layers, key=lambda x: x["consumer"]),
           "arms": {str(k): v for k, v in sorted(arms.items())},
           "sources": {"mixed": mixed["heads"].rsplit("/", 1)[-1],
                       "next_token": nt["heads"].rsplit("/", 1)[-1]}},
          open(out_json, "w"), indent=1)

fig, ax = plt.subplots(1, 2 if arms else 1, figsize=(11 if arms else 6, 4), squeeze=False)
a = ax[0][0]
a.plot([r["context_layers"] for r in rows], [r["mean_recall"] for r in rows], "o-", ms=3)
a.axhline(0.85, color="grey", ls="--", lw=1)
a.text(0.2, 0.851, "issue 18 target 0.85", fontsize=8, color="grey", va="bottom")
n = len(nt["layers"])
for frac, label in ((10 / 40, "35B 40 layers: 10 of 40"), (5 / 8, "35B 8 layers: 5 of 8")):
    if frac * n <= len(context):
        a.axvline(frac * n, color="tab:red", lw=0.8)
        a.text(frac * n + 0.2, a.get_ylim()[0] + 0.002, label, fontsize=7, color="tab:red",
               rotation=90, va="bottom")
a.set_xlabel(f"context layers m (the first m of {n} consumers)")
a.set_ylabel("mean held-out top-K recall")
a.set_title("Mixed heads on the testbed: recall vs split")
if arms:
    b = ax[0][1]
    ms = sorted(arms)
    b.errorbar(ms, [arms[m]["kl"] for m in ms], yerr=[arms[m]["half_width"] for m in ms],
               fmt="o-", ms=4, capsize=3)
    for m in ms:
        b.annotate(arms[m]["arm"], (m, arms[m]["kl"]), fontsize=7, xytext=(3, 3),
                   textcoords="offset points")
    b.set_xlabel(f"context layers m (0: next-token heads; {n}: context heads)")
    b.set_ylabel("KL(teacher || student), nats/position")
    b.set_title(f"KL of the scored splits (20 prompts; bars: paired 95% to {base})",
                fontsize=10)
fig.tight_layout()
fig.savefig(out_png, dpi=120)
print(json.dumps(rows, indent=0))
