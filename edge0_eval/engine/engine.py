"""The Edge0 engine: an mlx-lm model whose routed experts stream from disk into a slot pool.

    engine = Engine.load("model-edge0", EngineOptions(mode="reactive", expert_budget_mib=64))
    result = engine.generate(engine.tokenizer.encode("hi"), max_tokens=32)
    print(result.tokens, engine.stats())

The model object is mlx-lm's own class for the family; only each MoE block's instance is
replaced (see moe.py). The forward loop (families.py) mirrors mlx-lm's and adds the per-layer
numerical guard.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from edge0_eval.errors import CheckpointError, ConfigError
from edge0_eval.engine.checks import (check_index_model, check_resident,
                                      load_tokenizer_checked, read_config)
from edge0_eval.engine.families import Family, family_for
from edge0_eval.engine.layout import RESIDENT_NAME, ExpertIndex
from edge0_eval.engine.mlx_compat import COMPUTE_DTYPES, cast_floating, resolve_compute_dtype
from edge0_eval.engine.moe import LoadCounters, StreamingSwitchGLU
from edge0_eval.engine.pool import slots_for_budget
from edge0_eval.engine.store import ExpertStore

MODES = ("resident", "reactive", "prerouted")


@dataclass
class EngineOptions:
    """Every engine option, as one typed object from CLI/config to where it is used."""

    mode: str = "reactive"
    top_k: int | None = None                 # routing width; None = the model's native top-k
    expert_budget_mib: float | None = None   # expert slot buffers across all MoE layers
    slots_per_layer: int | None = None       # alternative to the budget
    lora_path: str | None = None
    prerouter_path: str | None = None
    no_lora: bool = False
    no_prerouter: bool = False
    io_workers: int = 4
    io_throttle_mbps: float | None = None    # storage emulation; figures it produces are emulated
    verify_crc: bool = True                  # crc32 of each bundle on its first read
    prerouted_weights: str = "head"          # "head": head softmax over the set; "router": true
    measure_recall: bool = False             # prerouted: compare plans with the true router
    # Per-layer hidden clipping (NaN -> 0, |h| <= limit); None disables it; "auto": the
    # family's default (Family.clip_hidden: +-1000 on bailing_hybrid only).
    clip_hidden: float | str | None = "auto"
    prefill_chunk: int = 512
    compute_dtype: str = "auto"              # auto: float32 on CPU (half is emulated there)
    seed: int = 0

    def validate(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"mode {self.mode!r} is not one of {', '.join(MODES)}")
        if self.top_k is not None and self.top_k < 1:
            raise ConfigError("top_k must be at least 1")
        if self.expert_budget_mib is not None and self.slots_per_layer is not None:
            raise ConfigError("give expert_budget_mib or slots_per_layer, not both")
        if self.expert_budget_mib is not None and self.expert_budget_mib <= 0:
            raise ConfigError("expert_budget_mib must be positive")
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise ConfigError(f"compute_dtype {self.compute_dtype!r} is not one of "
                              f"{', '.join(COMPUTE_DTYPES)}")
        if self.io_throttle_mbps is not None and self.io_throttle_mbps <= 0:
            raise ConfigError("io_throttle_mbps must be positive")
        if self.clip_hidden != "auto" and self.clip_hidden is not None and \
                not (isinstance(self.clip_hidden, (int, float)) and self.clip_hidden > 0):
            raise ConfigError(f"clip_hidden must be 'auto', None or positive, "
                              f"not {self.clip_hidden!r}")

    def resolved_clip(self, family: Family) -> float | None:
        return family.clip_hidden if self.clip_hidden == "auto" else self.clip_hidden


@dataclass
class GenerationResult:
    tokens: list[int]
    prompt_tokens: int
    stats: dict = field(default_factory=dict)


def _rss_gib() -> float:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024 / 2**30
    except OSError:
        pass
    import resource  # macOS: ru_maxrss is the peak in bytes, the best cheap figure there

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**30


class Engine:
    def __init__(self, model: nn.Module, tokenizer, config: dict, family: Family,
                 index: ExpertIndex, store: ExpertStore, options: EngineOptions,
                 top_k: int, slots_per_layer: int, counters: LoadCounters, directory: Path):
        self.model, self.tokenizer, self.config, self.family = model, tokenizer, config, family
        self.clip = options.resolved_clip(family)
        self.index, self.store, self.options = index, store, options
        self.top_k, self.slots_per_layer, self.counters = top_k, slots_per_layer, counters
        self.directory = directory
        self.moe_layers = list(index.moe_layers)
        self.blocks = {i: family.layers(model)[i].mlp for i in self.moe_layers}
        self.cache = None
        self.prerouter = None
        self.lora = None
        self._staging = False
        self._plan_early = False
        self._last_layer = len(family.layers(model)) - 1
        self._guard_events = mx.array(0, dtype=mx.int32)
        self._last = {}
        self.reset()

    # -- loading ----------------------------------------------------------------------------
    @classmethod
    def load(cls, directory: str | Path, options: EngineOptions | None = None) -> "Engine":
        from mlx_lm.utils import _get_classes

        options = options or EngineOptions()
        options.validate()
        directory = Path(directory)
        config_path = directory / "config.json"
        if not config_path.is_file():
            raise CheckpointError(f"{config_path} not found; is {directory} a converted model?")
        config = read_config(config_path)
        family = family_for(config, str(config_path))
        index = ExpertIndex.load(directory)
        check_index_model(index, config, family, directory)
        if index.model_type != config["model_type"]:
            raise CheckpointError(f"{directory}: index is for {index.model_type!r} but config.json "
                                  f"says {config['model_type']!r}; re-run convert")
        num_experts = family.num_experts(config)
        if index.num_experts != num_experts:
            raise CheckpointError(f"{directory}: index has {index.num_experts} experts, "
                                  f"config.json {num_experts}; re-run convert")
        _check_adapter_paths(directory, options)
        top_k = options.top_k or family.native_top_k(config)
        if top_k > num_experts:
            raise ConfigError(f"top_k {top_k} exceeds the model's {num_experts} experts")
        slots = _slots_per_layer(options, index, top_k)

        mx.random.seed(options.seed)
        model_class, args_class = _get_classes(config)
        model = model_class(args_class.from_dict(config))
        moe_in_model = family.moe_layers(model)
        if moe_in_model != list(index.moe_layers):
            raise CheckpointError(f"{directory}: index lists MoE layers {index.moe_layers} but the "
                                  f"config builds {moe_in_model}; re-run convert")
        store = ExpertStore(directory, index, io_workers=options.io_workers,
                            io_throttle_mbps=options.io_throttle_mbps,
                            verify_crc=options.verify_crc)
        counters = LoadCounters()
        layers = family.layers(model)
        compute_dtype = resolve_compute_dtype(options.compute_dtype)
        for i in index.moe_layers:
            switch = StreamingSwitchGLU(i, index, store, slots, counters, scale_dtype=compute_dtype)
            # Instance-level replacement: mlx-lm's classes stay untouched.
            layers[i].mlp = family.block_class(layers[i].mlp, switch, i, top_k)

        check_resident(directory / RESIDENT_NAME, index)
        resident = _load_resident(directory / RESIDENT_NAME)
        _quantize_like_mlx_lm(model, config, resident)
        _check_resident_names(model, resident, directory / RESIDENT_NAME)
        model.load_weights(list(resident.items()), strict=False)
        # Slot buffers keep the file's dtype: reads land in them unconverted.
        # Slot buffers were made in their serving dtypes above and are filled by reads.
        cast_floating(model, compute_dtype, skip=".switch_mlp.glu.")
        lora = None
        lora_path = _lora_path(directory, options)
        if lora_path is not None:
            from edge0_eval.engine.lora import load_adapter

            # Unmerged: a parallel path on resident modules; int4 weights stay untouched.
            lora = load_adapter(model, lora_path, expect_kind="lora", top_k=top_k)
        model.eval()
        mx.eval(model.parameters())
        del resident

        eos = config.get("eos_token_id")
        tokenizer = load_tokenizer_checked(directory, [eos] if isinstance(eos, int) else eos)
        engine = cls(model, tokenizer, config, family, index, store, options, top_k, slots,
                     counters, directory)
        engine.lora = lora
        if options.mode == "resident":
            for block in engine.blocks.values():
                block.switch_mlp.preload_all()
        if options.mode == "prerouted":
            from edge0_eval.engine.prerouted import attach_prerouter

            engine.prerouter = attach_prerouter(engine)
        store.reset_stats()
        mx.reset_peak_memory()
        return engine

    # -- stepping ---------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget the sequence (KV/SSM caches); the slot pool stays warm."""
        self.cache = make_prompt_cache(self.model)   # qwen2_moe has no make_cache of its own
        self.position = 0
        self._profile = {"steps": 0, "build_s": 0.0, "eval_s": 0.0, "after_s": 0.0}
        for block in self.blocks.values():
            block.set_plan(None)
        if self.prerouter is not None:
            self.prerouter.reset()

    def _after_layer(self, layer: int, h: mx.array) -> mx.array:
        limit = self.clip
        if limit:
            bad = mx.logical_or(mx.isnan(h), mx.abs(h) > limit)
            self._guard_events = self._guard_events + bad.sum().astype(mx.int32)
            h = mx.clip(mx.nan_to_num(h, nan=0.0), -limit, limit)
        if self._staging:
            self.prerouter.before_layer(layer + 1, h)
        if self._plan_early and layer == self._last_layer:
            # Plan the next step now, before the LM head is even built: its compute (the
            # biggest single op) then overlaps the next step's staged reads.
            self.prerouter.after_step()
            self._plan_early = False
        return h

    def forward(self, tokens: mx.array, plan_next: bool = False) -> mx.array:
        """Logits for `tokens` [B, L] continuing the cached sequence.

        plan_next (decode): run the prerouter heads right after the last layer and start
        staging the next step's experts.
        """
        self._staging = self.prerouter is not None and self.prerouter.has_plan
        self._plan_early = plan_next and self.prerouter is not None
        hook = (self._after_layer
                if (self.clip or self._staging or self._plan_early) else None)
        logits = self.family.forward(self.model, tokens, self.cache, hook)
        self.position += tokens.shape[1]
        return logits

    def prefill(self, tokens: list[int]) -> mx.array:
        """Process a prompt; returns the last position's logits [vocab]."""
        if not tokens:
            raise ConfigError("empty prompt: nothing to prefill")
        chunk = max(1, self.options.prefill_chunk)
        bounds = list(range(0, len(tokens), chunk)) + [len(tokens)]
        if len(bounds) > 2 and bounds[-1] - bounds[-2] == 1 and chunk > 1:
            bounds[-2] -= 1   # the last chunk keeps two tokens: the heads' t and t-1 features
        for start, end in zip(bounds, bounds[1:]):
            logits = self.forward(mx.array(tokens[start:end])[None])
            mx.eval(logits, self._guard_events, [c.state for c in self.cache])
        if self.prerouter is not None:
            self.prerouter.after_prefill(len(tokens))
        return logits[0, -1]

    def step(self, token: int) -> mx.array:
        t0 = time.perf_counter()
        logits = self.forward(mx.array([[token]]), plan_next=True)
        t1 = time.perf_counter()
        mx.eval(logits, self._guard_events)
        t2 = time.perf_counter()
        if self.prerouter is not None:
            self.prerouter.counters.steps += int(self._staging)
        prof = self._profile
        prof["steps"] += 1
        # build: Python building the graph, including blocking reads/stage waits and any compute
        # a reactive layer forces (it syncs to learn its routing); eval: compute left at the end.
        prof["build_s"] += t1 - t0
        prof["eval_s"] += t2 - t1
        prof["after_s"] += time.perf_counter() - t2
        return logits[0, -1]

    def generate(self, prompt_tokens: list[int], max_tokens: int, temperature: float = 0.0,
                 top_p: float = 1.0, stop_token_ids: set[int] | None = None) -> GenerationResult:
        from mlx_lm.sample_utils import make_sampler

        stop = set(self.tokenizer.eos_token_ids) if stop_token_ids is None else set(stop_token_ids)
        sampler = make_sampler(temp=temperature, top_p=top_p)
        mx.random.seed(self.options.seed)
        self.reset()
        before = self._snapshot()
        t0 = time.perf_counter()
        logits = self.prefill(list(prompt_tokens))
        t1 = time.perf_counter()
        mid = self._snapshot()
        tokens: list[int] = []
        while len(tokens) < max_tokens:
            logprobs = logits - mx.logsumexp(logits, keepdims=True)
            token = int(sampler(logprobs[None]).item())
            tokens.append(token)
            if token in stop or len(tokens) >= max_tokens:
                break
            logits = self.step(token)
        t2 = time.perf_counter()
        self._last = self._phase_stats(before, mid, self._snapshot(), len(prompt_tokens),
                                       len(tokens), t1 - t0, t2 - t1)
        return GenerationResult(tokens=tokens, prompt_tokens=len(prompt_tokens), stats=self.stats())

    # -- accounting -------------------------------------------------------------------------
    def _snapshot(self) -> dict:
        pool = [b.switch_mlp.slots.stats for b in self.blocks.values()]
        return {
            "bytes": self.store.stats.bytes_read, "reads": self.store.stats.reads,
            "blocked": self.counters.blocked_seconds + (
                self.prerouter.counters.stage_wait_seconds if self.prerouter else 0.0),
            "hits": sum(p.hits for p in pool),
            "misses": sum(p.misses for p in pool),
            "blocked_loads": self.counters.blocked_loads,
            "demand_read_s": self.counters.demand_read_seconds,
            "demand_read_bytes": self.counters.demand_read_bytes,
        }

    def _phase_stats(self, before, mid, after, n_prompt, n_gen, t_prefill, t_decode) -> dict:
        steps = max(0, n_gen - 1)   # the first token comes from the prefill logits
        lookups = (after["hits"] - mid["hits"]) + (after["misses"] - mid["misses"])
        return {
            "prompt_tokens": n_prompt,
            "generated_tokens": n_gen,
            "prefill_s": t_prefill,
            "decode_s": t_decode,
            "prefill_tok_s": n_prompt / t_prefill if t_prefill > 0 else 0.0,
            "decode_tok_s": steps / t_decode if steps and t_decode > 0 else 0.0,
            "decode_bytes_read": after["bytes"] - mid["bytes"],
            "bytes_per_token": (after["bytes"] - mid["bytes"]) / steps if steps else 0.0,
            "reads_per_token": (after["reads"] - mid["reads"]) / steps if steps else 0.0,
            "blocked_load_ms_per_step":
                1000 * (after["blocked"] - mid["blocked"]) / steps if steps else 0.0,
            "blocked_loads_per_step":
                (after["blocked_loads"] - mid["blocked_loads"]) / steps if steps else 0.0,
            # Bandwidth of the blocking (demand) reads while they ran: bytes / their wall time.
            "demand_read_gbps": ((after["demand_read_bytes"] - mid["demand_read_bytes"])
                                 / (after["demand_read_s"] - mid["demand_read_s"]) / 1e9
                                 if after["demand_read_s"] > mid["demand_read_s"] else None),
            "decode_hit_rate": (after["hits"] - mid["hits"]) / lookups if lookups else 0.0,
            "prefill_bytes_read": mid["bytes"] - before["bytes"],
            "profile_ms_per_step": {
                k[:-2] + "_ms": 1000 * v / max(1, self._profile["steps"])
                for k, v in self._profile.items() if k.endswith("_s")
            },
        }

    def stats(self) -> dict:
        store = self.store.stats
        pool = [b.switch_mlp.slots.stats for b in self.blocks.values()]
        hits, misses = sum(p.hits for p in pool), sum(p.misses for p in pool)
        out = {
            "mode": self.options.mode,
            "top_k": self.top_k,
            "slots_per_layer": self.slots_per_layer,
            "expert_buffer_mib": self.slots_per_layer * len(self.moe_layers)
                                 * self.index.bundle_stride / 2**20,
            "io_throttle_mbps": self.options.io_throttle_mbps,
            "emulated": self.options.io_throttle_mbps is not None,
            "peak_memory_gib": mx.get_peak_memory() / 2**30,
            "active_memory_gib": mx.get_active_memory() / 2**30,
            "rss_gib": _rss_gib(),
            "bytes_read": store.bytes_read,
            "reads": store.reads,
            "read_seconds": store.read_seconds,
            "cache_hit_rate": hits / (hits + misses) if hits + misses else 0.0,
            "evictions": sum(p.evictions for p in pool),
            "blocked_load_s": self.counters.blocked_seconds,
            "guard_clip": self.clip,
            "guard_events": int(self._guard_events.item()),
        }
        out["lora"] = str(self.lora["path"]) if self.lora else None
        if self.prerouter is not None:
            out.update(self.prerouter.stats())
        out.update(self._last)
        return out

    def close(self) -> None:
        self.store.close()


def _slots_per_layer(options: EngineOptions, index: ExpertIndex, top_k: int) -> int:
    n_layers, bundle = len(index.moe_layers), index.bundle_stride
    if options.mode == "resident":
        return index.num_experts
    if options.slots_per_layer is not None:
        slots, source = options.slots_per_layer, f"slots_per_layer={options.slots_per_layer}"
    elif options.expert_budget_mib is not None:
        slots = slots_for_budget(options.expert_budget_mib, bundle, n_layers)
        source = f"expert_budget_mib={options.expert_budget_mib:g}"
    else:
        slots, source = 2 * top_k, "default"
    if slots < top_k:
        need = top_k * bundle * n_layers / 2**20
        raise ConfigError(
            f"{source} gives {slots} expert slots per layer, fewer than top_k={top_k}; one "
            f"layer's top-k bundles across {n_layers} MoE layers need at least {need:.2f} MiB"
        )
    return min(slots, index.num_experts)


def _load_resident(path: Path) -> dict:
    if not path.is_file():
        raise CheckpointError(f"{path} not found; re-run `edge0-eval convert`")
    try:
        return mx.load(str(path))
    except Exception as exc:  # MLX raises RuntimeError/ValueError for truncated headers or data
        raise CheckpointError(f"{path} is unreadable ({exc}); the file is truncated or corrupt, "
                              f"re-run `edge0-eval convert`") from None


def _quantize_like_mlx_lm(model: nn.Module, config: dict, weights: dict) -> None:
    """The same per-module quantization mlx_lm.utils.load_model applies, driven by the weights."""
    from mlx_lm.utils import infer_quant_config

    quantization = config.get("quantization")
    if quantization is None:
        return

    def predicate(path, module):
        if path in quantization:
            return quantization[path]
        if not hasattr(module, "to_quantized") or f"{path}.scales" not in weights:
            return False
        return infer_quant_config(path, module, weights)

    nn.quantize(model, group_size=quantization["group_size"], bits=quantization["bits"],
                mode=quantization.get("mode", "affine"), class_predicate=predicate)


def _check_resident_names(model: nn.Module, weights: dict, path: Path) -> None:
    from mlx.utils import tree_flatten

    expected = {k for k, _ in tree_flatten(model.parameters()) if ".switch_mlp.glu." not in k}
    missing, unexpected = sorted(expected - set(weights)), sorted(set(weights) - expected)
    if missing or unexpected:
        raise CheckpointError(
            f"{path} does not match the model built from config.json: "
            f"{len(missing)} missing (e.g. {missing[:3]}), {len(unexpected)} unexpected "
            f"(e.g. {unexpected[:3]}); re-run convert"
        )
    params = dict(tree_flatten(model.parameters()))
    for name, value in weights.items():
        if params[name].shape != value.shape:
            raise CheckpointError(f"{path}: {name} has shape {value.shape}, the model expects "
                                  f"{params[name].shape}; re-run convert")


def _check_adapter_paths(directory: Path, options: EngineOptions) -> None:
    """Fail before any weights load when a requested adapter or head file is missing."""
    from edge0_eval.engine.prerouted import PREROUTER_FILE

    if options.lora_path and not options.no_lora and not Path(options.lora_path).is_file():
        raise CheckpointError(f"LoRA adapter {options.lora_path} not found; pass an existing file "
                              f"or --no-lora")
    if options.mode == "prerouted" and not options.no_prerouter:
        path = Path(options.prerouter_path or directory / PREROUTER_FILE)
        if not path.is_file():
            raise CheckpointError(
                f"prerouted mode needs prerouter heads: {path} not found; train them with "
                f"`edge0-eval train-prerouter`, pass --prerouter FILE, --no-prerouter, "
                f"or use --mode reactive"
            )


LORA_FILE = "lora.safetensors"


def _lora_path(directory: Path, options: EngineOptions) -> Path | None:
    """The adapter to apply: the option, else `lora.safetensors` beside the model, else none."""
    if options.no_lora:
        return None
    if options.lora_path:
        return Path(options.lora_path)
    default = directory / LORA_FILE
    return default if default.is_file() else None
