"""Paired comparison of arms scored by score_arm.py: per arm the mean of each metric, and per
pair of arms the mean per-item difference with its 95% interval (the fidelity report's rule,
evaluation/fidelity_report._paired).

    python compare_arms.py NAME=ARM.json ... > comparison.json   (pairs: each earlier NAME minus each later one)
"""

import argparse
import json

from edge0_eval.evaluation.fidelity_report import _paired

METRICS = {"kl": 1.0, "agreement": 100.0, "nll": 1.0, "greedy_match": 1.0}

p = argparse.ArgumentParser()
p.add_argument("arms", nargs="+")
a = p.parse_args()
arms = {}
for spec in a.arms:
    name, path = spec.split("=", 1)
    d = json.load(open(path))
    arms[name] = {"file": path, "prerouted_layers": d["prerouted_layers"], "seconds": d["seconds"],
                  "rows": {r["id"]: r for r in d["rows"]}}
names = list(arms)
ids = sorted(set.intersection(*(set(v["rows"]) for v in arms.values())))
out = {"items": len(ids), "positions": sum(arms[names[0]]["rows"][i]["positions"] for i in ids),
       "arms": {}, "pairs": {}}
for name, arm in arms.items():
    out["arms"][name] = {"prerouted_layers": arm["prerouted_layers"], "seconds": arm["seconds"]}
    for m, scale in METRICS.items():
        out["arms"][name][m] = sum(arm["rows"][i][m] * scale for i in ids) / len(ids)
for k, x in enumerate(names):          # every earlier arm minus every later one
    for y in names[k + 1:]:
        pair = {}
        for m, scale in METRICS.items():
            for subset, keep in (("all", ids),) + tuple(
                    (s, [i for i in ids if arms[x]["rows"][i]["source"] == s])
                    for s in sorted({arms[x]["rows"][i]["source"] for i in ids})):
                mean, hw = _paired([(arms[x]["rows"][i][m] - arms[y]["rows"][i][m]) * scale
                                    for i in keep])
                pair.setdefault(subset, {})[m] = {"delta": mean, "half_width": hw}
        out["pairs"][f"{x} - {y}"] = pair
print(json.dumps(out, indent=1))
