"""Expert selection: the only code that turns router scores into (expert ids, weights).

The streaming blocks (moe_blocks.py) route with their family's rule through `top_k` / `combine`;
the prerouter heads' logits go through a `RoutingRule` (each block's `rule`), the same rule
detached from the module so that it can be stacked over consumer layers and applied to all heads
in one computation.

The order of the k selected ids is the order of the weighted sum, so each caller keeps the order
mlx-lm's block uses ("last": qwen3's argpartition(probs)[-k:]; "first": argpartition(-sel)[:k]),
which keeps outputs bit-identical to mlx-lm.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

# mlx-lm's Gate adds this to the normaliser; a no-op for any real sum of k probabilities.
NORM_EPS = 1e-20


def top_k(sel: mx.array, k: int, order: str = "first") -> mx.array:
    """Ids [..., k] of the k largest entries of `sel` [..., E] (no gradient through the choice)."""
    if order == "last":
        return mx.stop_gradient(mx.argpartition(sel, kth=-k, axis=-1)[..., -k:])
    return mx.stop_gradient(mx.argpartition(-sel, kth=k - 1, axis=-1)[..., :k])


def combine(
    scores: mx.array,
    inds: mx.array,
    *,
    normalize: bool,
    eps: float = 0.0,
    scaling: float | None = None,
) -> mx.array:
    """Combination weights [..., k] of `inds` from `scores` [..., E]: optionally normalised over
    the k (with `eps` added to the sum), optionally times `scaling`."""
    weights = mx.take_along_axis(scores, inds, axis=-1)
    if normalize:
        total = weights.sum(axis=-1, keepdims=True)
        weights = weights / (total + eps if eps else total)
    return weights if scaling is None else weights * scaling


def limit_groups(sel: mx.array, n_group: int, topk_group: int) -> mx.array:
    """Group-limited routing (mlx-lm's Gate): keep the `topk_group` best of `n_group` groups
    (a group's score: the sum of its two best entries); the others' entries become -inf."""
    n_drop = n_group - topk_group
    if n_drop <= 0:
        return sel
    sel = mx.unflatten(sel, axis=-1, shape=(n_group, -1))
    group_scores = mx.topk(sel, 2, axis=-1).sum(axis=-1, keepdims=True)
    drop = mx.argpartition(group_scores, kth=n_drop - 1, axis=-2)[..., :n_drop, :]
    sel = mx.put_along_axis(
        sel, mx.stop_gradient(drop), mx.array(-mx.inf, sel.dtype), axis=-2
    )
    return mx.flatten(sel, -2, -1)


@dataclass
class RoutingRule:
    """A family's selection rule, detached from the module (stackable over consumer layers)."""

    score: str = "softmax"  # "softmax" | "sigmoid"
    norm_topk_prob: bool = True
    expert_bias: mx.array | None = (
        None  # [E], or stacked [O, 1, E]; steers selection only
    )
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0

    def to_json(self) -> dict:
        return {
            "score": self.score,
            "norm_topk_prob": self.norm_topk_prob,
            "n_group": self.n_group,
            "topk_group": self.topk_group,
            "routed_scaling_factor": self.routed_scaling_factor,
            "has_expert_bias": self.expert_bias is not None,
        }

    def scores(self, logits: mx.array) -> mx.array:
        logits = logits.astype(mx.float32)
        if self.score == "sigmoid":
            return mx.sigmoid(logits)
        return mx.softmax(logits, axis=-1, precise=True)

    def weights(self, scores: mx.array, inds: mx.array) -> mx.array:
        return combine(
            scores,
            inds,
            normalize=inds.shape[-1] > 1 and self.norm_topk_prob,
            eps=NORM_EPS,
            scaling=self.routed_scaling_factor,
        )

    def select(self, logits: mx.array, k: int) -> tuple[mx.array, mx.array]:
        """logits [..., E] -> (inds [..., K], weights [..., K] float32)."""
        scores = self.scores(logits)
        sel = (
            scores
            if self.expert_bias is None
            else scores + self.expert_bias.astype(mx.float32)
        )
        inds = top_k(limit_groups(sel, self.n_group, self.topk_group), k)
        return inds, self.weights(scores, inds)


def stack_rules(rules: list[RoutingRule]) -> RoutingRule:
    """One rule for logits [O, B, E] whose row o follows rules[o] (only expert_bias may differ)."""
    first = rules[0]
    for r in rules[1:]:
        if (
            r.score,
            r.norm_topk_prob,
            r.n_group,
            r.topk_group,
            r.routed_scaling_factor,
        ) != (
            first.score,
            first.norm_topk_prob,
            first.n_group,
            first.topk_group,
            first.routed_scaling_factor,
        ):
            raise ValueError(
                "consumer layers follow different routing rules; select per layer"
            )
    bias = None
    if first.expert_bias is not None:
        bias = mx.stack([r.expert_bias for r in rules])[:, None, :]
    return RoutingRule(
        first.score,
        first.norm_topk_prob,
        bias,
        first.n_group,
        first.topk_group,
        first.routed_scaling_factor,
    )
