"""Prerouter heads: owner layer N predicts its consumer's routing for the *next* token.

Features of owner N at token t (hidden + 2E): layer N's MoE input h_N(t), the one-hot of its
executed top-k at t, and at t-1. Next-token heads (`next_token`, heads-file metadata
features="next_token") append the input embedding of token t+1 (2 x hidden + 2E): it predicts
most, but their plan waits for the sampled token. Head: logits = fc2(gelu_erf(fc1(x))) +
linear(x), no biases (the published layout; formats/heads_file.py). All heads run in one
batched computation (`PrerouterHeads`, routing.py, with the features and the staging):
fc1 [O, width, in], fc2 [O, E, width], linear [O, E, in], feats [O, B, in] -> logits [O, B, E].

This module holds the heads' files and defaults: owners and consumers, the tiers, reading and
writing heads (`load_heads`, `save_heads`), the warm start from the routers, and attaching heads
to an engine (`attach_prerouter`).

A head's consumer is owner + 1, except the wrap-around head's: the last MoE layer predicts the
first MoE layer of the next token (`default_consumers`), so every MoE layer's reads can start a
step early. Warm start: `linear` = the consumer's router (zero over the one-hot columns), fc2 = 0,
so an untrained head is the "next router on the current hidden state" baseline. Selection from
head logits is the consumer's family rule (its block's `rule`, routing.py).
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from edge0_eval.engine.draft import DraftHead
from edge0_eval.engine.mlx_compat import dequantized, resolve_compute_dtype
from edge0_eval.engine.routing import Prerouter, PrerouterHeads, stack_rules
from edge0_eval.errors import CheckpointError, ConfigError
from edge0_eval.formats.draft_file import is_draft_file, load_draft_vocab
from edge0_eval.formats.heads_file import (
    KIND,
    HeadsFile,
    PrerouterConfig,
    read_heads,
    read_metadata,
    write_heads,
)

# Reference tiers (shared/README.md): serving K, first consuming layer, fc1 width.
# The tiers start at 0: every MoE layer prerouted, the last one's wrap-around head predicting the
# first, not the reference heads' 7 (35B, owners 6..38) and 8 (8B, owners 7..22). On the
# real-weight testbed that cost no measurable fidelity with the router's weights and decodes
# fastest (reports/testbed/next_token.md). Other models start at the first MoE layer + 1, since
# a wrap head makes stages 2/3 discover routing position by position (training.served).
# Published heads load with their own owners either way.
_TIERS = {
    # (model_type, layers, hidden, experts): (K, start_layer, width)
    ("qwen3_5_moe", 40, 2048, 256): (4, 0, 512),
    ("bailing_hybrid", 24, 1536, 128): (8, 0, 512),  # layer 0 is dense: heads own 1..23
}


def tier_defaults(
    model_type: str, n_layers: int, hidden: int, num_experts: int, moe_layers: list[int]
) -> dict:
    """Defaults for experts_per_token (None = the model's native), start_layer and width.

    Known reference tiers get the reference K and width and start at 0 (every MoE layer, with
    the wrap-around head); other models start at the first MoE layer + 1 and get width
    min(512, 2 x hidden).
    """
    key = (model_type, n_layers, hidden, num_experts)
    if key in _TIERS:
        k, start, width = _TIERS[key]
        return {"experts_per_token": k, "start_layer": start, "width": width}
    start = (moe_layers[0] + 1) if moe_layers else 1
    return {
        "experts_per_token": None,
        "start_layer": start,
        "width": min(512, 2 * hidden),
    }


def default_owners(start_layer: int, n_layers: int, moe_layers: list[int]) -> list[int]:
    """owners = range(start_layer - 1, n_layers - 1), keeping N with N and N+1 both MoE.

    A start_layer at or before the first MoE layer (0 means "every MoE layer") also adds the
    wrap-around owner, the last MoE layer, whose head predicts the first MoE layer.
    """
    moe = set(moe_layers)
    owners = [
        n
        for n in range(max(0, start_layer - 1), n_layers - 1)
        if n in moe and n + 1 in moe
    ]
    if moe_layers and start_layer <= min(moe_layers) and max(moe_layers) not in owners:
        owners.append(max(moe_layers))
    return owners


def default_consumers(owners: list[int], moe_layers: list[int]) -> list[int]:
    """The layer each owner predicts: owner + 1, except the last MoE layer (the wrap-around
    head), which predicts the first MoE layer of the next token."""
    moe = sorted(moe_layers)
    return [moe[0] if moe and n == moe[-1] else n + 1 for n in owners]


def pair_problems(
    owners: list[int], consumers: list[int], moe_layers: list[int]
) -> list[str]:
    """Why (owner, consumer) pairs cannot serve this model; [] when they all can."""
    moe = sorted(moe_layers)
    problems = []
    for n, c in zip(owners, consumers):
        if n not in moe or c not in moe:
            problems.append(f"owner {n} -> layer {c}: they must both be MoE layers")
        elif c != n + 1 and not (n == moe[-1] and c == moe[0]):
            problems.append(
                f"owner {n} -> layer {c}: a head predicts layer owner + 1, or (the "
                f"wrap-around head, owner {moe[-1]}) the first MoE layer {moe[0]}"
            )
    if len(set(consumers)) != len(consumers):
        problems.append(f"consumers {consumers} repeat a layer")
    return problems


def check_owners(
    owners: list[int], moe_layers: list[int], consumers: list[int] | None = None
) -> list[int]:
    """Owners must be distinct and pair validly with their consumers (parallel to `owners`;
    default `default_consumers`). A sorted copy of the owners."""
    raw = [int(n) for n in owners]
    if not raw:
        raise ConfigError(
            "no prerouter owners: the model has no MoE layer followed by another "
            "(check --owners / --start-layer)"
        )
    if len(set(raw)) != len(raw):
        raise ConfigError(f"owners {sorted(raw)} has duplicates")
    consumers = default_consumers(raw, moe_layers) if consumers is None else consumers
    problems = pair_problems(raw, [int(c) for c in consumers], moe_layers)
    if problems:
        raise ConfigError(
            f"prerouter heads cannot serve this model: {'; '.join(problems)} "
            f"(MoE layers: {moe_layers})"
        )
    return sorted(raw)


def load_heads(
    path: str | Path, *, moe_layers: list[int] | None = None, **model
) -> PrerouterHeads:
    """Heads from the file at `path`, checked by formats/heads_file.py's `read_heads` against
    the `model` it is given there (`hidden`, `num_experts`, `experts_per_token`, and optional
    `owners`, `dtype`, `model_type`: see there); `moe_layers` (the serving model's) checks every
    (owner, consumer) pair."""
    heads = read_heads(path, **model)
    config = heads.config
    if moe_layers is not None:
        problems = pair_problems(config.owners, config.consumers, list(moe_layers))
        if problems:
            raise CheckpointError(
                f"prerouter file {Path(path)} does not fit this model: "
                f"{'; '.join(problems)} (MoE layers: {list(moe_layers)}); "
                f"train heads for this model"
            )
    return PrerouterHeads(config, heads.fc1, heads.fc2, heads.linear)


def save_heads(
    path: str | Path,
    heads: PrerouterHeads,
    metadata: dict | None = None,
    dtype=mx.float16,
) -> Path:
    """Write heads in the published layout (formats/heads_file.py's `write_heads`)."""
    file = HeadsFile(heads.config, heads.fc1, heads.fc2, heads.linear)
    return write_heads(path, file, metadata, dtype)


# -- warm start from the routers ----------------------------------------------------------------


def router_weight(block) -> tuple[mx.array, mx.array | None]:
    """The router's weight [E, H] as float32 (8-bit routers dequantized) and bias [E] or None."""
    linear = block.router
    quantized = isinstance(linear, nn.QuantizedLinear)
    weight = dequantized(linear) if quantized else linear.weight
    bias = linear.get("bias") if "bias" in linear else None
    return weight.astype(mx.float32), None if bias is None else bias.astype(mx.float32)


def heads_from_router_weights(
    config: PrerouterConfig,
    weights: list[mx.array],
    biases: list[mx.array | None],
    seed: int,
    embedding_scale: float = 0.0,
) -> PrerouterHeads:
    """Warm start: linear = [W_next | b/K over the one-hot(t) columns | 0 (| 0 over the
    next-token embedding)], fc2 = 0.

    Routers have no bias in the supported families; if one had, spreading b/K over the K ones
    of onehot_t reproduces it exactly, since that one-hot always has exactly K ones.

    `embedding_scale` s > 0 (next-token heads, benchmarks only): the embedding columns become
    s x the consumer's router with its rows shuffled, so untrained heads route by the token as
    well, and a draft hedge whose draft misses the served token no longer predicts their sets.
    (init_heads_from_routers divides s by the embedding's RMS.)
    """
    o, e, h, w = len(config.owners), config.num_experts, config.hidden, config.width
    linear = []
    for weight, bias in zip(weights, biases):
        if tuple(weight.shape) != (e, h):
            raise ConfigError(
                f"router weight has shape {tuple(weight.shape)}, expected {(e, h)}"
            )
        cols = [weight.astype(mx.float32)]
        if bias is None:
            cols.append(mx.zeros((e, 2 * e)))
        else:
            cols += [
                mx.broadcast_to(bias[:, None] / config.experts_per_token, (e, e)),
                mx.zeros((e, e)),
            ]
        if config.next_token:
            cols.append(mx.zeros((e, h)))
        linear.append(mx.concatenate(cols, axis=1))
    key = mx.random.key(seed)
    if embedding_scale:
        if not config.next_token:
            raise ConfigError(
                "--embedding-scale sets next-token heads' embedding columns: add "
                "--next-token"
            )
        rng = np.random.default_rng(seed)
        for i, weight in enumerate(weights):
            shuffled = weight.astype(mx.float32)[mx.array(rng.permutation(e))]
            linear[i] = mx.concatenate(
                [linear[i][:, : config.context_dim], embedding_scale * shuffled], axis=1
            )
    fc1 = mx.random.normal((o, w, config.in_dim), key=key) * (config.in_dim**-0.5)
    heads = PrerouterHeads(config, fc1, mx.zeros((o, e, w)), mx.stack(linear))
    mx.eval(heads.parameters())
    return heads


def init_heads_from_routers(
    engine,
    owners: list[int],
    width: int,
    seed: int = 0,
    experts_per_token: int | None = None,
    next_token: bool = False,
    embedding_scale: float = 0.0,
) -> PrerouterHeads:
    """Heads warm-started from each consumer's router (owner + 1; the wrap-around head, owner =
    the last MoE layer: the first MoE layer's); untrained = that router. `embedding_scale` s:
    the embedding columns are s / RMS(embedding) x the consumer's router with its rows shuffled
    (heads_from_router_weights), so at s = 1 the token weighs about as much as the normalised
    hidden state."""
    owners = check_owners(owners, engine.moe_layers)
    consumers = default_consumers(owners, engine.moe_layers)
    config = PrerouterConfig(
        owners=owners,
        width=int(width),
        experts_per_token=int(experts_per_token or engine.experts_per_token),
        hidden=int(engine.family.hidden_size(engine.config)),
        num_experts=int(engine.index.num_experts),
        consumers=consumers,
        next_token=bool(next_token),
    )
    pairs = [router_weight(engine.blocks[c]) for c in consumers]
    if embedding_scale:
        embed = engine.family.embedding(engine.model)
        rows = embed(mx.arange(min(4096, embed.weight.shape[0]))).astype(mx.float32)
        embedding_scale /= mx.sqrt(mx.mean(rows * rows)).item()
    return heads_from_router_weights(
        config, [p[0] for p in pairs], [p[1] for p in pairs], seed, embedding_scale
    )


# -- serving ------------------------------------------------------------------------------------


def attach_prerouter(engine, path: Path) -> Prerouter:
    """The heads in `path` (and the draft hedge of `engine.resolved.hedge_path`, if any) for
    `engine`, checked against it (EngineOptions.resolve found the files)."""
    options, family, model = engine.options, engine.family, engine.model
    heads = load_heads(
        path,
        hidden=family.hidden_size(engine.config),
        num_experts=engine.index.num_experts,
        experts_per_token=engine.experts_per_token,
        model_type=engine.config.get("model_type"),
        moe_layers=engine.moe_layers,
        dtype=resolve_compute_dtype(options.compute_dtype),
    )
    prerouter = Prerouter(
        heads,
        engine.blocks,
        stack_rules([engine.blocks[c].rule for c in heads.config.consumers]),
        engine.experts_per_token,
        engine.counters,
        family.embedding(model),
        measure_recall=options.measure_recall,
    )
    hedge_path = engine.resolved.hedge_path
    if hedge_path is None:
        return prerouter
    fix = f"(prerouter heads: {path}); pass a draft vocabulary (--hedge) or none (--no-hedge)"
    if not is_draft_file(hedge_path) and _holds_heads(hedge_path):
        raise CheckpointError(
            f"{hedge_path} holds prerouter heads: hedges of context heads are no longer "
            f"served (slower than a draft hedge at every precision measured), write a "
            f"draft vocabulary with `edge0-eval draft-vocab` {fix}"
        )
    if not prerouter.next_token:
        raise CheckpointError(
            f"{hedge_path}: a hedge serves next-token prerouter heads, whose plans "
            f"wait for the token; these heads plan before the LM head already {fix}"
        )
    ids = load_draft_vocab(hedge_path, family.embedding(model).weight.shape[0])
    layers = sorted(prerouter.consumers)
    n = options.hedge_layers or len(layers)
    if not 1 <= n <= len(layers):
        raise CheckpointError(
            f"{hedge_path}: hedge_layers {n}: the next-token heads plan "
            f"{len(layers)} layers; choose 1 to {len(layers)} {fix}"
        )
    prerouter.draft = DraftHead(*family.output_head(model), ids)
    prerouter.draft_layers = layers[:n]
    return prerouter


def _holds_heads(path: Path) -> bool:
    try:
        return read_metadata(path).get("kind") == KIND
    except CheckpointError:
        return False  # the draft loader reports what is wrong with it
