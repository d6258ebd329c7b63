"""Draft-token hedge, offline: would next-token heads evaluated at a cheap draft of the next
token (the argmax over the N most frequent tokens, a 1/(V/N) slice of the LM head) predict the
routing at the served token better than a context hedge does?

Held-out positions of a stage-1 store. Greedy token = the teacher's full-vocabulary argmax at
each position (teacher-forced context), or with --temperature its sample. Routing = next-token heads at that token. Hedges:
context heads (no token), next-token heads at the draft token. Frequencies from the training
documents' tokens only.

    python draft_hedge.py STORE TEACHER STUDENT CONTEXT_HEADS NEXT_TOKEN_HEADS TEXT OUT.json \
        [--order frequency|id] [--temperature T --top-p P [--draft-noise none]] [--positions 6000]
"""

import argparse
import json
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm import load

from edge0_eval.engine.engine import Engine
from edge0_eval.engine.heads_file import load_heads
from edge0_eval.engine.options import EngineOptions
from edge0_eval.training.data import read_documents, split_documents, tokenize_documents
from edge0_eval.training.features import Batches, FeatureStore, positions

p = argparse.ArgumentParser()
p.add_argument("store")
p.add_argument("teacher")
p.add_argument("student")
p.add_argument("context")
p.add_argument("next_token")
p.add_argument("text")
p.add_argument("out")
p.add_argument("--positions", type=int, default=6000)
p.add_argument("--order", choices=("frequency", "id"), default="frequency")
p.add_argument("--temperature", type=float, default=0.0)
p.add_argument("--top-p", type=float, default=1.0)
p.add_argument("--draft-noise", choices=("sampler", "none"), default="sampler",
               help="with --temperature: the draft adds the sampler's Gumbel noise, or drafts "
                    "the slice's plain argmax (what the engine does)")
a = p.parse_args()

store = FeatureStore(Path(a.store)).open()
meta = store.meta
k, e = meta["top_k"], meta["num_experts"]
train, held = split_documents(len(meta["docs"]), 0.1, 0)
model, tok = load(a.teacher)
model.set_dtype(mx.float32)
fp = meta["fingerprint"]
docs = tokenize_documents(tok, read_documents([a.text]), fp["max_tokens"], fp["max_doc_tokens"])
assert [d[0] for d in docs] == [d[0] for d in meta["docs"]], "documents differ from the store's"
tokens = np.concatenate([np.array(t) for _, t in docs])
assert tokens.size == meta["tokens"]
engine = Engine.load(a.student, EngineOptions(mode="reactive", top_k=k, no_lora=True))
lookup = engine.family.embedding(engine.model)
V = model.model.embed_tokens.weight.shape[0]
embed = mx.concatenate([lookup(mx.arange(s, min(s + 4096, V))).astype(mx.float32)
                        for s in range(0, V, 4096)])
engine.close()
# The store's embeddings are the served model's, in float16: check the token ids against them.
sample = np.arange(0, tokens.size, 997)
diff = float(mx.abs(embed[mx.array(tokens[sample])].astype(mx.float16).astype(mx.float32)
                    - mx.array(np.asarray(store.emb[sample], dtype=np.float32))).max())
assert diff == 0.0, f"token ids do not match the store's embeddings (max |diff| {diff})"

freq = np.bincount(np.concatenate([tokens[meta["docs"][i][1]: meta["docs"][i][1] + meta["docs"][i][2]]
                                   for i in train]), minlength=V)  # training documents only
# --order id: the tokenizer's own id order (BPE ids roughly follow merge order), no counts.
by_freq = np.argsort(-freq, kind="stable") if a.order == "frequency" else np.arange(V)
sizes = [512, 1024, 2048, 4096, 8192, 16384]

pos = positions(meta["docs"], held)[: a.positions]
want = set(pos.tolist())
token = np.zeros(meta["tokens"], dtype=np.int64)          # the served token (greedy or sampled)
draft = {n: np.zeros(meta["tokens"], dtype=np.int64) for n in sizes}
rng = np.random.default_rng(0)
for i in held:
    _, start, length = meta["docs"][i]
    if not any(t in want for t in range(start, start + length)):
        continue
    logits = np.array(model(mx.array(tokens[start: start + length])[None])[0].astype(mx.float32))
    if a.temperature > 0:
        # Gumbel-max: the sample is the argmax of logits / T + g over the top-p nucleus. The
        # draft uses the same noise g (drawn before the LM head) over its slice, without the
        # nucleus, which needs the whole distribution.
        scores = logits / a.temperature + rng.gumbel(size=logits.shape)
        order = np.argsort(-logits, axis=-1)
        probs = np.take_along_axis(logits / a.temperature, order, axis=-1)
        probs = np.exp(probs - probs[:, :1])
        probs /= probs.sum(-1, keepdims=True)
        keep_sorted = np.cumsum(probs, axis=-1) - probs < a.top_p
        keep = np.zeros_like(keep_sorted)
        np.put_along_axis(keep, order, keep_sorted, axis=-1)
        token[start: start + length] = np.where(keep, scores, -np.inf).argmax(-1)
    else:
        scores = logits
        token[start: start + length] = scores.argmax(-1)
    drafted = scores if a.draft_noise == "sampler" else logits
    for n in sizes:
        draft[n][start: start + length] = by_freq[:n][drafted[:, by_freq[:n]].argmax(-1)]

ctx_heads = load_heads(a.context, hidden=meta["hidden"], num_experts=e, top_k=k, dtype=mx.float32)
nt_heads = load_heads(a.next_token, hidden=meta["hidden"], num_experts=e, top_k=k, dtype=mx.float32)
bc = Batches(store, ctx_heads.owners, next_token=False)
bn = Batches(store, nt_heads.owners, next_token=True)
assert bc.consumers == bn.consumers


def topk(logits):
    return np.array(mx.argsort(-logits, axis=-1)[..., :k])


def overlap(x, y):
    return float((x[..., :, None] == y[..., None, :]).any(-1).mean())


def emb16(ids):
    return embed[mx.array(ids)].astype(mx.float16).astype(mx.float32)


res = {n: [] for n in sizes} | {"context": [], "corpus_token": []}
match = {n: 0 for n in sizes}
for s in range(0, len(pos), 1000):
    t = pos[s: s + 1000]
    batch = bn.get(t)
    base = batch["next_emb"]
    routed = topk(nt_heads(bn.features(batch | {"next_emb": emb16(token[t])})))
    res["context"].append(overlap(topk(ctx_heads(bc.features(bc.get(t)))), routed) * len(t))
    res["corpus_token"].append(overlap(topk(nt_heads(bn.features(batch | {"next_emb": base}))),
                                       routed) * len(t))
    for n in sizes:
        match[n] += int((draft[n][t] == token[t]).sum())
        res[n].append(overlap(topk(nt_heads(bn.features(batch | {"next_emb": emb16(draft[n][t])}))),
                              routed) * len(t))
summary = {
    "order": a.order, "temperature": a.temperature, "top_p": a.top_p,
    "draft_noise": a.draft_noise if a.temperature > 0 else None,
    "positions": int(len(pos)), "vocab": int(V), "top_k": k, "num_experts": e,
    "token_equals_corpus_token": float((token[pos] == tokens[pos + 1]).mean()),
    "hedge_precision_context_heads": sum(res["context"]) / len(pos),
    "hedge_precision_next_token_heads_at_corpus_token": sum(res["corpus_token"]) / len(pos),
    "draft": {str(n): {"lm_head_fraction": n / V, "draft_equals_token": match[n] / len(pos),
                       "hedge_precision": sum(res[n]) / len(pos)} for n in sizes},
}
Path(a.out).write_text(json.dumps(summary, indent=1))
print(json.dumps(summary, indent=1))
