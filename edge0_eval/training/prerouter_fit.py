"""Stage 1 (`edge0-eval train-prerouter`): distil prerouter heads from the model's true routing.

    edge0-eval train-prerouter MODEL --text a.txt b.jsonl ... --out heads.safetensors

1. Collect (teacher = the model itself, run by the engine in reactive mode at the serving K, so
   routing is the exact executed top-K). For every document, every MoE layer's input (the
   post-attention norm output) and executed top-K ids are recorded per token, plus the
   "next router on the current hidden" baseline. Features at token t for owner N are paired
   with layer N+1's executed set at token t+1 (the next token), within a document; the
   wrap-around pair (owner = the last MoE layer, `--start-layer 0`) with the first MoE layer's
   executed set at token t+1.
2. Train all heads together with MLX (Adam, warmup + cosine) on softmax cross-entropy against
   the normalised K-hot target of the true set (see `losses.khot_cross_entropy` for why not BCE).
3. Report top-K recall (|predicted & true| / K) per owner on held-out documents, next to two
   baselines: the consumer's routing of the previous token, and the consumer's router applied
   to the owner's hidden state (for the wrap-around head: the first MoE layer's router on the
   last layer's input); JSON + markdown next to --out.

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

import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten
from tqdm import tqdm

from edge0_eval.engine.heads import (
    default_consumers,
    heads_from_router_weights,
    load_heads,
    save_heads,
)
from edge0_eval.engine.routing import RoutingRule
from edge0_eval.errors import CheckpointError, ConfigError
from edge0_eval.formats.heads_file import PrerouterConfig
from edge0_eval.training.corpus import split_documents, subset_documents
from edge0_eval.training.features import (
    Batches,
    FeatureStore,
    collect_features,
    data_fingerprint,
    ensure_embeddings,
    positions,
)
from edge0_eval.training.losses import khot_cross_entropy, recall
from edge0_eval.training.models import model_facts, resolve_heads
from edge0_eval.training.stage_options import PrerouterOptions
from edge0_eval.training.state import (
    after_step,
    announce_resume,
    begin,
    check_fingerprint,
    digest,
    load_training_state,
    report_paths,
    save_training_state,
    write_json,
)
from edge0_eval.training.trainer import warmup_cosine

STATE_NAME = "train_state.safetensors"


def train_prerouter(
    opts: PrerouterOptions, stop_after: int | None = None, kill_after: int | None = None
) -> dict:
    """The whole stage; returns the report dict. Test hooks (state.after_step): `stop_after`
    raises Interrupted after that step, `kill_after` SIGKILLs the process."""
    opts.validate()
    out = Path(opts.out)
    facts = model_facts(Path(opts.model))
    experts_per_token, owners, width = resolve_heads(
        facts,
        experts_per_token=opts.experts_per_token,
        owners=opts.owners,
        start_layer=opts.start_layer,
        width=opts.width,
    )
    ckpt = Path(f"{out}.ckpt")
    store = FeatureStore(ckpt / "features")
    state_path = ckpt / STATE_NAME
    data_fp = data_fingerprint(opts, experts_per_token)
    begin(state_path, opts.resume, opts.fresh)
    if state_path.is_file() and not store.matches(data_fp):
        raise CheckpointError(
            f"{ckpt} holds a training checkpoint for another model, texts, K or token "
            f"limits; rerun with --fresh to start over (or choose another --out)"
        )
    if not (store.matches(data_fp) and store.complete and store.covers(owners)):
        collect_features(opts, store, data_fp, experts_per_token, owners)
    if opts.next_token:
        ensure_embeddings(opts, store, experts_per_token)
    store.open()
    config = PrerouterConfig(
        owners=owners,
        width=width,
        experts_per_token=experts_per_token,
        hidden=store.meta["hidden"],
        num_experts=store.meta["num_experts"],
        consumers=default_consumers(owners, facts.moe_layers),
        next_token=opts.next_token,
    )
    split = _split(opts, store.meta)
    batches = Batches(store, owners, next_token=opts.next_token)
    heads, init, train_seconds, losses = _fit(
        opts, config, store, batches, split, state_path, data_fp, stop_after, kill_after
    )
    saved = _save(opts, heads, store.meta, config, split)
    rule = store.rule(config.consumers)
    held = evaluate({"heads": saved, "init": init}, batches, rule, split["held_pos"])
    cap = np.random.default_rng([opts.seed, 1 << 40]).permutation(split["train_pos"])
    train_eval = evaluate({"heads": saved}, batches, rule, np.sort(cap[:20000]))
    report = _report(opts, store.meta, config, held, train_eval, losses, split)
    report["training"]["seconds_this_run"] = train_seconds
    report["collection"] = store.collection()
    json_path, md_path = report_paths(out)
    write_json(json_path, report)
    md_path.write_text(_markdown(report))
    print(_markdown(report))
    print(f"wrote {out}, {json_path}, {md_path}")
    return report


def _split(opts: PrerouterOptions, meta: dict) -> dict:
    """Training and held-out documents (by document, seeded) and their positions."""
    train_docs, held_docs = split_documents(len(meta["docs"]), opts.holdout, opts.seed)
    if opts.train_tokens is not None:
        train_docs = subset_documents(
            train_docs, [d[2] for d in meta["docs"]], opts.train_tokens, opts.seed
        )
    split = {
        "train_docs": train_docs,
        "held_docs": held_docs,
        "train_pos": positions(meta["docs"], train_docs),
        "held_pos": positions(meta["docs"], held_docs),
    }
    if len(split["train_pos"]) == 0 or len(split["held_pos"]) == 0:
        raise ConfigError("not enough tokens for both a training and a held-out split")
    return split


def _train_fingerprint(opts: PrerouterOptions, data_fp: dict, config) -> dict:
    """What a saved training state must match to be resumed."""
    fp = {
        "data": digest(data_fp),
        "owners": config.owners,
        "width": config.width,
        "top_k": config.experts_per_token,
        "steps": opts.steps,
        "lr": opts.lr,
        "batch": opts.batch,
        "holdout": opts.holdout,
        "seed": opts.seed,
    }
    if opts.train_tokens is not None:  # absent otherwise: earlier states stay valid
        fp["train_tokens"] = opts.train_tokens
    if opts.next_token:
        fp["next_token"] = True
    return fp


def _fit(
    opts, config, store, batches, split, state_path, data_fp, stop_after, kill_after
):
    """(heads, their float32 initial copy, seconds, losses): heads warm-started from the
    consumers' routers, resumed from `state_path` when it holds a state, then trained."""
    train_fp = _train_fingerprint(opts, data_fp, config)
    routers = store.routers()
    heads = heads_from_router_weights(
        config,
        [routers[f"router.{c}"] for c in config.consumers],
        [routers.get(f"router_bias.{c}") for c in config.consumers],
        opts.seed,
    )
    init = heads.astype(mx.float32)
    optimizer = optim.Adam(learning_rate=warmup_cosine(0, opts.steps, opts.lr))
    optimizer.init(heads.trainable_parameters())
    step, losses = 0, []
    if state_path.is_file():  # --fresh removed it above
        params, opt_state, state_meta = load_training_state(state_path)
        check_fingerprint(state_path, state_meta.get("fingerprint", {}), train_fp)
        step, losses = int(state_meta["step"]), state_meta.get("losses", [])
        heads.update({k: params[k] for k in ("fc1", "fc2", "linear")})
        optimizer.state = opt_state
        mx.eval(heads.parameters(), optimizer.state)
        announce_resume("train-prerouter", state_path, step, opts.steps)
    value_and_grad = nn.value_and_grad(heads, khot_cross_entropy)
    train_pos = split["train_pos"]
    bar = tqdm(
        total=opts.steps,
        initial=step,
        desc="train prerouter",
        unit="step",
        disable=not opts.progress,
    )
    ema, started = None, time.perf_counter()
    try:
        while step < opts.steps:
            rows = np.random.default_rng([opts.seed, step]).integers(
                0, len(train_pos), opts.batch
            )
            b = batches.get(np.sort(train_pos[rows]))
            optimizer.learning_rate = warmup_cosine(step, opts.steps, opts.lr)
            loss, grads = value_and_grad(heads, batches.features(b), b["target"])
            optimizer.update(heads, grads)
            mx.eval(heads.parameters(), optimizer.state, loss)
            step += 1
            losses.append(float(loss.item()))
            ema = losses[-1] if ema is None else 0.95 * ema + 0.05 * losses[-1]
            bar.update(1)
            bar.set_postfix(loss=f"{ema:.4f}")
            if step % opts.ckpt_every == 0 or step == opts.steps:
                save_training_state(
                    state_path,
                    dict(tree_flatten(heads.parameters())),
                    optimizer,
                    {"step": step, "fingerprint": train_fp, "losses": losses[-10000:]},
                )
            after_step(step, stop_after, kill_after)
    finally:
        bar.close()
    return heads, init, time.perf_counter() - started, losses


def _save(opts: PrerouterOptions, heads, meta: dict, config, split: dict) -> object:
    """Write the heads file, and read it back (what is evaluated is what was written)."""
    source = {
        "stage": "train-prerouter",
        "texts": [Path(t).name for t in opts.texts],
        "docs_train": len(split["train_docs"]),
        "docs_heldout": len(split["held_docs"]),
        "steps": opts.steps,
        "lr": opts.lr,
        "batch": opts.batch,
        "seed": opts.seed,
        "loss": "softmax-ce-khot",
    }
    save_heads(
        opts.out,
        heads,
        {
            "source": source,
            "model": Path(opts.model).resolve().name,
            "model_type": meta["model_type"],
        },
        dtype=getattr(mx, opts.save_dtype),
    )
    return load_heads(
        opts.out,
        hidden=meta["hidden"],
        num_experts=meta["num_experts"],
        experts_per_token=config.experts_per_token,
        owners=config.owners,
        dtype=mx.float32,
    )


def evaluate(
    heads_list: dict,
    batches: Batches,
    rule: RoutingRule,
    pos: np.ndarray,
    chunk: int = 4096,
) -> dict:
    """Mean recall per owner for each heads in `heads_list` and for the baselines (next-token
    heads: also the consumer's router on the next token's embedding)."""
    e, k = batches.num_experts, batches.k
    baselines = ["prev_token", "next_router"] + (
        ["token_router"] if batches.next_token else []
    )
    sums = {name: 0.0 for name in list(heads_list) + baselines}
    n = 0
    for a in range(0, len(pos), chunk):
        b = batches.get(pos[a : a + chunk])
        feats = batches.features(b)
        got = {
            "prev_token": recall(b["prev_token"], b["target"], e).sum(axis=1),
            "next_router": recall(b["next_router"], b["target"], e).sum(axis=1),
        }
        if batches.next_token:
            pred, _ = rule.select(batches.token_router_logits(b), k)
            got["token_router"] = recall(pred, b["target"], e).sum(axis=1)
        for name, heads in heads_list.items():
            pred, _ = rule.select(heads(feats), k)
            got[name] = recall(pred, b["target"], e).sum(axis=1)
        mx.eval(got)
        for name, value in got.items():
            sums[name] = sums[name] + np.array(value, dtype=np.float64)
        n += len(pos[a : a + chunk])
    return {name: (value / max(1, n)).tolist() for name, value in sums.items()} | {
        "samples": n
    }


def _report(opts, meta, config, held, train_eval, losses, split) -> dict:
    layers = _layer_rows(config, held, train_eval)
    mean = lambda key: float(np.mean([r[key] for r in layers if key in r]))  # noqa: E731
    tail = losses[-max(1, min(50, len(losses) // 10)) :]
    return {
        "heads": str(Path(opts.out)),
        "model": str(Path(opts.model).resolve()),
        "model_type": meta["model_type"],
        "top_k": config.experts_per_token,
        "owners": config.owners,
        "start_layer": config.start_layer,
        "width": config.width,
        "hidden": config.hidden,
        "num_experts": config.num_experts,
        "selection_rule": meta["rule"],
        "consumers": config.consumers,
        "recall_definition": RECALL_DEFINITION,
        "features": "next_token" if config.next_token else "context",
        "baselines": _baselines(config.next_token),
        "data": {
            "texts": opts.texts,
            "documents": len(meta["docs"]),
            "docs_train": len(split["train_docs"]),
            "docs_heldout": len(split["held_docs"]),
            "samples_train": int(len(split["train_pos"])),
            "samples_heldout": int(len(split["held_pos"])),
            "tokens": meta["tokens"],
            "split": "by document, seeded shuffle",
            "train_tokens_cap": opts.train_tokens,
            "jsonl_fields": "text, else prompt + completion",
        },
        "training": {
            "steps": opts.steps,
            "lr": opts.lr,
            "batch": opts.batch,
            "seed": opts.seed,
            "loss": "softmax cross-entropy vs normalised K-hot target",
            "final_loss": float(np.mean(tail)) if tail else None,
            "first_loss": losses[0] if losses else None,
        },
        "layers": layers,
        # every recall figure the rows hold, in their order
        "mean": {
            key: mean(key)
            for key in dict.fromkeys(k for r in layers for k in r if "recall_" in k)
        },
        "all_layers_beat_baselines": all(r["beats_baselines"] for r in layers),
    }


RECALL_DEFINITION = (
    "|predicted top-K & true executed top-K| / K, the consumer (layer N+1; the "
    "wrap-around head's: the first MoE layer) at token t+1 from owner N's features at "
    "token t; held-out documents"
)


def _baselines(next_token: bool) -> dict:
    """What each baseline the heads are compared with predicts from."""
    out = {
        "prev_token": "the consumer's executed set at token t",
        "next_router": "the consumer's router on the owner's MoE input at token "
        "t, family selection rule",
    }
    if next_token:
        out["token_router"] = (
            "the consumer's router on the input embedding of token t+1 "
            "(next-token heads only), family selection rule"
        )
    return out


def _layer_rows(config, held: dict, train_eval: dict) -> list[dict]:
    """Per head: held-out recall of the heads, the baselines and the untrained heads."""
    layers = []
    for i, (n, c) in enumerate(zip(config.owners, config.consumers)):
        row = {
            "owner": n,
            "consumer": c,
            "wrap_around": c != n + 1,
            "recall_heads": held["heads"][i],
            "recall_prev_token": held["prev_token"][i],
            "recall_next_router": held["next_router"][i],
            "recall_untrained_heads": held["init"][i],
            "recall_heads_train": train_eval["heads"][i],
        }
        if "token_router" in held:
            row["recall_token_router"] = held["token_router"][i]
        baselines = ("recall_prev_token", "recall_next_router", "recall_token_router")
        row["beats_baselines"] = row["recall_heads"] > max(
            row[key] for key in baselines if key in row
        )
        layers.append(row)
    return layers


def _markdown(r: dict) -> str:
    token = "recall_token_router" in r["mean"]
    lines = [
        f"# Prerouter heads: {Path(r['heads']).name}",
        "",
        f"Model `{r['model_type']}` ({Path(r['model']).name}), K={r['top_k']}, owners "
        f"{r['owners'][0]}..{r['owners'][-1]} ({len(r['owners'])} heads), width "
        f"{r['width']}, {r.get('features', 'context')} features, "
        f"{r['training']['steps']} steps. Held-out: "
        f"{r['data']['docs_heldout']} documents / {r['data']['samples_heldout']} tokens "
        f"(train {r['data']['docs_train']} / {r['data']['samples_train']}).",
        "",
        "Top-K recall of the consumer's executed experts at token t+1 (held out; consumer "
        "N+1, or the first MoE layer for the wrap-around head, marked (wrap)):",
        "",
        "| owner N | consumer | heads | prev-token baseline | next-router baseline | "
        + ("next-token router baseline | " if token else "")
        + f"untrained heads | heads (train) | beats {'all' if token else 'both'} |",
        "|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if token else "") + ":---:|",
    ]
    keys = (
        ["recall_heads", "recall_prev_token", "recall_next_router"]
        + (["recall_token_router"] if token else [])
        + ["recall_untrained_heads", "recall_heads_train"]
    )
    for row in r["layers"]:
        wrap = " (wrap)" if row.get("wrap_around") else ""
        cells = " | ".join(f"{row[key]:.3f}" if key in row else "-" for key in keys)
        lines.append(
            f"| {row['owner']} | {row['consumer']}{wrap} | {cells} | "
            f"{'yes' if row['beats_baselines'] else 'no'} |"
        )
    m = r["mean"]
    cells = " | ".join(f"{m[key]:.3f}" for key in keys)
    lines.append(
        f"| mean | | {cells} | "
        f"{'all' if r['all_layers_beat_baselines'] else 'not all'} |"
    )
    c = r.get("collection") or {}
    runs = c.get("runs") or []
    if runs:
        tokens = sum(x["tokens"] for x in runs)
        seconds = sum(x["seconds"] for x in runs)
        lines += [
            "",
            f"Collected with the {c.get('path', 'served')} path: {tokens} tokens in "
            f"{seconds:.0f} s ({tokens / max(seconds, 1e-9):.1f} tok/s).",
        ]
    if c.get("check"):
        k = c["check"]
        lines.append(
            f"Float32 check against the served path on {k['tokens']} tokens: top-K "
            f"agreement mean {k['mean_agreement']:.4f}, worst "
            f"{k['worst_agreement']:.4f} (layer {k['worst_layer']}, required "
            f"{k['min_agreement']}); feature max relative difference "
            f"{k['feature_max_rel_diff']:.2e}; {k['served_tok_s']:.1f} (served) vs "
            f"{k['float32_tok_s']:.1f} (float32) tok/s."
        )
    t = r["training"]
    if t["first_loss"] is not None:
        lines += [
            "",
            f"Loss (softmax CE vs normalised K-hot): {t['first_loss']:.4f} at step 1 "
            f"-> {t['final_loss']:.4f} at the end.",
        ]
    return "\n".join(lines) + "\n"
