"""Stage 1's training data: the teacher's per-token routing records, collected once into
`<out>.ckpt/features/` (resumable per document), and batches gathered from them."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from tqdm import tqdm

from edge0_eval.engine.engine import Engine
from edge0_eval.engine.heads import default_consumers, router_weight
from edge0_eval.engine.routing import RoutingRule, build_features, onehot, stack_rules
from edge0_eval.errors import CheckpointError, ConfigError
from edge0_eval.training.collect_fp32 import check_float32, load_float32
from edge0_eval.training.corpus import read_documents, tokenize_documents
from edge0_eval.training.models import collector_options
from edge0_eval.training.stage_options import PrerouterOptions
from edge0_eval.training.state import model_fingerprint, sha256_file, write_json

DATA_VERSION = 1
COLLECTION_FILE = "collection.json"
EMBEDDINGS_FILE = "emb.npy"


def data_fingerprint(opts: PrerouterOptions, experts_per_token: int) -> dict:
    # The float32 collector's features differ from the served path's in rounding: another
    # store. The served path keeps the key absent, so stores collected before it stay valid.
    extra = {} if opts.collect == "served" else {"collect": opts.collect}
    return extra | {
        "version": DATA_VERSION,
        "model": model_fingerprint(opts.model),
        "texts": [[str(Path(t).resolve()), sha256_file(Path(t))] for t in opts.texts],
        "top_k": experts_per_token,
        "max_doc_tokens": opts.max_doc_tokens,
        "max_tokens": opts.max_tokens,
    }


class FeatureStore:
    """Per-token teacher records for every MoE layer, in `<out>.ckpt/features/`.

    h.npy   [T, P, H] float16  MoE input of each pair owner N (pairs: N and N+1 both MoE, and
                               the wrap-around pair: the last MoE layer -> the first MoE layer)
    inds.npy [T, M, K] int16    executed top-K of every MoE layer
    nr.npy  [T, P, K] int16     baseline: the consumer's router on the owner's input, family rule
    emb.npy [T, H] float16      input embedding of the token at each position (written by
                                `ensure_embeddings` when next-token heads are trained)
    routers.safetensors         consumers' router weights (warm start) and expert biases
    data.json                   fingerprint, layers, pairs and their consumers ("consumers"; absent
                                in stores collected before wrap-around heads: owner + 1), routing
                                rule, documents [name, start, len]
    progress.json               documents completed (collection resumes per document)
    collection.json             how it was collected: path (served | float32), tokens per
                                second, the float32 path's check against the served one
    """

    def __init__(self, directory: Path):
        self.dir = directory
        self.meta: dict = {}

    @property
    def complete(self) -> bool:
        try:
            meta = json.loads((self.dir / "data.json").read_text())
            done = json.loads((self.dir / "progress.json").read_text())["docs_done"]
        except (OSError, ValueError, KeyError):
            return False
        return done == len(meta["docs"])

    def matches(self, fingerprint: dict) -> bool:
        try:
            meta = json.loads((self.dir / "data.json").read_text())
        except (OSError, ValueError):
            return False
        return meta.get("fingerprint") == fingerprint

    def open(self) -> "FeatureStore":
        self.meta = json.loads((self.dir / "data.json").read_text())
        self.h = np.load(self.dir / "h.npy", mmap_mode="r")
        self.inds = np.load(self.dir / "inds.npy", mmap_mode="r")
        self.nr = np.load(self.dir / "nr.npy", mmap_mode="r")
        path = self.dir / EMBEDDINGS_FILE
        self.emb = np.load(path, mmap_mode="r") if path.is_file() else None
        return self

    def consumers(self) -> list[int]:
        """The layer each pair owner predicts (parallel to meta["pairs"])."""
        return self.meta.get("consumers") or [n + 1 for n in self.meta["pairs"]]

    def covers(self, owners: list[int]) -> bool:
        """Whether the collected pairs include every owner (stores from before wrap-around
        heads lack the last MoE layer's)."""
        try:
            meta = json.loads((self.dir / "data.json").read_text())
        except (OSError, ValueError):
            return False
        return set(owners) <= set(meta.get("pairs", []))

    def collection(self) -> dict:
        try:
            return json.loads((self.dir / COLLECTION_FILE).read_text())
        except (OSError, ValueError):
            return {}

    def routers(self) -> dict:
        return mx.load(str(self.dir / "routers.safetensors"))

    def rule(self, consumers: list[int]) -> RoutingRule:
        r = self.meta["rule"]
        arrays = self.routers()
        rules = [
            RoutingRule(
                r["score"],
                r["norm_topk_prob"],
                arrays.get(f"expert_bias.{c}") if r["has_expert_bias"] else None,
                r["n_group"],
                r["topk_group"],
                r["routed_scaling_factor"],
            )
            for c in consumers
        ]
        return stack_rules(rules)


def collect_features(
    opts: PrerouterOptions,
    store: FeatureStore,
    fingerprint: dict,
    experts_per_token: int,
    owners: list[int] | None = None,
) -> None:
    """Run the model over the documents and fill the store (resuming per document); a store
    that lacks one of `owners` (collected before wrap-around heads) is collected again.
    `opts.collect` "float32": the dequantized float32 build, checked against the served path on
    the first documents before anything is collected (collect_fp32.py)."""
    served_options = collector_options(opts, experts_per_token)
    if opts.collect == "float32":
        engine = load_float32(opts.model, served_options)
    else:
        engine = Engine.load(opts.model, served_options)
    try:
        stale = store.matches(fingerprint) and not store.covers(owners or [])
        if not store.matches(fingerprint) or stale:
            meta, tokens_of = _set_up_store(
                engine, opts, store, fingerprint, experts_per_token, stale
            )
        else:
            meta, tokens_of = _resumed_store(engine, opts, store)
        done = json.loads((store.dir / "progress.json").read_text())["docs_done"]
        record = store.collection() | {"path": opts.collect}
        if opts.collect == "float32" and done < len(meta["docs"]):
            record["check"] = _check_collector(engine, opts, served_options, tokens_of)
        _collect(engine, opts, store, meta, tokens_of, done, record)
    finally:
        engine.close()


def _set_up_store(
    engine, opts, store: FeatureStore, fingerprint: dict, k: int, stale: bool
) -> tuple[dict, dict]:
    """A fresh store (its arrays, routers and metadata) for this model and texts:
    (metadata, {document: tokens})."""
    moe = list(engine.moe_layers)
    if not moe:
        raise ConfigError(f"{opts.model}: no MoE layer; nothing to preroute")
    # Every MoE -> MoE pair, and the wrap-around pair (last MoE layer -> first, next token).
    pairs = [n for n in moe if n + 1 in set(moe)] + [moe[-1]]
    consumers = default_consumers(pairs, moe)
    hidden = int(engine.family.hidden_size(engine.config))
    if store.dir.exists():
        why = (
            "predate wrap-around heads"
            if stale
            else "were collected for another model, texts, K or token limits"
        )
        print(
            f"train-prerouter: features in {store.dir} {why}; collecting again",
            flush=True,
        )
        shutil.rmtree(store.dir)
    store.dir.mkdir(parents=True)
    docs = _documents(engine, opts)
    if len(docs) < 2:
        raise ConfigError(
            f"need at least 2 documents of 2+ tokens for a held-out split "
            f"by document; got {len(docs)} from {opts.texts}"
        )
    table, total = [], 0
    for name, toks in docs:
        table.append([name, total, len(toks)])
        total += len(toks)
    _save_routers(engine, store, consumers, moe)
    for name, dtype, shape in (
        ("h", np.float16, (total, len(pairs), hidden)),
        ("inds", np.int16, (total, len(moe), k)),
        ("nr", np.int16, (total, len(pairs), k)),
    ):
        np.lib.format.open_memmap(store.dir / f"{name}.npy", "w+", dtype, shape).flush()
    meta = {
        "fingerprint": fingerprint,
        "model_type": engine.config["model_type"],
        "moe_layers": moe,
        "pairs": pairs,
        "consumers": consumers,
        "hidden": hidden,
        "num_experts": int(engine.index.num_experts),
        "top_k": k,
        "rule": engine.blocks[moe[-1]].rule.to_json(),
        "docs": table,
        "tokens": total,
        "n_layers": len(engine.family.layers(engine.model)),
    }
    write_json(store.dir / "progress.json", {"docs_done": 0})
    write_json(store.dir / "data.json", meta)  # last: marks the store as set up
    return meta, dict(enumerate(t for _, t in docs))


def _save_routers(engine, store: FeatureStore, consumers: list[int], moe: list[int]):
    """The consumers' routers and every MoE layer's expert bias, as the heads' targets."""
    routers = {}
    for c in consumers:
        w, b = router_weight(engine.blocks[c])
        routers[f"router.{c}"] = w
        if b is not None:
            routers[f"router_bias.{c}"] = b
    for n in moe:
        bias = engine.blocks[n].rule.expert_bias
        if bias is not None:
            routers[f"expert_bias.{n}"] = bias.astype(mx.float32)
    mx.save_safetensors(str(store.dir / "routers.safetensors"), routers)


def _resumed_store(engine, opts, store: FeatureStore) -> tuple[dict, dict]:
    """(metadata, {document: tokens}) of a store being resumed: re-tokenized
    (deterministic) and checked against the documents already collected."""
    meta, toks = _collected_documents(engine, opts, store)
    return meta, dict(enumerate(t for _, t in toks))


def _collected_documents(engine, opts, store: FeatureStore) -> tuple[dict, list]:
    """(the store's metadata, the documents tokenized again), checked to be the ones
    collected (tokenization is deterministic)."""
    meta = json.loads((store.dir / "data.json").read_text())
    docs = _documents(engine, opts)
    if [[n, len(t)] for n, t in docs] != [[d[0], d[2]] for d in meta["docs"]]:
        raise CheckpointError(
            f"{store.dir}: tokenization no longer matches the "
            f"collected documents; rerun with --fresh"
        )
    return meta, docs


def _check_collector(engine, opts, served_options, tokens_of: dict) -> dict:
    """The float32 collector checked against the served int4 path, printed."""
    c = check_float32(
        opts.model, served_options, engine, _check_sample(tokens_of, opts.check_tokens)
    )
    print(
        f"train-prerouter: float32 collector vs served int4 path on {c['tokens']} "
        f"tokens: top-K agreement mean {c['mean_agreement']:.4f}, worst "
        f"{c['worst_agreement']:.4f} (layer {c['worst_layer']}; required "
        f"{c['min_agreement']}), feature max relative diff "
        f"{c['feature_max_rel_diff']:.2e}; {c['served_tok_s']:.1f} -> "
        f"{c['float32_tok_s']:.1f} tok/s",
        flush=True,
    )
    return c


def _collect(engine, opts, store, meta, tokens_of, done: int, record: dict) -> None:
    """Collect documents `done`.. into the store, recording progress after each."""
    table, moe = meta["docs"], meta["moe_layers"]
    arrays = {
        name: np.load(store.dir / f"{name}.npy", mmap_mode="r+")
        for name in ("h", "inds", "nr")
    }
    blocks = [engine.blocks[n] for n in moe]
    for b in blocks:
        b.capture = True
    collected, started = 0, time.perf_counter()
    bar = tqdm(
        total=meta["tokens"],
        initial=sum(d[2] for d in table[:done]),
        desc="collect routing",
        unit="tok",
        disable=not opts.progress,
    )
    try:
        for d in range(done, len(table)):
            collected += _collect_document(engine, meta, tokens_of[d], d, arrays, bar)
            write_json(store.dir / "progress.json", {"docs_done": d + 1})
    finally:
        if collected:
            seconds = time.perf_counter() - started
            record["runs"] = record.get("runs", []) + [
                {"tokens": collected, "seconds": seconds, "tok_s": collected / seconds}
            ]
        write_json(store.dir / COLLECTION_FILE, record)
        bar.close()
        for b in blocks:
            b.capture = False


def _collect_document(engine, meta, tokens, d: int, arrays: dict, bar) -> int:
    """One document's features, executed routing and next routers' choices, written
    in prefill chunks; the tokens collected."""
    _, start, length = meta["docs"][d]
    k = meta["top_k"]
    consumers = meta.get("consumers") or [n + 1 for n in meta["pairs"]]
    blocks = [engine.blocks[n] for n in meta["moe_layers"]]
    chunk = max(1, engine.options.prefill_chunk)
    cache = engine.step.new_cache()
    for s in range(0, length, chunk):
        piece = tokens[s : s + chunk]
        where = f"collecting document {d}"
        engine.step(mx.array(piece)[None], cache, plan_next=False, where=where)
        hs, nrs = [], []
        for n, c in zip(meta["pairs"], consumers):
            x = engine.blocks[n].last[0][0]
            hs.append(x)
            consumer = engine.blocks[c]
            nrs.append(consumer.rule.select(consumer.router(x), k)[0])
        ind = [b.last[1][0] for b in blocks]
        hs, nrs, ind = mx.stack(hs, 1), mx.stack(nrs, 1), mx.stack(ind, 1)
        mx.eval(hs, nrs, ind)
        a, z = start + s, start + s + len(piece)
        arrays["h"][a:z] = np.clip(np.array(hs.astype(mx.float32)), -65000, 65000)
        arrays["nr"][a:z] = np.array(nrs).astype(np.int16)
        arrays["inds"][a:z] = np.array(ind).astype(np.int16)
        bar.update(len(piece))
    for a in arrays.values():
        a.flush()
    return length


def _check_sample(tokens_of: dict, want: int) -> list[list[int]]:
    """The first documents, until `want` tokens (the last one cut to fit)."""
    sample, have = [], 0
    for d in sorted(tokens_of):
        if have >= want:
            break
        piece = list(tokens_of[d][: want - have])
        sample.append(piece)
        have += len(piece)
    return sample


def ensure_embeddings(
    opts: PrerouterOptions,
    store: FeatureStore,
    experts_per_token: int,
    chunk: int = 4096,
) -> None:
    """Write `emb.npy` (each position's input embedding, for next-token heads) into a complete
    store that lacks it: the documents are tokenized again (checked against the store's) and
    looked up in the model's own embedding, so the features collected stay as they are."""
    path = store.dir / EMBEDDINGS_FILE
    if path.is_file():
        return
    engine = Engine.load(opts.model, collector_options(opts, experts_per_token))
    try:
        meta, docs = _collected_documents(engine, opts, store)
        ids = np.concatenate([np.asarray(t, dtype=np.int64) for _, t in docs])
        embed = engine.family.embedding(engine.model)
        tmp = store.dir / f".{EMBEDDINGS_FILE}.tmp.npy"
        out = np.lib.format.open_memmap(
            tmp, "w+", np.float16, (len(ids), meta["hidden"])
        )
        for a in range(0, len(ids), chunk):
            rows = embed(mx.array(ids[a : a + chunk])).astype(mx.float32)
            out[a : a + chunk] = np.array(rows).astype(np.float16)
        out.flush()
        del out
        tmp.replace(path)
    finally:
        engine.close()


def _documents(engine, opts: PrerouterOptions) -> list[tuple[str, list[int]]]:
    docs = read_documents(opts.texts)
    return tokenize_documents(
        engine.tokenizer, docs, opts.max_tokens, opts.max_doc_tokens
    )


def positions(docs: list, ids: list[int]) -> np.ndarray:
    """Token positions t with t+1 in the same document (features at t, target at t+1)."""
    parts = [np.arange(docs[i][1], docs[i][1] + docs[i][2] - 1) for i in ids]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


class Batches:
    """Gathers [O, B, ...] arrays for token positions from the store (numpy, then MLX)."""

    def __init__(
        self, store: FeatureStore, owners: list[int], next_token: bool = False
    ):
        meta = store.meta
        self.store = store
        self.next_token = next_token
        if next_token and store.emb is None:
            raise CheckpointError(
                f"{store.dir}: no {EMBEDDINGS_FILE} for next-token heads "
                f"(ensure_embeddings writes it)"
            )
        self.num_experts = meta["num_experts"]
        self.k = meta["top_k"]
        pair_pos = {n: i for i, n in enumerate(meta["pairs"])}
        moe_pos = {n: i for i, n in enumerate(meta["moe_layers"])}
        consumer_of = dict(zip(meta["pairs"], store.consumers()))
        missing = [n for n in owners if n not in pair_pos]
        if missing:
            raise CheckpointError(
                f"{store.dir}: no features for owner layer(s) {missing}; "
                f"collected pairs {meta['pairs']}"
            )
        self.owner_p = np.array([pair_pos[n] for n in owners])
        self.owner_m = np.array([moe_pos[n] for n in owners])
        self.consumers = [consumer_of[n] for n in owners]
        self.consumer_m = np.array([moe_pos[c] for c in self.consumers])
        if next_token:
            routers = store.routers()
            self.token_router = mx.stack(
                [routers[f"router.{c}"] for c in self.consumers]
            ).astype(mx.float32)  # [O, E, H]
        first = np.zeros(meta["tokens"], dtype=bool)
        for _, start, _ in meta["docs"]:
            first[start] = True
        self.first = first

    def get(self, t: np.ndarray) -> dict:
        s = self.store
        h = np.asarray(s.h[t])[:, self.owner_p]  # [B, O, H]
        rows = np.asarray(s.inds[t])  # [B, M, K]
        prev_rows = np.asarray(s.inds[np.maximum(t - 1, 0)])
        nxt = np.asarray(s.inds[t + 1])[:, self.consumer_m]  # target
        cur = rows[:, self.owner_m]
        prev = prev_rows[:, self.owner_m].astype(np.int32)
        prev[self.first[t]] = -1  # first token: zeros
        tr = lambda a: mx.array(np.ascontiguousarray(np.swapaxes(a, 0, 1)))  # noqa: E731
        return {
            "h": tr(h).astype(mx.float32),
            "cur": tr(cur.astype(np.int32)),
            "prev": tr(prev),
            "target": tr(nxt.astype(np.int32)),
            "prev_token": tr(rows[:, self.consumer_m].astype(np.int32)),
            "next_router": tr(np.asarray(s.nr[t])[:, self.owner_p].astype(np.int32)),
        } | (
            {"next_emb": mx.array(np.asarray(s.emb[t + 1], dtype=np.float32))}
            if self.next_token
            else {}
        )

    def features(self, batch: dict) -> mx.array:
        e = self.num_experts
        cur, prev = onehot(batch["cur"], e), onehot(batch["prev"], e)
        return build_features(batch["h"], cur, prev, batch.get("next_emb"))

    def token_router_logits(self, batch: dict) -> mx.array:
        """Baseline of next-token heads: each consumer's router on token t+1's embedding."""
        return mx.matmul(batch["next_emb"][None], self.token_router.swapaxes(1, 2))
