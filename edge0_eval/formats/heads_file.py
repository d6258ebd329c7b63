"""Prerouter heads files: save, read and validate, in the published Edge0 layout.

    layers.<N>.fc1.weight [width, in], layers.<N>.fc2.weight [E, width],
    layers.<N>.linear_init.weight [E, in]

with string metadata kind="prerouter", K, owners (JSON list), consumers (JSON list, parallel to
owners; optional: absent means owner + 1 for every head), features ("next_token" for heads that
also see the sampled next token's embedding, in = 2 x hidden + 2E; absent: the published context
features, in = hidden + 2E), start_layer, width, hidden, num_experts, format_version, source,
model, model_type. `read_heads` reads published files (which may lack start_layer/width/hidden/
num_experts: they are then taken from the shapes) and checks everything against the model it
will serve but the (owner, consumer) pairs, which the engine checks against its MoE layers
(engine/heads.py's `load_heads`, which builds the heads). Mixed heads' files (metadata
context_consumers) are refused: that kind of head is no longer served
(reports/variants.md: no more faithful than context heads, no faster).
"""

from __future__ import annotations

import json
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from edge0_eval.errors import CheckpointError
from edge0_eval.formats.safetensors import read_safetensors_header, write_safetensors

KIND = "prerouter"
FORMAT_VERSION = 1
NEXT_TOKEN = "next_token"  # metadata features= of next-token heads (absent: context)
_KEY = re.compile(r"^layers\.(\d+)\.(fc1|fc2|linear_init)\.weight$")


@dataclass
class PrerouterConfig:
    """The heads' shapes and pairing, as a heads file's metadata records them."""

    owners: list[int]  # owner layers N, ascending
    width: int  # fc1 width
    experts_per_token: int  # the serving K the heads were trained for
    hidden: int
    num_experts: int
    # layer each owner predicts (None: owner + 1 each)
    consumers: list[int] | None = None
    # features end with the sampled next token's input embedding
    next_token: bool = False

    def __post_init__(self):
        if self.consumers is None:
            self.consumers = [n + 1 for n in self.owners]
        self.consumers = [int(c) for c in self.consumers]
        if len(self.consumers) != len(self.owners):
            raise ValueError(
                f"consumers {self.consumers} do not pair with owners {self.owners}"
            )

    @property
    def start_layer(self) -> int:
        """The first consuming layer."""
        return min(self.consumers)

    @property
    def context_dim(self) -> int:
        """The context features' width: hidden + 2E (next-token heads append the embedding)."""
        return self.hidden + 2 * self.num_experts

    @property
    def in_dim(self) -> int:
        return self.hidden * (2 if self.next_token else 1) + 2 * self.num_experts

    @property
    def consumer_of(self) -> dict[int, int]:
        return dict(zip(self.owners, self.consumers))


@dataclass(frozen=True)
class HeadsFile:
    """A heads file's heads, stacked in owner order: fc1 [O, width, in], fc2 [O, E, width],
    linear (linear_init) [O, E, in]."""

    config: PrerouterConfig
    fc1: mx.array
    fc2: mx.array
    linear: mx.array


_TENSOR_KEYS = (
    "kind K owners consumers width hidden num_experts format_version features "
    "context_consumers"
).split()


def write_heads(
    path: str | Path, heads: HeadsFile, metadata: dict | None = None, dtype=mx.float16
) -> Path:
    """Write heads in the published layout; `metadata` adds/overrides e.g. source and model.

    Weights are stored as `dtype` (float16 like the published adapters; None keeps the heads').
    """
    path = Path(path)
    cfg = heads.config
    arrays = {}
    for i, n in enumerate(cfg.owners):
        for name, value in (
            ("fc1", heads.fc1[i]),
            ("fc2", heads.fc2[i]),
            ("linear_init", heads.linear[i]),
        ):
            arrays[f"layers.{n}.{name}.weight"] = (
                value if dtype is None else value.astype(dtype)
            )
    meta = {
        "kind": KIND,
        "K": str(cfg.experts_per_token),
        "owners": json.dumps(cfg.owners),
        "consumers": json.dumps(cfg.consumers),
        "start_layer": str(cfg.start_layer),
        "width": str(cfg.width),
        "hidden": str(cfg.hidden),
        "num_experts": str(cfg.num_experts),
        "format_version": str(FORMAT_VERSION),
        "source": "",
        "model": "",
    }
    if cfg.next_token:
        meta["features"] = NEXT_TOKEN
    for key, value in (metadata or {}).items():
        if key in _TENSOR_KEYS:
            continue  # these describe the tensors; they come from the heads
        meta[key] = value if isinstance(value, str) else json.dumps(value)
    return write_safetensors(path, arrays, meta)


def read_metadata(path: str | Path) -> dict:
    """The safetensors metadata of a heads file (header checked, no tensor data read), with
    kind="prerouter" filled in when it is absent and every tensor is a head's, as a LoRA
    file's kind is inferred from its keys."""
    tensors, meta = read_safetensors_header(
        path,
        "prerouter heads",
        "train them again with `edge0-eval "
        "train-prerouter`, or run with --no-prerouter",
    )
    if (
        meta.get("kind") in (None, "")
        and tensors
        and all(_KEY.match(n) for n in tensors)
    ):
        meta = {**meta, "kind": KIND}
    return meta


def _int_meta(meta: dict, key: str, path: Path) -> int | None:
    if key not in meta:
        return None
    try:
        return int(meta[key])
    except (TypeError, ValueError):
        raise CheckpointError(
            f"prerouter file {path}: metadata {key}={meta[key]!r} is not an integer"
        ) from None


def read_heads(
    path: str | Path,
    *,
    hidden: int,
    num_experts: int,
    experts_per_token: int,
    owners: list[int] | None = None,
    dtype=None,
    model_type: str | None = None,
) -> HeadsFile:
    """Read and validate heads for a model with `hidden`, `num_experts`, served at `experts_per_token`.

    `owners` (None: every head in the file) selects heads; each must be present. Any problem
    (not found, unreadable, wrong kind, K, owner set, shape, newer format) raises one
    CheckpointError naming the file. `dtype` casts the weights (None keeps the stored dtype).
    `model_type`: the serving model's; refused when the file's metadata names another.
    """
    path = Path(path)
    where = f"prerouter file {path}"
    meta = read_metadata(path)
    _check_metadata(meta, path, hidden, num_experts, experts_per_token, model_type)
    layers = _read_layers(path, meta)
    consumer_of = _consumers_meta(meta, sorted(layers), where)
    owners = _select_owners(layers, owners, where)
    features = meta.get("features", "context")
    if features not in ("context", NEXT_TOKEN):
        raise CheckpointError(
            f"{where}: metadata features={features!r} is unknown; this build "
            f"reads 'context' (absent) and {NEXT_TOKEN!r}"
        )
    width = int(layers[owners[0]]["fc1"].shape[0])
    config = PrerouterConfig(
        owners=owners,
        width=width,
        experts_per_token=experts_per_token,
        hidden=hidden,
        num_experts=num_experts,
        consumers=[consumer_of[n] for n in owners],
        next_token=features == NEXT_TOKEN,
    )
    _check_shapes(layers, config, where)
    meta_width = _int_meta(meta, "width", path)
    if meta_width is not None and meta_width != width:
        raise CheckpointError(
            f"{where}: metadata width={meta_width} but fc1 has width {width}"
        )
    # checked for form; the heads define the first consumer
    _int_meta(meta, "start_layer", path)
    return _stacked(layers, config, dtype, where)


def _check_metadata(
    meta: dict,
    path: Path,
    hidden: int,
    num_experts: int,
    experts_per_token: int,
    model_type: str | None,
) -> None:
    """Refuse a file whose metadata (kind, format, K, model type, sizes) does not fit."""
    where = f"prerouter file {path}"
    kind = meta.get("kind")
    if kind != KIND:
        raise CheckpointError(
            f"{where} has kind={kind!r}, expected {KIND!r}: not prerouter heads "
            f"(a LoRA adapter or another file?)"
        )
    if "context_consumers" in meta:
        # Mixed heads lost their comparison to context heads and left the engine.
        raise CheckpointError(
            f"{where} holds mixed heads (metadata context_consumers); that "
            f"kind of head is no longer served: retrain context heads with "
            f"`edge0-eval train-prerouter`"
        )
    version = _int_meta(meta, "format_version", path)
    if version is not None and version > FORMAT_VERSION:
        raise CheckpointError(
            f"{where} has format_version {version}; this build reads up to "
            f"{FORMAT_VERSION}"
        )
    k = _int_meta(meta, "K", path)
    if k is None:
        # The heads score every expert; K is only the width they were trained to rank for.
        warnings.warn(
            f"{where} records no K (metadata key 'K'); served at the engine's "
            f"K={experts_per_token}",
            stacklevel=3,
        )
    elif k != experts_per_token:
        raise CheckpointError(
            f"{where} was trained for K={k} but the engine serves K={experts_per_token}; "
            f"train heads for K={experts_per_token} or serve with --experts-per-token {k}"
        )
    if model_type is not None and meta.get("model_type") not in (None, "", model_type):
        raise CheckpointError(
            f"{where} holds heads for a {meta['model_type']} model, but this "
            f"model is {model_type}; train heads for this model"
        )
    for key, want in (("hidden", hidden), ("num_experts", num_experts)):
        got = _int_meta(meta, key, path)
        if got is not None and got != want:
            raise CheckpointError(f"{where} has {key}={got}; the model has {want}")


def _read_layers(path: Path, meta: dict) -> dict[int, dict[str, mx.array]]:
    """The file's tensors by owner layer, each head complete and listed in the metadata."""
    where = f"prerouter file {path}"
    try:
        weights = mx.load(str(path))
    except Exception as exc:
        raise CheckpointError(
            f"{where} is unreadable ({exc}); the file is truncated or corrupt"
        ) from None
    dtypes = {str(v.dtype).split(".")[-1] for v in weights.values()}
    if len(dtypes) > 1 or not dtypes <= {"float16", "bfloat16", "float32"}:
        raise CheckpointError(
            f"{where}: tensors are {sorted(dtypes)}; heads are saved in one "
            f"floating dtype, so the header is corrupt"
        )
    layers: dict[int, dict[str, mx.array]] = {}
    for name, value in weights.items():
        m = _KEY.match(name)
        if m is None:
            raise CheckpointError(
                f"{where}: unexpected tensor {name!r}; expected only "
                f"layers.<N>.(fc1|fc2|linear_init).weight"
            )
        layers.setdefault(int(m.group(1)), {})[m.group(2)] = value
    if "owners" in meta:
        try:
            listed = [int(n) for n in json.loads(meta["owners"])]
        except (ValueError, TypeError):
            raise CheckpointError(
                f"{where}: metadata owners={meta['owners']!r} is not a JSON "
                f"list of layer numbers"
            ) from None
        if sorted(listed) != sorted(layers):
            raise CheckpointError(
                f"{where}: metadata owners {sorted(listed)} do not match the "
                f"heads stored {sorted(layers)}"
            )
    if not layers:
        raise CheckpointError(f"{where} holds no heads")
    return layers


def _select_owners(layers: dict, owners: list[int] | None, where: str) -> list[int]:
    """The owners asked for (None: all), each with a complete head."""
    incomplete = {
        n: sorted({"fc1", "fc2", "linear_init"} - set(p)) for n, p in layers.items()
    }
    incomplete = {n: miss for n, miss in incomplete.items() if miss}
    if incomplete:
        raise CheckpointError(
            f"{where}: heads incomplete, missing tensors {incomplete}"
        )
    if owners is None:
        return sorted(layers)
    owners = sorted(int(n) for n in owners)
    missing = [n for n in owners if n not in layers]
    if missing:
        raise CheckpointError(
            f"{where} has no head for owner layer(s) {missing} (it holds "
            f"{sorted(layers)})"
        )
    return owners


def _check_shapes(layers: dict, config: PrerouterConfig, where: str) -> None:
    hidden, experts, width = config.hidden, config.num_experts, config.width
    for n in config.owners:
        for name, want in (
            ("fc1", (width, config.in_dim)),
            ("fc2", (experts, width)),
            ("linear_init", (experts, config.in_dim)),
        ):
            got = tuple(layers[n][name].shape)
            if got != want:
                raise CheckpointError(
                    f"{where}: layers.{n}.{name}.weight has shape {list(got)}, expected "
                    f"{list(want)} ({'2 x ' if config.next_token else ''}hidden {hidden} "
                    f"+ 2 x {experts} experts, width {width})"
                )


def _stacked(layers: dict, config: PrerouterConfig, dtype, where: str) -> HeadsFile:
    """The heads stacked in owner order, cast to `dtype`, refused when not finite."""
    names = ("fc1", "fc2", "linear_init")
    stacks = [mx.stack([layers[n][name] for n in config.owners]) for name in names]
    if dtype is not None:
        stacks = [s.astype(dtype) for s in stacks]
    finite = mx.stack([mx.all(mx.isfinite(s)) for s in stacks]).tolist()
    bad = [name for name, ok in zip(names, finite) if not ok]
    if bad:
        raise CheckpointError(
            f"{where}: {'/'.join(bad)} weights hold NaN or infinite values; "
            f"the heads are corrupt, train them again"
        )
    return HeadsFile(config, *stacks)


def _consumers_meta(meta: dict, stored: list[int], where: str) -> dict[int, int]:
    """owner -> consumer from metadata "consumers" (parallel to "owners"); absent: owner + 1."""
    if "consumers" not in meta:
        return {n: n + 1 for n in stored}
    try:
        listed = [int(n) for n in json.loads(meta["owners"])]
        consumers = json.loads(meta["consumers"])
        if (
            not isinstance(consumers, list)
            or len(consumers) != len(listed)
            or any(
                isinstance(c, bool) or not isinstance(c, int) or c < 0
                for c in consumers
            )
        ):
            raise ValueError
    except (KeyError, ValueError, TypeError):
        raise CheckpointError(
            f"{where}: metadata consumers={meta['consumers']!r} is not a JSON list of "
            f"layer numbers, one per owner in metadata owners={meta.get('owners')!r}; "
            "write the file again with save_heads (init-prerouter / train-prerouter)"
        ) from None
    odd = [f"{n} -> {c}" for n, c in zip(listed, consumers) if c != n + 1 and c > n]
    if odd or len(set(consumers)) != len(consumers):
        what = ", ".join(odd) or "a layer twice"
        raise CheckpointError(
            f"{where}: metadata consumers={meta['consumers']!r} pairs owners "
            f"with layers no head can predict ({what}); a head predicts owner "
            f"+ 1, or wraps around to the first MoE layer"
        )
    return dict(zip(listed, consumers))
