"""Hedge precision on held-out positions of a stage-1 store: how many of the next-token heads'
K experts (the routing) the context heads (the hedge) predicted, per consuming layer, and by the
hedge's confidence rank; beside both heads' recall of the teacher's executed experts.

    python overlap.py STORE_DIR CONTEXT_HEADS NEXT_TOKEN_HEADS OUT.json [--positions 6000]
"""

import argparse
import json
from pathlib import Path

import mlx.core as mx
import numpy as np

from edge0_eval.engine.heads_file import load_heads
from edge0_eval.training.data import split_documents
from edge0_eval.training.features import Batches, FeatureStore, positions

p = argparse.ArgumentParser()
p.add_argument("store")
p.add_argument("context")
p.add_argument("next_token")
p.add_argument("out")
p.add_argument("--positions", type=int, default=6000)
a = p.parse_args()

store = FeatureStore(Path(a.store)).open()
meta = store.meta
k, e = meta["top_k"], meta["num_experts"]
_, held = split_documents(len(meta["docs"]), 0.1, 0)
pos = positions(meta["docs"], held)[: a.positions]


def ranked(path, next_token):
    """(consumers, experts [O, B, E] by descending head logit, their softmax probabilities
    [O, B, E] in that order, target [O, B, K])."""
    heads = load_heads(path, hidden=meta["hidden"], num_experts=e, top_k=k, dtype=mx.float32)
    b = Batches(store, heads.owners, next_token=next_token)
    out, probs, targets = [], [], []
    for start in range(0, len(pos), 1000):
        batch = b.get(pos[start: start + 1000])
        logits = heads(b.features(batch))
        order = mx.argsort(-logits, axis=-1)
        out.append(np.array(order))
        probs.append(np.array(mx.take_along_axis(mx.softmax(logits, axis=-1), order, axis=-1)))
        targets.append(np.array(batch["target"]))
    return (b.consumers, np.concatenate(out, axis=1), np.concatenate(probs, axis=1),
            np.concatenate(targets, axis=1))


c_cons, c_rank, c_prob, target = ranked(a.context, False)
n_cons, n_rank, _, _ = ranked(a.next_token, True)
assert c_cons == n_cons, (c_cons, n_cons)


def member(ids, sets):
    """[O, B, m] ids in [O, B, K] sets -> bool [O, B, m]."""
    return (ids[..., :, None] == sets[..., None, :]).any(-1)


routed = n_rank[..., :k]
hedge_in_routed = member(c_rank[..., :k], routed)              # [O, B, K], by hedge rank
layers = []
for o, c in sorted(enumerate(c_cons), key=lambda x: x[1]):
    layers.append({
        "consumer": c,
        "hedge_precision": float(hedge_in_routed[o].mean()),
        "precision_by_hedge_rank": hedge_in_routed[o].mean(axis=0).round(4).tolist(),
        "context_recall": float(member(c_rank[o, :, :k], target[o]).mean()),
        "next_token_recall": float(member(routed[o], target[o]).mean()),
    })
# The hedge's K x O predictions of a position ordered by its softmax probability, across layers:
# the precision of the most confident fraction (what a read budget spent by confidence buys).
conf = np.swapaxes(c_prob[..., :k], 0, 1).reshape(len(pos), -1)          # [B, O*K]
hit = np.swapaxes(hedge_in_routed, 0, 1).reshape(len(pos), -1)
by_conf = np.take_along_axis(hit, np.argsort(-conf, axis=1), axis=1).mean(axis=0)
cum = np.cumsum(by_conf) / np.arange(1, by_conf.size + 1)
fractions = {f"{f:.2f}": float(cum[max(0, int(round(f * by_conf.size)) - 1)])
             for f in (0.1, 0.25, 0.5, 0.75, 1.0)}
summary = {
    "positions": int(len(pos)), "top_k": k, "num_experts": e,
    "chance_precision": k / e,
    "mean_hedge_precision": float(np.mean([l["hedge_precision"] for l in layers])),
    "mean_context_recall": float(np.mean([l["context_recall"] for l in layers])),
    "mean_next_token_recall": float(np.mean([l["next_token_recall"] for l in layers])),
    "precision_by_hedge_rank": hedge_in_routed.mean(axis=(0, 1)).round(4).tolist(),
    "precision_of_most_confident_fraction": fractions,
}
Path(a.out).write_text(json.dumps({"summary": summary, "layers": layers}, indent=1))
print(json.dumps(summary, indent=1))
for l in layers:
    print(f"layer {l['consumer']:2d}: hedge precision {l['hedge_precision']:.3f}, context recall "
          f"{l['context_recall']:.3f}, next-token recall {l['next_token_recall']:.3f}")
