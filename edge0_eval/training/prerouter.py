"""`edge0-eval train-prerouter`: stage 1, distil prerouter heads from the model's true routing.

    edge0-eval train-prerouter MODEL --text a.txt b.jsonl ... --out heads.safetensors

1. Collect (teacher = the model itself, run by the engine in reactive mode at the serving K, so
   routing is the exact executed top-K). For every document, every MoE layer's input (the
   post-attention norm output) and executed top-K ids are recorded per token, plus the
   "next router on the current hidden" baseline. Features at token t for owner N are paired
   with layer N+1's executed set at token t+1 (the next token), within a document.
2. Train all heads together with MLX (Adam, warmup + cosine) on softmax cross-entropy against
   the normalised K-hot target of the true set (see `loss_fn` for why not BCE).
3. Report top-K recall (|predicted & true| / K) per owner on held-out documents, next to two
   baselines: layer N+1's routing of the previous token, and layer N+1's router applied to
   layer N's hidden state; JSON + markdown next to --out.

Inputs: plain-text files are one document each; `.jsonl` files give one document per line,
from its "text" field, or else "prompt" + "completion" concatenated. The held-out split is by
document (a seeded shuffle), never by token.

Checkpoints live in `<out>.ckpt/`: `features/` (collected once, resumable per document) and
`train_state.safetensors` (heads + Adam state + step, written atomically every --ckpt-every
steps). Resume rule: when `<out>.ckpt/` holds state for the same settings, the run continues
from it automatically (batches are a pure function of (seed, step), so a killed run continued
by the same command ends bit-identical to an uninterrupted one). Different training settings
with an existing state are an error unless --fresh (which drops the training state but keeps
features collected for the same model/texts/K/limits). --resume demands that a state exists.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from edge0_eval.errors import CheckpointError, ConfigError
from edge0_eval.jsonl import iter_jsonl
from edge0_eval.engine.prerouter import (
    PrerouterConfig, PrerouterHeads, RoutingRule, check_owners, default_owners,
    heads_from_router_weights, load_heads, onehot, router_logits, router_weight, save_heads,
    stack_rules, tier_defaults,
)
from edge0_eval.training.state import load_training_state, save_training_state

DATA_VERSION = 1
STATE_NAME = "train_state.safetensors"


# -- options ------------------------------------------------------------------------------------

@dataclass
class TrainOptions:
    model: str
    texts: list[str]
    out: str
    owners: list[int] | None = None
    start_layer: int | None = None
    width: int | None = None
    top_k: int | None = None
    steps: int = 1000
    lr: float = 1e-3
    batch: int = 256
    holdout: float = 0.1
    seed: int = 0
    resume: bool = False
    fresh: bool = False
    ckpt_every: int = 100
    max_doc_tokens: int = 1024
    max_tokens: int = 50_000      # 35B: ~160 KB of float16 features per token on disk
    expert_budget_mib: float | None = None
    save_dtype: str = "float16"
    progress: bool = True

    def validate(self) -> None:
        if not self.texts:
            raise ConfigError("give at least one --text file")
        for text in self.texts:
            if not Path(text).is_file():
                raise ConfigError(f"--text {text}: no such file")
        if self.steps < 1:
            raise ConfigError("--steps must be at least 1")
        if self.batch < 1:
            raise ConfigError("--batch must be at least 1")
        if not self.lr > 0:
            raise ConfigError("--lr must be positive")
        if not 0 < self.holdout < 1:
            raise ConfigError("--holdout must be a fraction strictly between 0 and 1")
        if self.ckpt_every < 1:
            raise ConfigError("--ckpt-every must be at least 1")
        if self.max_doc_tokens < 2 or self.max_tokens < 2:
            raise ConfigError("--max-doc-tokens and --max-tokens must be at least 2")
        if self.width is not None and self.width < 1:
            raise ConfigError("--width must be at least 1")
        if self.top_k is not None and self.top_k < 1:
            raise ConfigError("--top-k must be at least 1")
        if self.save_dtype not in ("float16", "bfloat16", "float32"):
            raise ConfigError("--save-dtype must be float16, bfloat16 or float32")
        if self.resume and self.fresh:
            raise ConfigError("--resume and --fresh contradict each other")


def parse_owners(values: list[str] | None) -> list[int] | None:
    """Accepts `6 7 8`, `6,7,8`, `6..38` or `6-38` (inclusive ranges)."""
    if not values:
        return None
    out = []
    for value in values:
        for part in str(value).split(","):
            part = part.strip()
            if not part:
                continue
            for sep in ("..", "-"):
                if sep in part:
                    lo, hi = part.split(sep, 1)
                    try:
                        out.extend(range(int(lo), int(hi) + 1))
                    except ValueError:
                        raise ConfigError(f"--owners: cannot read range {part!r}") from None
                    break
            else:
                try:
                    out.append(int(part))
                except ValueError:
                    raise ConfigError(f"--owners: {part!r} is not a layer number") from None
    return out


# -- documents ----------------------------------------------------------------------------------

@dataclass
class Document:
    name: str
    text: str


def read_documents(paths: list[str]) -> list[Document]:
    """Plain text: one document per file. JSONL: one per line, "text" else prompt+completion."""
    docs = []
    for p in paths:
        path = Path(p)
        if not path.is_file():
            raise ConfigError(f"--text {path}: no such file")
        raw = path.read_text(encoding="utf-8", errors="replace")
        if path.suffix.lower() != ".jsonl":
            if raw.strip():
                docs.append(Document(str(path), raw))
            continue
        for lineno, record in iter_jsonl(path, raw):
            if isinstance(record.get("text"), str):
                text = record["text"]
            elif isinstance(record.get("prompt"), str) or isinstance(record.get("completion"), str):
                text = str(record.get("prompt") or "") + str(record.get("completion") or "")
            else:
                raise ConfigError(f"{path}:{lineno}: no string field \"text\" (or \"prompt\"/"
                                  f"\"completion\"); keys are {sorted(record)}")
            if text.strip():
                docs.append(Document(f"{path}:{lineno}", text))
    return docs


# -- fingerprints -------------------------------------------------------------------------------

def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _model_fingerprint(model: Path) -> dict:
    out = {"path": str(model.resolve())}
    for name in ("config.json", "experts.index.json"):
        p = model / name
        out[name] = _sha256(p) if p.is_file() else None
    for name in ("resident.safetensors", "experts.bin"):
        p = model / name
        out[name] = [p.stat().st_size, p.stat().st_mtime_ns] if p.is_file() else None
    return out


def data_fingerprint(opts: TrainOptions, top_k: int) -> dict:
    return {
        "version": DATA_VERSION,
        "model": _model_fingerprint(Path(opts.model)),
        "texts": [[str(Path(t).resolve()), _sha256(Path(t))] for t in opts.texts],
        "top_k": top_k,
        "max_doc_tokens": opts.max_doc_tokens,
        "max_tokens": opts.max_tokens,
    }


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def _write_json(path: Path, obj) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


# -- model facts without loading the model ------------------------------------------------------

@dataclass
class ModelFacts:
    model_type: str
    n_layers: int
    hidden: int
    num_experts: int
    native_top_k: int
    moe_layers: list[int]


def model_facts(model: Path) -> ModelFacts:
    from edge0_eval.engine.families import family_for
    from edge0_eval.engine.layout import ExpertIndex

    config_path = model / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{config_path} not found; is {model} a converted model "
                              f"(`edge0-eval convert`)?")
    config = json.loads(config_path.read_text())
    family = family_for(config, str(config_path))
    text = family.text_config(config)
    index = ExpertIndex.load(model, check_file=False)
    return ModelFacts(config["model_type"], int(text["num_hidden_layers"]),
                      family.hidden_size(config), family.num_experts(config),
                      family.native_top_k(config), list(index.moe_layers))


def resolve_heads(opts: TrainOptions, facts: ModelFacts) -> tuple[int, list[int], int]:
    """(K, owners, width) from the options and the tier defaults."""
    d = tier_defaults(facts.model_type, facts.n_layers, facts.hidden, facts.num_experts,
                      facts.moe_layers)
    k = opts.top_k or d["top_k"] or facts.native_top_k
    if k > facts.num_experts:
        raise ConfigError(f"--top-k {k} exceeds the model's {facts.num_experts} experts")
    if opts.owners:
        owners = check_owners(opts.owners, facts.moe_layers)
        if opts.start_layer is not None and opts.start_layer != owners[0] + 1:
            raise ConfigError(f"--start-layer {opts.start_layer} disagrees with --owners (first "
                              f"owner {owners[0]} -> first consuming layer {owners[0] + 1})")
    else:
        start = opts.start_layer if opts.start_layer is not None else d["start_layer"]
        owners = check_owners(default_owners(start, facts.n_layers, facts.moe_layers),
                              facts.moe_layers)
    return k, owners, opts.width or d["width"]


# -- feature store ------------------------------------------------------------------------------

class FeatureStore:
    """Per-token teacher records for every MoE layer, in `<out>.ckpt/features/`.

    h.npy   [T, P, H] float16  MoE input of each pair owner N (pairs: N and N+1 both MoE)
    inds.npy [T, M, K] int16    executed top-K of every MoE layer
    nr.npy  [T, P, K] int16     baseline: layer N+1's router on layer N's input, family rule
    routers.safetensors         consumers' router weights (warm start) and expert biases
    data.json                   fingerprint, layers, routing rule, documents [name, start, len]
    progress.json               documents completed (collection resumes per document)
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
        return self

    def routers(self) -> dict:
        return mx.load(str(self.dir / "routers.safetensors"))

    def rule(self, consumers: list[int]) -> RoutingRule:
        r = self.meta["rule"]
        arrays = self.routers()
        rules = [RoutingRule(r["score"], r["norm_topk_prob"],
                             arrays.get(f"expert_bias.{c}") if r["has_expert_bias"] else None,
                             r["n_group"], r["topk_group"], r["routed_scaling_factor"])
                 for c in consumers]
        return stack_rules(rules)


def collect_features(opts: TrainOptions, store: FeatureStore, fingerprint: dict, top_k: int
                     ) -> None:
    """Run the model over the documents and fill the store (resuming per document)."""
    from tqdm import tqdm

    from edge0_eval.engine.engine import Engine, EngineOptions

    engine = Engine.load(opts.model, EngineOptions(mode="reactive", top_k=top_k,
                                                   expert_budget_mib=opts.expert_budget_mib))
    try:
        moe = list(engine.moe_layers)
        pairs = [n for n in moe if n + 1 in set(moe)]
        if not pairs:
            raise ConfigError(f"{opts.model}: no MoE layer is followed by another MoE layer; "
                              f"nothing to preroute")
        hidden = int(engine.family.hidden_size(engine.config))
        num_experts = int(engine.index.num_experts)
        if not store.matches(fingerprint):
            if store.dir.exists():
                print(f"train-prerouter: features in {store.dir} were collected for another "
                      f"model, texts, K or token limits; collecting again", flush=True)
                shutil.rmtree(store.dir)
            store.dir.mkdir(parents=True)
            docs = _tokenize(engine, read_documents(opts.texts), opts)
            if len(docs) < 2:
                raise ConfigError(f"need at least 2 documents of 2+ tokens for a held-out split "
                                  f"by document; got {len(docs)} from {opts.texts}")
            table, start = [], 0
            for name, toks in docs:
                table.append([name, start, len(toks)])
                start += len(toks)
            total = start
            rule = RoutingRule.from_block(engine.blocks[moe[-1]])
            routers = {}
            for n in pairs:
                w, b = router_weight(engine.blocks[n + 1])
                routers[f"router.{n + 1}"] = w
                if b is not None:
                    routers[f"router_bias.{n + 1}"] = b
            for n in moe:
                bias = RoutingRule.from_block(engine.blocks[n]).expert_bias
                if bias is not None:
                    routers[f"expert_bias.{n}"] = bias.astype(mx.float32)
            mx.save_safetensors(str(store.dir / "routers.safetensors"), routers)
            np.lib.format.open_memmap(store.dir / "h.npy", "w+", np.float16,
                                      (total, len(pairs), hidden)).flush()
            np.lib.format.open_memmap(store.dir / "inds.npy", "w+", np.int16,
                                      (total, len(moe), top_k)).flush()
            np.lib.format.open_memmap(store.dir / "nr.npy", "w+", np.int16,
                                      (total, len(pairs), top_k)).flush()
            meta = {"fingerprint": fingerprint, "model_type": engine.config["model_type"],
                    "moe_layers": moe, "pairs": pairs, "hidden": hidden,
                    "num_experts": num_experts, "top_k": top_k, "rule": rule.to_json(),
                    "docs": table, "tokens": total,
                    "n_layers": len(engine.family.layers(engine.model))}
            _write_json(store.dir / "progress.json", {"docs_done": 0})
            _write_json(store.dir / "data.json", meta)    # last: marks the store as set up
            tokens_of = dict(enumerate(t for _, t in docs))
        else:
            meta = json.loads((store.dir / "data.json").read_text())
            tokens_of = None
        done = json.loads((store.dir / "progress.json").read_text())["docs_done"]
        table = meta["docs"]
        if tokens_of is None:  # resuming collection: re-tokenize (deterministic)
            toks = _tokenize(engine, read_documents(opts.texts), opts)
            if [[n, len(t)] for n, t in toks] != [[d[0], d[2]] for d in table]:
                raise CheckpointError(f"{store.dir}: tokenization no longer matches the "
                                      f"collected documents; rerun with --fresh")
            tokens_of = dict(enumerate(t for _, t in toks))
        h = np.load(store.dir / "h.npy", mmap_mode="r+")
        inds = np.load(store.dir / "inds.npy", mmap_mode="r+")
        nr = np.load(store.dir / "nr.npy", mmap_mode="r+")
        blocks = [engine.blocks[n] for n in moe]
        for b in blocks:
            b.set_capture(True)
        chunk = max(1, engine.options.prefill_chunk)
        bar = tqdm(total=meta["tokens"], initial=sum(d[2] for d in table[:done]),
                   desc="collect routing", unit="tok", disable=not opts.progress)
        try:
            for d in range(done, len(table)):
                _, start, length = table[d]
                tokens = tokens_of[d]
                engine.reset()
                for s in range(0, length, chunk):
                    piece = tokens[s: s + chunk]
                    logits = engine.forward(mx.array(piece)[None])
                    hs, nrs = [], []
                    for n in pairs:
                        x = engine.blocks[n].captured()[0][0]
                        hs.append(x)
                        nr_inds, _ = RoutingRule.from_block(engine.blocks[n + 1]).select(
                            router_logits(engine.blocks[n + 1], x), top_k)
                        nrs.append(nr_inds)
                    ind = [b.captured()[1][0] for b in blocks]
                    hs, nrs, ind = mx.stack(hs, 1), mx.stack(nrs, 1), mx.stack(ind, 1)
                    mx.eval(logits, hs, nrs, ind, [c.state for c in engine.cache])
                    a, z = start + s, start + s + len(piece)
                    h[a:z] = np.clip(np.array(hs.astype(mx.float32)), -65000, 65000)
                    nr[a:z] = np.array(nrs).astype(np.int16)
                    inds[a:z] = np.array(ind).astype(np.int16)
                    bar.update(len(piece))
                h.flush(), nr.flush(), inds.flush()
                _write_json(store.dir / "progress.json", {"docs_done": d + 1})
        finally:
            bar.close()
            for b in blocks:
                b.set_capture(False)
    finally:
        engine.close()


def _tokenize(engine, docs: list[Document], opts: TrainOptions) -> list[tuple[str, list[int]]]:
    out, budget = [], opts.max_tokens
    for doc in docs:
        if budget < 2:
            break
        toks = _encode_prefix(engine.tokenizer, doc.text, min(opts.max_doc_tokens, budget))
        if len(toks) < 2:
            continue
        out.append((doc.name, toks))
        budget -= len(toks)
    return out


def _encode_prefix(tokenizer, text: str, n: int) -> list[int]:
    """The first n tokens of `text`, encoding only a growing character prefix (big files)."""
    chars = 8 * n
    while True:
        if chars >= len(text):
            return list(tokenizer.encode(text))[:n]
        toks = list(tokenizer.encode(text[:chars]))
        if len(toks) > n + 32:   # tokens near the cut may differ from a full encoding
            return toks[:n]
        chars *= 2


# -- training data ------------------------------------------------------------------------------

def split_documents(n_docs: int, holdout: float, seed: int) -> tuple[list[int], list[int]]:
    """(train doc ids, held-out doc ids): a seeded shuffle, at least one document each."""
    order = list(range(n_docs))
    random.Random(seed).shuffle(order)
    n_hold = min(n_docs - 1, max(1, round(holdout * n_docs)))
    return sorted(order[n_hold:]), sorted(order[:n_hold])


def positions(docs: list, ids: list[int]) -> np.ndarray:
    """Token positions t with t+1 in the same document (features at t, target at t+1)."""
    parts = [np.arange(docs[i][1], docs[i][1] + docs[i][2] - 1) for i in ids]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


class Batches:
    """Gathers [O, B, ...] arrays for token positions from the store (numpy, then MLX)."""

    def __init__(self, store: FeatureStore, owners: list[int]):
        meta = store.meta
        self.store = store
        self.num_experts = meta["num_experts"]
        self.k = meta["top_k"]
        pair_pos = {n: i for i, n in enumerate(meta["pairs"])}
        moe_pos = {n: i for i, n in enumerate(meta["moe_layers"])}
        self.owner_p = np.array([pair_pos[n] for n in owners])
        self.owner_m = np.array([moe_pos[n] for n in owners])
        self.consumer_m = np.array([moe_pos[n + 1] for n in owners])
        first = np.zeros(meta["tokens"], dtype=bool)
        for _, start, _ in meta["docs"]:
            first[start] = True
        self.first = first

    def get(self, t: np.ndarray) -> dict:
        s = self.store
        h = np.asarray(s.h[t])[:, self.owner_p]                      # [B, O, H]
        rows = np.asarray(s.inds[t])                                # [B, M, K]
        prev_rows = np.asarray(s.inds[np.maximum(t - 1, 0)])
        nxt = np.asarray(s.inds[t + 1])[:, self.consumer_m]           # target
        cur = rows[:, self.owner_m]
        prev = prev_rows[:, self.owner_m].astype(np.int32)
        prev[self.first[t]] = -1                                    # first token: zeros
        tr = lambda a: mx.array(np.ascontiguousarray(np.swapaxes(a, 0, 1)))  # noqa: E731
        return {"h": tr(h).astype(mx.float32), "cur": tr(cur.astype(np.int32)),
                "prev": tr(prev), "target": tr(nxt.astype(np.int32)),
                "prev_token": tr(rows[:, self.consumer_m].astype(np.int32)),
                "next_router": tr(np.asarray(s.nr[t])[:, self.owner_p].astype(np.int32))}

    def features(self, batch: dict) -> mx.array:
        e = self.num_experts
        return mx.concatenate([batch["h"], onehot(batch["cur"], e), onehot(batch["prev"], e)],
                              axis=-1)


def loss_fn(heads: PrerouterHeads, feats: mx.array, target: mx.array) -> mx.array:
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


def lr_at(step: int, opts: TrainOptions) -> float:
    """Linear warmup over min(50, steps/10) steps, then cosine to 10% of --lr."""
    warm = max(1, min(50, opts.steps // 10))
    if step < warm:
        return opts.lr * (step + 1) / warm
    frac = (step - warm) / max(1, opts.steps - warm)
    return opts.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def recall(pred: mx.array, true: mx.array, num_experts: int) -> mx.array:
    """|pred & true| / K per row: [..., K] x [..., K] -> [...]."""
    k = true.shape[-1]
    return (onehot(pred, num_experts) * onehot(true, num_experts)).sum(axis=-1) / k


def evaluate(heads_list: dict, batches: Batches, rule: RoutingRule, pos: np.ndarray,
             chunk: int = 4096) -> dict:
    """Mean recall per owner for each heads in `heads_list` and for the two baselines."""
    e, k = batches.num_experts, batches.k
    sums = {name: 0.0 for name in list(heads_list) + ["prev_token", "next_router"]}
    n = 0
    for a in range(0, len(pos), chunk):
        b = batches.get(pos[a: a + chunk])
        feats = batches.features(b)
        got = {"prev_token": recall(b["prev_token"], b["target"], e).sum(axis=1),
               "next_router": recall(b["next_router"], b["target"], e).sum(axis=1)}
        for name, heads in heads_list.items():
            pred, _ = rule.select(heads(feats), k)
            got[name] = recall(pred, b["target"], e).sum(axis=1)
        mx.eval(got)
        for name, value in got.items():
            sums[name] = sums[name] + np.array(value, dtype=np.float64)
        n += len(pos[a: a + chunk])
    return {name: (value / max(1, n)).tolist() for name, value in sums.items()} | {"samples": n}


# -- checkpoint ---------------------------------------------------------------------------------

def save_state(path: Path, heads: PrerouterHeads, optimizer, step: int, fingerprint: dict,
               losses: list[float]) -> None:
    from mlx.utils import tree_flatten

    save_training_state(path, dict(tree_flatten(heads.parameters())), optimizer,
                        {"step": step, "fingerprint": fingerprint, "losses": losses[-10000:]})


def load_state(path: Path) -> tuple[dict, dict, int, dict, list]:
    heads, opt, meta = load_training_state(path)
    return heads, opt, int(meta["step"]), meta.get("fingerprint", {}), meta.get("losses", [])


class Interrupted(Exception):
    """Raised by the test hook `stop_after`: a simulated kill after that step."""


# -- main ---------------------------------------------------------------------------------------

def report_paths(out: Path) -> tuple[Path, Path]:
    stem = out.name[: -len(".safetensors")] if out.name.endswith(".safetensors") else out.name
    return out.with_name(f"{stem}.report.json"), out.with_name(f"{stem}.report.md")


def train_prerouter(opts: TrainOptions, stop_after: int | None = None) -> dict:
    """The whole stage; returns the report dict. `stop_after` (tests): raise after that step."""
    import mlx.optimizers as optim
    from tqdm import tqdm

    opts.validate()
    model = Path(opts.model)
    out = Path(opts.out)
    facts = model_facts(model)
    top_k, owners, width = resolve_heads(opts, facts)
    ckpt = Path(f"{out}.ckpt")
    store = FeatureStore(ckpt / "features")
    state_path = ckpt / STATE_NAME

    data_fp = data_fingerprint(opts, top_k)
    if opts.resume and not state_path.is_file():
        raise CheckpointError(f"--resume: no training checkpoint at {state_path}")
    if state_path.is_file():
        if opts.fresh:
            state_path.unlink()
        elif not store.matches(data_fp):
            raise CheckpointError(
                f"{ckpt} holds a training checkpoint for another model, texts, K or token "
                f"limits; rerun with --fresh to start over (or choose another --out)")
    if not (store.matches(data_fp) and store.complete):
        collect_features(opts, store, data_fp, top_k)
    store.open()
    meta = store.meta

    train_fp = {"data": _digest(data_fp), "owners": owners, "width": width, "top_k": top_k,
                "steps": opts.steps, "lr": opts.lr, "batch": opts.batch,
                "holdout": opts.holdout, "seed": opts.seed}
    config = PrerouterConfig(owners=owners, start_layer=owners[0] + 1, width=width, top_k=top_k,
                             hidden=meta["hidden"], num_experts=meta["num_experts"])
    routers = store.routers()
    heads = heads_from_router_weights(config, [routers[f"router.{n + 1}"] for n in owners],
                                      [routers.get(f"router_bias.{n + 1}") for n in owners],
                                      opts.seed)
    init = heads.astype(mx.float32)
    optimizer = optim.Adam(learning_rate=lr_at(0, opts))
    optimizer.init(heads.trainable_parameters())
    step, losses = 0, []
    if state_path.is_file():   # --fresh removed it above
        params, opt_state, step, fp, losses = load_state(state_path)
        if fp != train_fp:
            diff = sorted(k for k in set(fp) | set(train_fp) if fp.get(k) != train_fp.get(k))
            raise CheckpointError(
                f"{state_path} was written with other settings ({', '.join(diff)} differ); "
                f"rerun the original command to resume, or add --fresh to start over")
        heads.update({k: params[k] for k in ("fc1", "fc2", "linear")})
        optimizer.state = opt_state
        mx.eval(heads.parameters(), optimizer.state)
        print(f"train-prerouter: resuming from {state_path} at step {step}/{opts.steps}",
              flush=True)

    train_docs, held_docs = split_documents(len(meta["docs"]), opts.holdout, opts.seed)
    train_pos = positions(meta["docs"], train_docs)
    held_pos = positions(meta["docs"], held_docs)
    if len(train_pos) == 0 or len(held_pos) == 0:
        raise ConfigError("not enough tokens for both a training and a held-out split")
    batches = Batches(store, owners)
    rule = store.rule([n + 1 for n in owners])
    value_and_grad = nn.value_and_grad(heads, loss_fn)

    bar = tqdm(total=opts.steps, initial=step, desc="train prerouter", unit="step",
               disable=not opts.progress)
    ema = None
    started = time.perf_counter()
    try:
        while step < opts.steps:
            rows = np.random.default_rng([opts.seed, step]).integers(0, len(train_pos), opts.batch)
            b = batches.get(np.sort(train_pos[rows]))
            optimizer.learning_rate = lr_at(step, opts)
            loss, grads = value_and_grad(heads, batches.features(b), b["target"])
            optimizer.update(heads, grads)
            mx.eval(heads.parameters(), optimizer.state, loss)
            step += 1
            value = float(loss.item())
            losses.append(value)
            ema = value if ema is None else 0.95 * ema + 0.05 * value
            bar.update(1)
            bar.set_postfix(loss=f"{ema:.4f}")
            if step % opts.ckpt_every == 0 or step == opts.steps:
                save_state(state_path, heads, optimizer, step, train_fp, losses)
            if stop_after is not None and step >= stop_after:
                raise Interrupted(f"stopped after step {step}")
    finally:
        bar.close()
    train_seconds = time.perf_counter() - started

    save_dtype = getattr(mx, opts.save_dtype)
    source = {"stage": "train-prerouter", "texts": [Path(t).name for t in opts.texts],
              "docs_train": len(train_docs), "docs_heldout": len(held_docs), "steps": opts.steps,
              "lr": opts.lr, "batch": opts.batch, "seed": opts.seed, "loss": "softmax-ce-khot"}
    save_heads(out, heads, {"source": source, "model": model.resolve().name},
               dtype=save_dtype)
    saved = load_heads(out, hidden=meta["hidden"], num_experts=meta["num_experts"], top_k=top_k,
                       owners=owners, dtype=mx.float32)      # evaluate what was written

    held = evaluate({"heads": saved, "init": init}, batches, rule, held_pos)
    cap = np.random.default_rng([opts.seed, 1 << 40]).permutation(train_pos)[:20000]
    train_eval = evaluate({"heads": saved}, batches, rule, np.sort(cap))
    report = _report(opts, meta, config, held, train_eval, losses, train_docs, held_docs,
                     train_pos, held_pos, train_seconds, out)
    json_path, md_path = report_paths(out)
    _write_json(json_path, report)
    md_path.write_text(_markdown(report))
    print(_markdown(report))
    print(f"wrote {out}, {json_path}, {md_path}")
    return report


def _report(opts, meta, config, held, train_eval, losses, train_docs, held_docs, train_pos,
            held_pos, seconds, out) -> dict:
    layers = []
    for i, n in enumerate(config.owners):
        row = {"owner": n, "consumer": n + 1, "recall_heads": held["heads"][i],
               "recall_prev_token": held["prev_token"][i],
               "recall_next_router": held["next_router"][i],
               "recall_untrained_heads": held["init"][i],
               "recall_heads_train": train_eval["heads"][i]}
        row["beats_baselines"] = row["recall_heads"] > max(row["recall_prev_token"],
                                                           row["recall_next_router"])
        layers.append(row)
    mean = lambda key: float(np.mean([r[key] for r in layers]))  # noqa: E731
    tail = losses[-max(1, min(50, len(losses) // 10)):]
    return {
        "heads": str(out), "model": str(Path(opts.model).resolve()),
        "model_type": meta["model_type"], "top_k": config.top_k, "owners": config.owners,
        "start_layer": config.start_layer, "width": config.width, "hidden": config.hidden,
        "num_experts": config.num_experts, "selection_rule": meta["rule"],
        "recall_definition": "|predicted top-K & true executed top-K| / K, layer N+1 at token "
                             "t+1 from layer N's features at token t; held-out documents",
        "baselines": {"prev_token": "layer N+1's executed set at token t",
                      "next_router": "layer N+1's router on layer N's MoE input at token t, "
                                     "family selection rule"},
        "data": {"texts": opts.texts, "documents": len(meta["docs"]),
                 "docs_train": len(train_docs), "docs_heldout": len(held_docs),
                 "samples_train": int(len(train_pos)), "samples_heldout": int(len(held_pos)),
                 "tokens": meta["tokens"], "split": "by document, seeded shuffle",
                 "jsonl_fields": "text, else prompt + completion"},
        "training": {"steps": opts.steps, "lr": opts.lr, "batch": opts.batch, "seed": opts.seed,
                     "loss": "softmax cross-entropy vs normalised K-hot target",
                     "final_loss": float(np.mean(tail)) if tail else None,
                     "first_loss": losses[0] if losses else None,
                     "seconds_this_run": seconds},
        "layers": layers,
        "mean": {key: mean(key) for key in ("recall_heads", "recall_prev_token",
                                            "recall_next_router", "recall_untrained_heads",
                                            "recall_heads_train")},
        "all_layers_beat_baselines": all(r["beats_baselines"] for r in layers),
    }


def _markdown(r: dict) -> str:
    lines = [f"# Prerouter heads: {Path(r['heads']).name}", "",
             f"Model `{r['model_type']}` ({Path(r['model']).name}), K={r['top_k']}, owners "
             f"{r['owners'][0]}..{r['owners'][-1]} ({len(r['owners'])} heads), width "
             f"{r['width']}, {r['training']['steps']} steps. Held-out: "
             f"{r['data']['docs_heldout']} documents / {r['data']['samples_heldout']} tokens "
             f"(train {r['data']['docs_train']} / {r['data']['samples_train']}).", "",
             "Top-K recall of layer N+1's executed experts at token t+1 (held out):", "",
             "| owner N | consumer N+1 | heads | prev-token baseline | next-router baseline | "
             "untrained heads | heads (train) | beats both |",
             "|---:|---:|---:|---:|---:|---:|---:|:---:|"]
    for row in r["layers"]:
        lines.append(f"| {row['owner']} | {row['consumer']} | {row['recall_heads']:.3f} | "
                     f"{row['recall_prev_token']:.3f} | {row['recall_next_router']:.3f} | "
                     f"{row['recall_untrained_heads']:.3f} | {row['recall_heads_train']:.3f} | "
                     f"{'yes' if row['beats_baselines'] else 'no'} |")
    m = r["mean"]
    lines.append(f"| mean | | {m['recall_heads']:.3f} | {m['recall_prev_token']:.3f} | "
                 f"{m['recall_next_router']:.3f} | {m['recall_untrained_heads']:.3f} | "
                 f"{m['recall_heads_train']:.3f} | "
                 f"{'all' if r['all_layers_beat_baselines'] else 'not all'} |")
    t = r["training"]
    if t["first_loss"] is not None:
        lines += ["", f"Loss (softmax CE vs normalised K-hot): {t['first_loss']:.4f} at step 1 "
                      f"-> {t['final_loss']:.4f} at the end."]
    return "\n".join(lines) + "\n"


# -- CLI ----------------------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = TrainOptions(model="", texts=[], out="")
    parser.add_argument("model", help="converted model directory (edge0-eval convert)")
    parser.add_argument("--text", nargs="+", required=True, metavar="FILE",
                        help="training text: plain files (one document each) or .jsonl (one "
                             "document per line: \"text\", else \"prompt\" + \"completion\")")
    parser.add_argument("--out", required=True, help="heads file to write (.safetensors); the "
                        "report goes next to it, checkpoints to <out>.ckpt/")
    parser.add_argument("--owners", nargs="+", default=None,
                        help="owner layers N (each predicts N+1): '6..38', '6-38', '6,7,8' or "
                             "a list (default: start_layer-1 .. n_layers-2, MoE pairs only)")
    parser.add_argument("--start-layer", type=int, default=None,
                        help="first consuming layer (35B tier 7, 8B tier 8; other models: "
                             "first MoE layer + 1)")
    parser.add_argument("--width", type=int, default=None,
                        help="fc1 width (tiers 512; other models min(512, 2 x hidden))")
    parser.add_argument("--top-k", type=int, default=None,
                        help="serving K (35B tier 4, 8B tier 8; other models: native top-k)")
    parser.add_argument("--steps", type=int, default=d.steps)
    parser.add_argument("--lr", type=float, default=d.lr)
    parser.add_argument("--batch", type=int, default=d.batch, help="tokens per step")
    parser.add_argument("--holdout", type=float, default=d.holdout,
                        help="fraction of documents held out for the report")
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--resume", action="store_true",
                        help="require an existing checkpoint (resuming is automatic anyway)")
    parser.add_argument("--fresh", action="store_true",
                        help="discard the training checkpoint (features of the same data kept)")
    parser.add_argument("--ckpt-every", type=int, default=d.ckpt_every,
                        help="steps between checkpoints")
    parser.add_argument("--max-doc-tokens", type=int, default=d.max_doc_tokens,
                        help="tokens kept per document (from its start)")
    parser.add_argument("--max-tokens", type=int, default=d.max_tokens,
                        help="total tokens collected over all documents")
    parser.add_argument("--expert-budget-mib", type=float, default=None,
                        help="engine expert slot budget while collecting (default 2K slots/layer)")
    parser.add_argument("--save-dtype", default=d.save_dtype,
                        help="dtype of the written heads: float16 | bfloat16 | float32")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.epilog = (
        "Resume rule: checkpoints go to <out>.ckpt/ every --ckpt-every steps; running the same "
        "command again continues from the last one automatically (bit-identical to an "
        "uninterrupted run). Changed training settings with an existing checkpoint are an "
        "error unless --fresh; --resume only insists that a checkpoint exists. Features "
        "collected from the model are reused while model, texts, K and token limits match.")


def run(args: argparse.Namespace) -> int:
    opts = TrainOptions(
        model=args.model, texts=list(args.text), out=args.out, owners=parse_owners(args.owners),
        start_layer=args.start_layer, width=args.width, top_k=args.top_k, steps=args.steps,
        lr=args.lr, batch=args.batch, holdout=args.holdout, seed=args.seed, resume=args.resume,
        fresh=args.fresh, ckpt_every=args.ckpt_every, max_doc_tokens=args.max_doc_tokens,
        max_tokens=args.max_tokens, expert_budget_mib=args.expert_budget_mib,
        save_dtype=args.save_dtype, progress=not args.no_progress,
    )
    train_prerouter(opts)
    return 0
