"""What routing that prefers the hedge's experts would cost: on held-out positions of a stage-1
store, the next-token heads' top-K after adding `beta` to the log-probability of every expert
the context heads (the hedge) predicted. Recall of the teacher's executed experts against the
share of the routed set the hedge had staged. beta = 0 is the next-token heads' routing; a
large beta routes with the hedge itself. (Not built: explored to see whether it would pay.)

    python preferred_routing.py STORE_DIR CONTEXT_HEADS NEXT_TOKEN_HEADS [--positions 6000]
"""

import argparse
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
p.add_argument("--positions", type=int, default=6000)
a = p.parse_args()

store = FeatureStore(Path(a.store)).open()
meta = store.meta
k, e = meta["top_k"], meta["num_experts"]
_, held = split_documents(len(meta["docs"]), 0.1, 0)
pos = positions(meta["docs"], held)[: a.positions]


def log_probs(path, next_token):
    """(log-softmax of the heads [O, B, E], target [O, B, K])."""
    heads = load_heads(path, hidden=meta["hidden"], num_experts=e, top_k=k, dtype=mx.float32)
    b = Batches(store, heads.owners, next_token=next_token)
    out, targets = [], []
    for start in range(0, len(pos), 1000):
        batch = b.get(pos[start: start + 1000])
        z = heads(b.features(batch))
        out.append(np.array(z - mx.logsumexp(z, axis=-1, keepdims=True)))
        targets.append(np.array(batch["target"]))
    return np.concatenate(out, axis=1), np.concatenate(targets, axis=1)


context, target = log_probs(a.context, False)
next_token, _ = log_probs(a.next_token, True)
hedged = np.zeros_like(context, dtype=bool)
np.put_along_axis(hedged, np.argsort(-context, -1)[..., :k], True, -1)
executed = np.zeros_like(context, dtype=bool)
np.put_along_axis(executed, target, True, -1)
for beta in (0, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2, 100):
    routed = np.argsort(-(next_token + beta * hedged), -1)[..., :k]
    print(f"beta {beta:5}: recall {np.take_along_axis(executed, routed, -1).mean():.4f}, "
          f"routed experts the hedge staged {np.take_along_axis(hedged, routed, -1).mean():.4f}")
