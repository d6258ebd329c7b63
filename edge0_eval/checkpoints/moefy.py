"""Split a dense SwiGLU MLP into a shared part plus routed experts, and fit a linear router.

Pure numpy (offline linear algebra is faster here than MLX on the CPU). The split is exact: a dense
MLP `down(silu(gate x) * up x)` is a sum over its intermediate neurons, so any partition of the
neurons into a shared group and E equal expert groups reproduces it when every group is summed
with weight 1. What the routed model loses comes only from leaving unselected experts out.

- Shared part: the neurons with the largest mean contribution `|a_j| * ||down[:, j]||`.
- Experts: balanced k-means of the remaining neurons on their co-activation pattern over a corpus,
  so neurons that fire together land in the same expert.
- Router: ridge regression from the MLP input to each expert's log output norm (centred per
  token, since only the ranking matters); its top-k is the routing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Split:
    shared: np.ndarray  # [S] neuron ids of the always-on part
    experts: np.ndarray  # [E, size] neuron ids per expert


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def neuron_activations(x: np.ndarray, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """[T, I] intermediate activations of a SwiGLU MLP for inputs x [T, H]."""
    return silu(x @ gate.T) * (x @ up.T)


def split_neurons(
    acts: np.ndarray,
    down: np.ndarray,
    num_shared: int,
    num_experts: int,
    seed: int = 0,
    iters: int = 12,
) -> Split:
    """Partition the I neurons into `num_shared` shared ones and `num_experts` equal experts."""
    inter = acts.shape[1]
    routed_count = inter - num_shared
    if num_shared < 0 or num_experts < 1 or routed_count % num_experts:
        raise ValueError(
            f"{inter} neurons minus {num_shared} shared do not split into "
            f"{num_experts} equal experts"
        )
    contribution = np.abs(acts) * np.linalg.norm(down, axis=0)[None, :]
    order = np.argsort(-contribution.mean(axis=0), kind="stable")
    shared = np.sort(order[:num_shared])
    routed = np.sort(order[num_shared:])
    features = contribution[:, routed].T  # [R, T]: when each neuron matters
    features = features / (np.linalg.norm(features, axis=1, keepdims=True) + 1e-12)
    labels = balanced_kmeans(
        features, num_experts, routed_count // num_experts, seed, iters
    )
    experts = np.stack([np.sort(routed[labels == e]) for e in range(num_experts)])
    return Split(shared=shared, experts=experts)


def balanced_kmeans(
    features: np.ndarray, k: int, size: int, seed: int, iters: int
) -> np.ndarray:
    """Cosine k-means where every cluster gets exactly `size` members (greedy capacity fill)."""
    rng = np.random.default_rng(seed)
    centroids = features[rng.choice(len(features), k, replace=False)]
    labels = np.zeros(len(features), dtype=np.int64)
    for _ in range(iters):
        labels = _balanced_assign(features @ centroids.T, size)
        for c in range(k):
            mean = features[labels == c].mean(axis=0)
            centroids[c] = mean / (np.linalg.norm(mean) + 1e-12)
    return labels


def _balanced_assign(similarity: np.ndarray, size: int) -> np.ndarray:
    n, k = similarity.shape
    labels = np.full(n, -1, dtype=np.int64)
    counts = np.zeros(k, dtype=np.int64)
    for flat in np.argsort(-similarity, axis=None, kind="stable"):
        point, cluster = divmod(int(flat), k)
        if labels[point] < 0 and counts[cluster] < size:
            labels[point] = cluster
            counts[cluster] += 1
    return labels


def expert_output_norms(acts: np.ndarray, down: np.ndarray, split: Split) -> np.ndarray:
    """[T, E] norm of each expert's output: the oracle the router is fitted to rank."""
    return np.stack(
        [
            np.linalg.norm(acts[:, ids] @ down[:, ids].T, axis=1)
            for ids in split.experts
        ],
        axis=1,
    )


def fit_router(x: np.ndarray, norms: np.ndarray, ridge: float = 1e-2) -> np.ndarray:
    """[E, H] linear router whose logits rank experts like their output norms.

    Fitted to log norms (same ranking, without the heavy tail that lets a few tokens dominate
    a least-squares fit), centred per token since only the ranking within a token matters.
    """
    target = np.log(norms + 1e-6)
    target = target - target.mean(axis=1, keepdims=True)
    gram = x.T @ x
    gram += ridge * np.trace(gram) / gram.shape[0] * np.eye(gram.shape[0])
    return np.linalg.solve(gram, x.T @ target).T


def topk(scores: np.ndarray, k: int) -> np.ndarray:
    return np.argpartition(-scores, kth=k - 1, axis=-1)[..., :k]


def recall(chosen: np.ndarray, oracle: np.ndarray) -> float:
    """Mean |chosen ∩ oracle| / k over tokens."""
    hits = (chosen[:, :, None] == oracle[:, None, :]).any(axis=-1)
    return float(hits.mean())
