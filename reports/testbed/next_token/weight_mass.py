"""Why head weights hurt: the mass a planned set carries under the heads' softmax versus under
the consuming layer's router (qwen2_moe does not renormalise its top-k weights, so this mass
scales the routed experts' output). Held-out positions of a stage-1 store.

    python weight_mass.py STORE_DIR CONTEXT_HEADS NEXT_TOKEN_HEADS [--positions 3000]
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
p.add_argument("--positions", type=int, default=3000)
a = p.parse_args()

store = FeatureStore(Path(a.store)).open()
meta = store.meta
k, e = meta["top_k"], meta["num_experts"]
_, held = split_documents(len(meta["docs"]), 0.1, 0)
pos = positions(meta["docs"], held)[: a.positions]
routers = store.routers()
pair = {n: i for i, n in enumerate(meta["pairs"])}
for name, path, nt in (("context heads", a.context, False), ("next-token heads", a.next_token, True)):
    heads = load_heads(path, hidden=meta["hidden"], num_experts=e, top_k=k, dtype=mx.float32)
    b = Batches(store, heads.owners, next_token=nt)
    probs = mx.softmax(heads(b.features(b.get(pos))), axis=-1)
    mass = mx.sort(probs, axis=-1)[..., -k:].sum(axis=-1).mean(axis=-1)
    print(f"{name}: top-{k} softmax mass, mean over heads {float(mass.mean()):.3f} "
          f"(range {float(mass.min()):.3f}-{float(mass.max()):.3f})")
masses = []
for c in sorted(set(heads.config.consumers)):
    h = mx.array(np.asarray(store.h[pos + 1, pair[c]]).astype(np.float32))  # layer c's input, t+1
    probs = mx.softmax(h @ routers[f"router.{c}"].T, axis=-1)
    masses.append(float(mx.sort(probs, axis=-1)[..., -k:].sum(axis=-1).mean()))
print(f"routers: top-{k} mass of the true routing, mean over layers {np.mean(masses):.3f} "
      f"(range {min(masses):.3f}-{max(masses):.3f})")
