"""The models a stage trains with: architecture and tokenizer checks, the teacher (mlx-lm), the
student (the engine, in the mode it is served in) with its trainable LoRA, stage 1's model facts.

Stages 2 and 3: the teacher is `mlx_lm.load(TEACHER)` (on CPU: unquantized experts upcast,
activations float32); the student is `Engine.load(STUDENT)` in the mode it is served in (`--mode
prerouted`: prerouted with its heads; `--mode reactive`: the true router). Before anything heavy
runs, config.json of both must agree on the architecture (model_type, vocab, hidden size,
layers, experts, ...), the tokenizers must have identical vocabularies, and every LoRA target
pattern must match at least one resident linear layer.

K, slots, adapter and heads paths are the engine's decisions (`EngineOptions.resolve`); what only
training decides is here, once each: `training_slots` (the expert bound of stages 2 and 3),
`resolve_heads` (stage 1's K, owners and width); `student_options` and `collector_options` are the
two `EngineOptions` the stages run the engine with.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import mlx.core as mx
from mlx_lm import load

from edge0_eval.engine import lora
from edge0_eval.engine.engine import Engine, EngineOptions
from edge0_eval.engine.families import FAMILIES, family_for
from edge0_eval.engine.heads import (
    check_owners,
    default_consumers,
    default_owners,
    tier_defaults,
)
from edge0_eval.engine.lora import load_adapter
from edge0_eval.engine.mlx_compat import (
    cast_floating,
    resolve_compute_dtype,
    upcast_unquantized_experts_for_cpu,
)
from edge0_eval.errors import CheckpointError, ConfigError
from edge0_eval.formats.layout import ExpertIndex
from edge0_eval.training.stage_options import PrerouterOptions, StageOptions

# Architecture keys that teacher and student config.json must agree on (those present).
ARCH_KEYS = (
    "model_type vocab_size hidden_size num_hidden_layers num_experts "
    "num_experts_per_tok moe_intermediate_size num_attention_heads num_key_value_heads "
    "head_dim full_attention_interval intermediate_size "
    "shared_expert_intermediate_size first_k_dense_replace layer_group_size "
    "num_shared_experts linear_num_value_heads linear_num_key_heads"
).split()


# -- teacher and student checks --------------------------------------------------------------------


def architecture(model_dir: str | Path) -> dict:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    family = FAMILIES.get(config.get("model_type"))
    text = config if family is None else family.text_config(config)
    arch = {"model_type": config.get("model_type")}
    for key in ARCH_KEYS[1:]:
        if key in text:
            arch[key] = text[key]
    return arch


def check_pair(teacher: str | Path, student: str | Path) -> dict:
    """Teacher and student must be the same architecture; one ConfigError listing what differs."""
    t, s = architecture(teacher), architecture(student)
    diff = [
        f"{k}: teacher {t.get(k)!r} vs student {s.get(k)!r}"
        for k in ARCH_KEYS
        if k in t or k in s
        if t.get(k) != s.get(k)
    ]
    if diff:
        raise ConfigError(
            f"teacher {teacher} and student {student} are different models ("
            f"{'; '.join(diff)}); the student must be `edge0-eval convert` of "
            f"this teacher"
        )
    return s


def check_tokenizers(teacher_tok, student_tok) -> None:
    tv, sv = teacher_tok.get_vocab(), student_tok.get_vocab()
    if tv != sv:
        only_t = sorted(set(tv) - set(sv))[:3]
        only_s = sorted(set(sv) - set(tv))[:3]
        moved = [k for k in tv if k in sv and tv[k] != sv[k]][:3]
        raise ConfigError(
            f"teacher and student tokenizers differ ({len(tv)} vs {len(sv)} "
            f"tokens; only teacher {only_t}, only student {only_s}, different ids "
            f"{moved}); token-level training needs one vocabulary"
        )


def load_teacher(path: str | Path):
    """mlx-lm's model and tokenizer for the teacher, in the CPU-safe compute dtype."""
    try:
        model, tokenizer = load(str(path))
    except Exception as exc:
        raise CheckpointError(f"teacher {path}: mlx_lm.load failed ({exc})") from None
    upcast_unquantized_experts_for_cpu(model)
    cast_floating(model, resolve_compute_dtype("auto"))
    model.eval()
    mx.eval(model.parameters())
    return model, tokenizer


# -- defaults derived from the model ---------------------------------------------------------------


def training_slots(opts: StageOptions, student: str | Path) -> int:
    """Expert slots per MoE layer while training: the memory bound of stages 2 and 3.

    K comes from the engine's resolver; the default differs from serving's on purpose: a pass
    over batch x seq_len tokens routes up to that many x K distinct experts per layer.
    """
    resolved = replace(
        opts.engine,
        slots_per_layer=None,
        expert_budget_mib=None,
        no_lora=True,
        no_prerouter=True,
    ).resolve(student)
    k, experts = resolved.experts_per_token, resolved.num_experts
    given = opts.engine.slots_per_layer
    if given is not None:
        if given < k:
            raise ConfigError(f"--slots-per-layer {given} is below top-k {k}")
        return min(given, experts)
    return min(experts, opts.batch * opts.seq_len * k)


@dataclass
class ModelFacts:
    model_type: str
    n_layers: int
    hidden: int
    num_experts: int
    native_top_k: int
    moe_layers: list[int]


def model_facts(model: Path) -> ModelFacts:
    config_path = model / "config.json"
    if not config_path.is_file():
        raise CheckpointError(
            f"{config_path} not found; is {model} a converted model "
            f"(`edge0-eval convert`)?"
        )
    config = json.loads(config_path.read_text())
    family = family_for(config, str(config_path))
    text = family.text_config(config)
    index = ExpertIndex.load(model, check_file=False)
    return ModelFacts(
        config["model_type"],
        int(text["num_hidden_layers"]),
        family.hidden_size(config),
        family.num_experts(config),
        family.native_top_k(config),
        list(index.moe_layers),
    )


def resolve_heads(
    facts: ModelFacts,
    *,
    experts_per_token: int | None = None,
    owners: list[int] | None = None,
    start_layer: int | None = None,
    width: int | None = None,
) -> tuple[int, list[int], int]:
    """(K, owners, width) of a heads file: the given values, else the tier defaults. Owners
    that include the last MoE layer hold the wrap-around head (`default_consumers`)."""
    d = tier_defaults(
        facts.model_type,
        facts.n_layers,
        facts.hidden,
        facts.num_experts,
        facts.moe_layers,
    )
    k = experts_per_token or d["experts_per_token"] or facts.native_top_k
    if k > facts.num_experts:
        raise ConfigError(
            f"--experts-per-token {k} exceeds the model's {facts.num_experts} experts"
        )
    moe = facts.moe_layers
    if owners:
        owners = check_owners(owners, moe)
        first = min(default_consumers(owners, moe))
        if (
            start_layer is not None
            and start_layer != first
            and not (first == moe[0] and start_layer <= first)
        ):
            raise ConfigError(
                f"--start-layer {start_layer} disagrees with --owners (owners "
                f"{owners} -> first consuming layer {first})"
            )
    else:
        start = start_layer if start_layer is not None else d["start_layer"]
        owners = check_owners(default_owners(start, facts.n_layers, moe), moe)
    return k, owners, width or d["width"]


# -- the engines a stage runs ----------------------------------------------------------------------


def student_options(opts: StageOptions, slots: int) -> EngineOptions:
    """The stage's student options with the training slot count (and never an adapter)."""
    return replace(opts.engine, slots_per_layer=slots, no_lora=True)


def collector_options(opts: PrerouterOptions, experts_per_token: int) -> EngineOptions:
    """Stage 1's teacher: the model itself, reactive at the serving K (the exact executed top-K).
    Never an adapter: stage 2 trains one on top of the heads, so an adapter beside the model
    must not change stage 1's data (the features' fingerprint does not cover adapters)."""
    return EngineOptions(
        mode="reactive",
        experts_per_token=experts_per_token,
        expert_budget_mib=opts.expert_budget_mib,
        no_lora=True,
    )


def load_student(opts: StageOptions, slots: int):
    """The student engine in its served mode (prerouted: Engine.load requires its heads)."""
    return Engine.load(opts.student, student_options(opts, slots))


def attach_lora(engine, opts: StageOptions) -> dict:
    """Put the trainable LoRA on the student (zero-init or --init-adapter); freeze the rest."""
    model = engine.model
    if opts.init_adapter:
        meta = load_adapter(
            model, opts.init_adapter, experts_per_token=engine.experts_per_token
        )
        for name, given, have in (
            ("rank", opts.rank, meta["r"]),
            ("alpha", opts.alpha, meta["alpha"]),
        ):
            if given is not None and float(given) != float(have):
                raise ConfigError(
                    f"--{name} {given} contradicts --init-adapter "
                    f"{opts.init_adapter} ({name} {have}); leave --{name} out"
                )
        if opts.targets:
            wanted = set(_resolve_targets(model, opts.targets))
            if wanted != set(meta["targets"]):
                raise ConfigError(
                    f"--targets select {len(wanted)} layers but --init-adapter "
                    f"{opts.init_adapter} covers {len(meta['targets'])}; leave "
                    f"--targets out to continue that adapter"
                )
        paths = meta["targets"]
        r, alpha = meta["r"], meta["alpha"]
    else:
        patterns = opts.targets or lora.default_targets(engine.family.name)
        if opts.targets:
            # one clear error for a pattern that misses
            _resolve_targets(model, patterns)
        # (The family defaults may list layers a given config does not build, e.g. MLA's
        # q_a_proj without q_lora_rank: those simply match nothing.)
        r, alpha = opts.rank or 16, opts.alpha or 32.0
        paths = lora.apply_lora(
            model,
            r=r,
            alpha=alpha,
            targets=patterns,
            init="zeros",
            seed=opts.seed,
            family=engine.family.name,
        )
    lora.mark_trainable(model)
    return {"targets": paths, "r": int(r), "alpha": float(alpha)}


def _resolve_targets(model, patterns: list[str]) -> list[str]:
    found = []
    for pattern in patterns:
        # routers / routed experts raise here
        paths = lora.find_targets(model, [pattern])
        if not paths:
            raise ConfigError(
                f"LoRA target {pattern!r} matches no module of the student; "
                f"targets are module path suffixes such as self_attn.q_proj or "
                f"mlp.shared_expert.up_proj"
            )
        found += paths
    return sorted(set(found))
