"""Engine options: every option as one typed object, and the one place that resolves them.

    options = EngineOptions(mode="prerouted", experts_per_token=4)
    resolved = options.resolve("model-edge0")   # K, slots per layer, adapter files, clipping

The CLI (arguments/engine_flags), the OpenCompass student (model_wrappers/models/edge0_model) and the
training stages build an `EngineOptions` and hand it to `Engine.load` unchanged; `resolve` is
where every default that depends on the model is decided.

Adapter files. The LoRA adapter is `lora_path`, else `lora.safetensors` beside the model; the
prerouter heads (prerouted mode only) are `prerouter_path`, else `prerouter.safetensors` beside
the model; with them, the hedge (routing.py; next-token heads only: a draft vocabulary from
`edge0-eval draft-vocab`) is `hedge_path`, else
`prerouter_hedge.safetensors` beside the model when present. `no_lora` / `no_prerouter` /
`no_hedge` turn them off. A file given explicitly must exist. A missing default file means
"no adapter" for the LoRA (the base model is served) and "no hedge", unless the caller
requires the LoRA (`require_lora=True`: the OpenCompass student arm, which must not score the
base model by accident); prerouted mode always requires its heads. Every missing file is the
same `MissingAdapterError`.
"""

from __future__ import annotations

import json
import math
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path

from edge0_eval.engine.experts import slots_for_budget
from edge0_eval.engine.families import Family, family_for
from edge0_eval.engine.mlx_compat import COMPUTE_DTYPES
from edge0_eval.errors import CheckpointError, ConfigError
from edge0_eval.formats.layout import ExpertIndex

MODES = ("resident", "reactive", "prerouted")
LORA_FILE = "lora.safetensors"
PREROUTER_FILE = "prerouter.safetensors"
HEDGE_FILE = "prerouter_hedge.safetensors"


class MissingAdapterError(CheckpointError, ConfigError):
    """An adapter file that an option names or a mode needs is not there: a missing checkpoint
    file and an option to fix, so callers catching either kind see it."""


def option(default=MISSING, help=None, *, factory=MISSING, **flag):
    """A dataclass field declared once with its command-line flag: `help` and argparse's
    keywords as metadata, from which arguments/fields.py makes the flag."""
    return field(
        default=default, default_factory=factory, metadata={"help": help, **flag}
    )


@dataclass
class EngineOptions:
    """Every engine option, as one typed object from CLI/config to where it is used; each
    field's flag (arguments/engine_flags) is generated from its metadata."""

    mode: str = option("reactive", "how experts reach the slots", choices=MODES)
    experts_per_token: int | None = option(
        None,
        "routing width: experts per token (default: the model's num_experts_per_tok)",
        type="positive_int",
        metavar="K",
    )
    # For one row: a batch (generate_batch) holds min(experts, rows x K) slots per layer
    # while it runs when this holds fewer.
    expert_budget_mib: float | None = option(
        None, "memory for expert slots across all MoE layers", type="positive_float"
    )
    slots_per_layer: int | None = option(
        None, "expert slots per MoE layer (instead of a budget)", type="positive_int"
    )
    lora_path: str | None = option(
        None,
        f"LoRA adapter safetensors (default: MODEL/{LORA_FILE} if present)",
        flag="--lora",
    )
    lora_alpha: float | None = option(
        None,
        "the adapter's LoRA alpha (scale alpha/r), for a file whose metadata "
        "and adapter_config.json give none; overrides them when given",
        type="positive_float",
    )
    prerouter_path: str | None = option(
        None,
        f"prerouter heads safetensors (default: MODEL/{PREROUTER_FILE})",
        flag="--prerouter",
    )
    no_lora: bool = option(False, "serve the base model, without a LoRA adapter")
    no_prerouter: bool = option(False, "route every layer with its true router")
    # Hedged staging (next-token heads): a draft vocabulary (the heads at a drafted token),
    # whose sets are read before the LM head for their layers; routing stays the prerouter's
    # (engine/routing.py).
    hedge_path: str | None = option(
        None,
        "hedge for next-token heads, staged before the LM head: a draft vocabulary "
        f"(edge0-eval draft-vocab) (default: MODEL/{HEDGE_FILE} if present)",
        flag="--hedge",
    )
    no_hedge: bool = option(False, "stage without a hedge")
    hedge_layers: int | None = option(
        None,
        "hedge only the first N hedge layers in step order (default: all)",
        type="positive_int",
    )
    io_workers: int = option(4, "expert reads in flight", type="positive_int")
    io_throttle_mbps: float | None = option(
        None,
        "emulate storage of this bandwidth (figures are labelled emulated)",
        type="positive_float",
    )
    verify_crc: bool = option(
        True, "crc32 of each expert bundle on its first read (default on)"
    )
    measure_recall: bool = option(
        False, "prerouted: also run the true routers to report online recall (slower)"
    )
    # Per-layer hidden clipping (NaN -> 0, |h| <= limit); None disables it; "auto": the
    # family's default (Family.clip_hidden: +-1000 on bailing_hybrid only).
    clip_hidden: float | str | None = option(
        "auto",
        "disable hidden-state clipping",
        flag="--no-guard",
        action="store_const",
        const=None,
    )
    # prompt tokens per prefill pass: a config's choice, with no flag
    prefill_chunk: int = option(512, flag=False, type="positive_int")
    compute_dtype: str = option(
        "auto",
        "activation dtype (auto: float32 on CPU, checkpoint dtype elsewhere)",
        choices=COMPUTE_DTYPES,
    )
    seed: int = option(0, "sampling seed", type="seed")

    def validate(self) -> None:
        """Types and ranges of every field (a config can pass anything, NaN included): the
        rule of its flag's type or choices, then what fields require of each other."""
        for f in fields(self):
            value, rule = getattr(self, f.name), _RULES.get(f.metadata.get("type"))
            choices = f.metadata.get("choices")
            if choices and value not in choices:
                raise ConfigError(
                    f"{f.name} {value!r} is not one of {', '.join(choices)}"
                )
            if rule and not (value is None and f.default is None or rule[0](value)):
                raise ConfigError(f"{f.name} must be {rule[1]}, not {value!r}")
        if self.expert_budget_mib is not None and self.slots_per_layer is not None:
            raise ConfigError("give expert_budget_mib or slots_per_layer, not both")
        if (
            self.clip_hidden != "auto"
            and self.clip_hidden is not None
            and not _finite_positive(self.clip_hidden)
        ):
            raise ConfigError(
                f"clip_hidden must be 'auto', None or a finite number > 0, "
                f"not {self.clip_hidden!r}"
            )

    def resolved_clip(self, family: Family) -> float | None:
        return family.clip_hidden if self.clip_hidden == "auto" else self.clip_hidden

    def resolve(
        self,
        directory: str | Path,
        config: dict | None = None,
        index: ExpertIndex | None = None,
        *,
        require_lora: bool = False,
    ) -> "ResolvedOptions":
        """Validate, then decide everything that depends on the model in `directory`.

        `config` / `index` (config.json and the expert index, read from `directory` when not
        given) let a caller that has them already avoid reading them twice. Nothing heavy is
        loaded: this is cheap enough for a config preflight.
        """
        self.validate()
        directory = Path(directory)
        if config is None:
            config_path = directory / "config.json"
            if not config_path.is_file():
                raise CheckpointError(
                    f"{config_path} not found; is {directory} a converted model?"
                )
            config = json.loads(config_path.read_text())
        family = family_for(config, str(directory / "config.json"))
        index = index if index is not None else ExpertIndex.load(directory)
        num_experts = family.num_experts(config)
        experts_per_token = self.experts_per_token or family.native_top_k(config)
        if experts_per_token > num_experts:
            raise ConfigError(
                f"experts_per_token {experts_per_token} exceeds the model's {num_experts} experts"
            )
        # reported first when missing
        lora_path = self._lora_path(directory, require_lora)
        prerouter_path = self._prerouter_path(directory)
        hedge_path = self._hedge_path(directory, prerouter_path)
        if (
            self.hedge_layers is not None
            and prerouter_path is not None
            and hedge_path is None
        ):
            raise ConfigError(
                f"hedge_layers {self.hedge_layers} without a hedge: give "
                f"--hedge FILE (hedge_path), or drop --hedge-layers"
            )
        return ResolvedOptions(
            family=family,
            experts_per_token=experts_per_token,
            num_experts=num_experts,
            slots_per_layer=self._slots_per_layer(index, experts_per_token),
            lora_path=lora_path,
            prerouter_path=prerouter_path,
            hedge_path=hedge_path,
            clip_hidden=self.resolved_clip(family),
        )

    def _slots_per_layer(self, index: ExpertIndex, experts_per_token: int) -> int:
        n_layers, slot_bytes = len(index.moe_layers), index.slot_bytes
        if self.mode == "resident":
            return index.num_experts
        if self.slots_per_layer is not None:
            slots, source = (
                self.slots_per_layer,
                f"slots_per_layer={self.slots_per_layer}",
            )
        elif self.expert_budget_mib is not None:
            slots = slots_for_budget(self.expert_budget_mib, slot_bytes)
            source = f"expert_budget_mib={self.expert_budget_mib:g}"
        else:
            slots, source = 2 * experts_per_token, "default"
        if slots < experts_per_token:
            need = experts_per_token * slot_bytes / 2**20
            raise ConfigError(
                f"{source} gives {slots} expert slots per layer, fewer than experts_per_token={experts_per_token}; one "
                f"layer's top-k bundles across {n_layers} MoE layers need at least {need:.2f} MiB"
            )
        return min(slots, index.num_experts)

    def _lora_path(self, directory: Path, required: bool) -> Path | None:
        if self.no_lora:
            return None
        path = Path(self.lora_path) if self.lora_path else directory / LORA_FILE
        if path.is_file():
            return path
        _refuse_non_file(path, "LoRA adapter", "--no-lora / no_lora=True")
        if self.lora_path or required:
            raise MissingAdapterError(
                f"LoRA adapter {path} is missing; train it (`edge0-eval train-lora`), pass an "
                f"existing file (--lora / lora_path), or serve without it (--no-lora / "
                f"no_lora=True, e.g. for an ablation arm)"
            )
        return None

    def _prerouter_path(self, directory: Path) -> Path | None:
        if self.mode != "prerouted" or self.no_prerouter:
            return None
        path = Path(self.prerouter_path or directory / PREROUTER_FILE)
        if not path.is_file():
            raise MissingAdapterError(
                f"prerouter heads {path} is missing (prerouted mode needs prerouter heads); "
                f"train them with `edge0-eval train-prerouter`, pass --prerouter FILE "
                f"(prerouter_path), route truly with --no-prerouter (no_prerouter=True), or use "
                f"--mode reactive (mode='reactive')"
            )
        return path

    def _hedge_path(self, directory: Path, prerouter_path: Path | None) -> Path | None:
        if prerouter_path is None or self.no_hedge:
            return None
        path = Path(self.hedge_path) if self.hedge_path else directory / HEDGE_FILE
        if path.is_file():
            return path
        _refuse_non_file(path, "prerouter hedge", "--no-hedge / no_hedge=True")
        if self.hedge_path:
            raise MissingAdapterError(
                f"prerouter hedge {path} is missing; write a draft vocabulary with "
                f"`edge0-eval draft-vocab`, or stage without a hedge (--no-hedge / "
                f"no_hedge=True)"
            )
        return None


def _refuse_non_file(path: Path, what: str, opt_out: str) -> None:
    """A default adapter name held by a directory (or another non-file) is a mistake to report,
    not an absent adapter to skip: the base model would be served silently."""
    if path.exists():
        raise MissingAdapterError(
            f"{what} {path} exists but is not a file; put the adapter "
            f"file there, or serve without it ({opt_out})"
        )


@dataclass(frozen=True)
class ResolvedOptions:
    """What `EngineOptions.resolve` decided for one model."""

    family: Family
    experts_per_token: int  # the serving K (option, else the model's native top-k)
    num_experts: int
    slots_per_layer: int
    lora_path: Path | None  # the adapter to apply; None: none
    prerouter_path: Path | None  # the heads to load; None: every layer routes truly
    hedge_path: Path | None  # staged early for next-token heads (a draft vocabulary);
    #                                 None: none
    clip_hidden: float | None  # per-layer hidden clipping limit; None: off


def _finite_positive(value) -> bool:
    return _is_number(value) and math.isfinite(value) and value > 0


# A field's flag type -> the rule its value keeps however it is given, and the rule in words.
_RULES = {
    "positive_int": (lambda v: _is_int(v) and v >= 1, "a whole number >= 1"),
    "seed": (lambda v: _is_int(v) and v >= 0, "a whole number >= 0"),
    "positive_float": (_finite_positive, "a finite number > 0"),
}


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
