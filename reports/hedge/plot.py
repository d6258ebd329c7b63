"""Decode ratio (prerouted / reactive, storage emulated at the balanced point, cold) against
the measured hedge precision, for the bench runs in bench/: hedged next-token heads on the 8-
and 40-layer 35B shapes, with context heads and next-token heads alone as reference lines.

    python reports/hedge/plot.py        # writes reports/hedge/ratio_vs_precision.png
"""

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).parent


def run(name):
    report = json.loads((HERE / "bench" / f"{name}.json").read_text())
    pre = [r for r in report["runs"] if r["arm"] == "prerouted"]
    precision = [r["hedge_precision"] for r in pre if r.get("hedge_precision") is not None]
    return (sum(precision) / len(precision) if precision else None,
            report["targets"]["decode_prerouted_over_reactive"])


fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
shapes = (("8-layer 35B shape (2 rounds)", "w8", ["w8_h_s0", "w8_h_s0.1", "w8_h_s0.25", "w8_h_s0.5"],
           ["w8c_h_s0", "w8c_h_s0.1", "w8c_h_s0.25", "w8c_h_s0.5"], "w8_nt"),
          ("40-layer 35B shape (1 round; x: 2 rounds)", "w40",
           ["w40_h16_s0", "w40_h16_s0.1", "w40_h16_s0.25"], [], "w40_nt_s0.1"))
for ax, (title, prefix, layer_runs, conf_runs, nt) in zip(axes, shapes):
    pts = sorted(run(n) for n in layer_runs)
    ax.plot([p for p, _ in pts], [r for _, r in pts], "o-", label="hedged, reads in layer order")
    if conf_runs:
        pts = sorted(run(n) for n in conf_runs)
        ax.plot([p for p, _ in pts], [r for _, r in pts], "s--", color="gray",
                label="hedged, most confident first (reverted)")
    if prefix == "w40":
        p, r = run("w40x2_h16_s0.1")
        ax.plot([p], [r], "x", color="C0", markersize=9)
    ax.axhline(run(f"{prefix}_ctx")[1], color="C2", ls=":", label="context heads")
    if (HERE / "bench" / f"{nt}.json").exists():
        ax.axhline(run(nt)[1], color="C3", ls=":", label="next-token heads, no hedge")
    ax.axhline(1.9, color="k", lw=0.8, label="target 1.9x")
    ax.axvline(0.753, color="C1", lw=0.8, ls="--",
               label="testbed, trained hedge, online (K/E = 0.5)")
    ax.set_title(title)
    ax.set_xlabel("hedge precision (routed experts the hedge staged, measured)")
    ax.grid(alpha=0.3)
axes[0].set_ylabel("decode tok/s, prerouted / reactive")
for ax in axes:
    ax.legend(fontsize=7, loc="lower right")
fig.suptitle("Hedged staging at the balanced point (storage EMULATED, cold; untrained heads, "
             "precision set by init-prerouter --embedding-scale)", fontsize=9)
fig.tight_layout()
fig.savefig(HERE / "ratio_vs_precision.png", dpi=110)
print(f"wrote {HERE / 'ratio_vs_precision.png'}")
