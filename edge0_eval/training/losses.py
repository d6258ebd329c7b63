"""The losses of the three stages and the recall metric of stage 1."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from edge0_eval.engine.routing import PrerouterHeads, onehot
from edge0_eval.training.batches import Batch


def cross_entropy_loss(logits, rows, batch: Batch, aux) -> mx.array:
    """Summed next-token cross-entropy at the completion positions (stage 2, --loss ce)."""
    targets = mx.array(batch.targets[rows])
    mask = mx.array(batch.loss_mask[rows])
    ce = nn.losses.cross_entropy(logits, targets, reduction="none")
    return (ce * mask).sum()


def teacher_topk(lt: mx.array, k: int) -> dict:
    """Teacher top-k ids, their log-probs and the log of the remaining (tail) mass.

    k is capped at vocab - 1 so the tail bucket is never empty.
    """
    k = max(1, min(k, lt.shape[-1] - 1))
    ids = mx.argpartition(-lt, kth=k - 1, axis=-1)[..., :k]
    lt_top, lt_tail = _buckets(lt, ids)
    return {"ids": ids, "lt_top": lt_top, "lt_tail": lt_tail}


def _buckets(logp: mx.array, ids: mx.array) -> tuple[mx.array, mx.array]:
    """Log-probs `logp` at `ids`, and the log of the mass outside them."""
    top = mx.take_along_axis(logp, ids, axis=-1)
    in_top = mx.put_along_axis(
        mx.zeros(logp.shape, dtype=mx.bool_), ids, mx.array(True), axis=-1
    )
    return top, mx.logsumexp(mx.where(in_top, -mx.inf, logp), axis=-1)


def bucket_kl(
    logits: mx.array,
    ids: mx.array,
    lt_top: mx.array,
    lt_tail: mx.array,
    direction: str = "reverse",
) -> mx.array:
    """Tail-aware top-k KL per position, from student logits [.., V] and the teacher's buckets.

    Buckets: the teacher's top-k tokens `ids` plus one tail bucket holding the remaining mass
    (1 - sum over the top-k, computed as a log-sum-exp over the complement, so it stays exact
    and finite when the tail is tiny). reverse: KL(student || teacher) = sum_b p_s (log p_s -
    log p_t); forward: KL(teacher || student) = sum_b p_t (log p_t - log p_s).
    """
    ls = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    ls_top, ls_tail = _buckets(ls, ids)
    if direction == "reverse":
        return (mx.exp(ls_top) * (ls_top - lt_top)).sum(axis=-1) + mx.exp(ls_tail) * (
            ls_tail - lt_tail
        )
    if direction == "forward":
        return (mx.exp(lt_top) * (lt_top - ls_top)).sum(axis=-1) + mx.exp(lt_tail) * (
            lt_tail - ls_tail
        )
    raise ValueError(f"direction must be reverse or forward, not {direction!r}")


def khot_cross_entropy(
    heads: PrerouterHeads, feats: mx.array, target: mx.array
) -> mx.array:
    """Softmax cross-entropy against the K-hot target normalised to sum 1.

    Why not BCE: the deliverable is the top-K *set*, a ranking; softmax CE is the listwise
    loss whose optimum ranks the true set first, it does not spend capacity calibrating the
    E-K negatives' absolute probabilities, it starts from the warm-started router's own
    distribution, and it is invariant to a shared logit shift (its gradient sums to zero
    over experts), so it leaves the router's absolute logit level - which matters for
    bailing's sigmoid + expert-bias rule - where the warm start put it.
    """
    logits = heads(feats).astype(mx.float32)
    k = target.shape[-1]
    khot = onehot(target, logits.shape[-1])
    return (mx.logsumexp(logits, axis=-1) - (khot * logits).sum(axis=-1) / k).mean()


def recall(pred: mx.array, true: mx.array, num_experts: int) -> mx.array:
    """|pred & true| / K per row: [..., K] x [..., K] -> [...]."""
    k = true.shape[-1]
    return (onehot(pred, num_experts) * onehot(true, num_experts)).sum(axis=-1) / k


def masked_kl(logits: mx.array, rows, batch, aux: dict, direction: str) -> mx.array:
    """`bucket_kl` of the batch's `rows` against the teacher's buckets `aux`
    (`teacher_topk`), summed over their loss positions."""
    r = mx.array(rows)
    per = bucket_kl(
        logits, aux["ids"][r], aux["lt_top"][r], aux["lt_tail"][r], direction
    )
    return (per * mx.array(batch.loss_mask[rows])).sum()
