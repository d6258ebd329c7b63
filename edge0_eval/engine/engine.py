"""The Edge0 engine: an mlx-lm model whose routed experts stream from disk into a slot pool.

    engine = Engine.load("model-edge0", EngineOptions(mode="reactive", expert_budget_mib=64))
    result = engine.generate(engine.tokenizer.encode("hi"), max_tokens=32)
    print(result.tokens, engine.stats())
    results = engine.generate_batch([p1, p2, p3], max_tokens=32, batch_size=2)   # batch.py

The model object is mlx-lm's own class for the family; only each MoE block's instance is
replaced (see moe.py). The forward loop (families.py) mirrors mlx-lm's and adds a per-layer hook
(`_after_layer`: the numerical guard and the prerouter's staging). One decode token:
`step` -> `forward` -> `Family.forward` -> each layer (its MoE block -> `StreamingSwitchGLU`)
-> `_after_layer` -> the logits, checked finite before they are returned.
"""

from __future__ import annotations

import resource
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import _get_classes

from edge0_eval.errors import CheckpointError, ConfigError, Edge0Error
from edge0_eval.engine.checks import (check_resident, check_resident_names, eos_token_ids,
                                      load_resident, load_tokenizer_checked, open_model_dir)
from edge0_eval.engine.families import Family
from edge0_eval.engine.layout import RESIDENT_NAME, ExpertIndex
from edge0_eval.engine.adapters import load_adapter
from edge0_eval.engine.batch import BatchDecoder, check_batch_args, check_seed
from edge0_eval.engine.mlx_compat import cast_floating, quantize_like_mlx_lm, resolve_compute_dtype
from edge0_eval.engine.moe import LoadCounters, StreamingSwitchGLU
from edge0_eval.engine.options import EngineOptions, ResolvedOptions
from edge0_eval.engine.prerouted import attach_prerouter
from edge0_eval.engine.sampling import RowSampler
from edge0_eval.engine.store import ExpertStore


class NonFiniteError(Edge0Error):
    """The model produced NaN/Inf logits: corrupt weights or an activation overflow."""


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
    # macOS: ru_maxrss is the peak in bytes, the best cheap figure there
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**30


class Engine:
    def __init__(self, model: nn.Module, tokenizer, config: dict, index: ExpertIndex,
                 store: ExpertStore, options: EngineOptions, resolved: ResolvedOptions,
                 counters: LoadCounters, directory: Path):
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.resolved = resolved
        self.family: Family = resolved.family
        self.clip = resolved.clip_hidden
        self.index, self.store, self.options = index, store, options
        self.top_k, self.slots_per_layer = resolved.top_k, resolved.slots_per_layer
        self.counters, self.directory = counters, directory
        self.moe_layers = list(index.moe_layers)
        self.blocks = {i: self.family.layers(model)[i].mlp for i in self.moe_layers}
        self.cache = None
        self.prerouter = None
        self.lora = None
        self._last_layer = len(self.family.layers(model)) - 1
        self._guard_events = mx.array(0, dtype=mx.int32)
        self.nonfinite_events = 0
        self._last = {}
        self.reset()

    # -- loading ----------------------------------------------------------------------------
    @classmethod
    def load(cls, directory: str | Path, options: EngineOptions | None = None) -> "Engine":
        options = options or EngineOptions()
        directory = Path(directory)
        config_path = directory / "config.json"
        if not config_path.is_file():
            raise CheckpointError(f"{config_path} not found; is {directory} a converted model?")
        config, family, index = open_model_dir(directory)
        # Every model-dependent decision, before any weights load (a missing file fails here).
        resolved = options.resolve(directory, config, index)
        top_k, slots = resolved.top_k, resolved.slots_per_layer

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
        resident = load_resident(directory / RESIDENT_NAME)
        quantize_like_mlx_lm(model, config, resident)
        check_resident_names(model, resident, directory / RESIDENT_NAME)
        model.load_weights(list(resident.items()), strict=False)
        # Slot buffers were made in their serving dtypes above and are filled by reads.
        cast_floating(model, compute_dtype, skip=".switch_mlp.glu.")
        lora = None
        if resolved.lora_path is not None:
            # Unmerged: a parallel path on resident modules; int4 weights stay untouched.
            lora = load_adapter(model, resolved.lora_path, expect_kind="lora", top_k=top_k,
                                alpha=options.lora_alpha)
        model.eval()
        mx.eval(model.parameters())
        del resident

        tokenizer = load_tokenizer_checked(directory, eos_token_ids(directory, config))
        engine = cls(model, tokenizer, config, index, store, options, resolved, counters,
                     directory)
        engine.lora = lora
        if options.mode == "resident":
            for block in engine.blocks.values():
                block.switch_mlp.preload_all()
        if resolved.prerouter_path is not None:
            engine.prerouter = attach_prerouter(engine, resolved.prerouter_path)
        store.reset_stats()
        mx.reset_peak_memory()
        return engine

    # -- stepping ---------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget the sequence (KV/SSM caches); the slot pool stays warm."""
        self.cache = make_prompt_cache(self.model)   # qwen2_moe has no make_cache of its own
        self.position = 0
        self._profile = {"steps": 0, "build_s": 0.0, "eval_s": 0.0}
        for block in self.blocks.values():
            block.set_plan(None)
        if self.prerouter is not None:
            self.prerouter.reset()

    def _after_layer(self, layer: int, h: mx.array, *, staging: bool, plan_next: bool,
                     samplers: list | None = None) -> mx.array:
        """After layer `layer`: clip h, hand it to the next layer's staged plan, and after the
        last layer plan the next step (decode)."""
        limit = self.clip
        if limit:
            bad = mx.logical_or(mx.isnan(h), mx.abs(h) > limit)
            self._guard_events = self._guard_events + bad.sum().astype(mx.int32)
            h = mx.clip(mx.nan_to_num(h, nan=0.0), -limit, limit)
        if staging:
            self.prerouter.before_layer(layer + 1, h)
        if plan_next and layer == self._last_layer:
            # Plan the next step now, before the LM head is even built: its compute (the
            # biggest single op) then overlaps the next step's staged reads.
            self.prerouter.after_step(h, samplers)
        return h

    def forward(self, tokens: mx.array, plan_next: bool = False, last_only: bool = False,
                samplers: list | None = None) -> mx.array:
        """Logits for `tokens` [B, L] continuing the cached sequence.

        plan_next (decode): run the prerouter heads right after the last layer and start
        staging the next step's experts; `samplers` (one RowSampler per row) let a draft hedge
        draft the tokens they will sample. last_only (prefill): logits [B, 1] of the last
        position only (Family.forward).
        """
        prerouter = self.prerouter
        plan_next = plan_next and prerouter is not None
        if plan_next:
            prerouter.plan_tokens(tokens[:, -1])    # next-token heads plan here, once per step
        staging = prerouter is not None and prerouter.has_plan    # this forward runs plans
        if staging and plan_next:
            prerouter.counters.steps += 1
        if staging:
            prerouter.before_layer(0, None)    # a wrap-around head's plan for layer 0
        hook = None
        if self.clip or staging or plan_next:
            hook = partial(self._after_layer, staging=staging, plan_next=plan_next,
                           samplers=samplers)
        logits = self.family.forward(self.model, tokens, self.cache, hook, last_only=last_only)
        self.position += tokens.shape[1]
        return logits

    def _checked(self, logits: mx.array, where: str, *also) -> mx.array:
        """Evaluate the last position's logits with one finiteness reduction; raise on NaN/Inf.

        Without clipping a NaN/Inf hidden state reaches the logits, where sampling would
        silently turn it into end-of-text.
        """
        last = logits[0, -1]
        finite = mx.isfinite(last).all()
        mx.eval(last, finite, self._guard_events, *also)
        if not finite.item():
            self.nonfinite_events += 1
            raise NonFiniteError(
                f"{self.directory}: non-finite logits {where} (position {self.position}); a "
                f"resident weight, expert or adapter holds NaN/Inf, or an activation overflowed "
                f"(try --verify-crc, --compute-dtype float32, or re-run convert)")
        return last

    def prefill(self, tokens: list[int], plan: bool = True) -> mx.array:
        """Process a prompt; returns the last position's logits [vocab].

        plan=False (batched decode): the prerouter does not plan the first step here; the
        batch plans all its rows together.
        """
        if not tokens:
            raise ConfigError("empty prompt: nothing to prefill")
        n, chunk = len(tokens), max(1, self.options.prefill_chunk)
        keep = min(n, 2 if chunk > 1 else 1)   # the last piece: the heads' t and t-1 features
        if self.family.split_prefill:
            # As mlx-lm's generate_step: the last tokens alone, so that for every earlier
            # position only what the caches hold is computed (never its LM head, nor the part
            # of the last layer that no cache needs).
            bounds = list(range(0, n - keep, chunk)) + [n - keep, n]
        else:
            bounds = list(range(0, n, chunk)) + [n]
            if len(bounds) > 2 and bounds[-1] - bounds[-2] < keep:
                bounds[-2] = n - keep
        pieces = [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]
        for start, end in pieces[:-1]:
            self.forward(mx.array(tokens[start:end])[None], last_only=True)
            mx.eval([c.state for c in self.cache], self._guard_events)
        # A NaN/Inf of an earlier piece reaches the caches, so the last token's logits.
        start, end = pieces[-1]
        logits = self._checked(self.forward(mx.array(tokens[start:end])[None], last_only=True),
                               f"in the prefill of tokens 0..{n - 1}",
                               [c.state for c in self.cache])
        if self.prerouter is not None and plan:
            self.prerouter.after_prefill(len(tokens))
        return logits

    def _checked_rows(self, logits: mx.array, where: str, rows: list[int], *also) -> mx.array:
        """`_checked` for a batch: every row's last-position logits [B, vocab], evaluated."""
        last = logits[:, -1]
        finite = mx.isfinite(last).all(axis=-1)
        mx.eval(last, finite, self._guard_events, *also)
        bad = [r for r, ok in zip(rows, finite.tolist()) if not ok]
        if bad:
            self.nonfinite_events += 1
            raise NonFiniteError(
                f"{self.directory}: non-finite logits {where} (prompt(s) {bad}); a resident "
                f"weight, expert or adapter holds NaN/Inf, or an activation overflowed (try "
                f"--verify-crc, --compute-dtype float32, or re-run convert)")
        return last

    def step(self, token: int, sampler: RowSampler | None = None) -> mx.array:
        """One decode step; `sampler`: the one that will sample from these logits (None:
        greedy), for a draft hedge."""
        t0 = time.perf_counter()
        logits = self.forward(mx.array([[token]]), plan_next=True,
                              samplers=None if sampler is None else [sampler])
        t1 = time.perf_counter()
        logits = self._checked(logits, f"at decode step {self._profile['steps'] + 1}")
        t2 = time.perf_counter()
        prof = self._profile
        prof["steps"] += 1
        # build: Python building the graph, including blocking reads/stage waits and any compute
        # a reactive layer forces (it syncs to learn its routing); eval: compute left at the end.
        prof["build_s"] += t1 - t0
        prof["eval_s"] += t2 - t1
        return logits

    def generate(self, prompt_tokens: list[int], max_tokens: int, temperature: float = 0.0,
                 top_p: float = 1.0, stop_token_ids: set[int] | None = None,
                 seed: int | None = None, top_k: int = 0, min_p: float = 0.0,
                 penalties: dict | None = None) -> GenerationResult:
        """One sequence. Sampling draws from the row's own key (`seed`, default options.seed;
        see sampling.py), so `generate(p, seed=s)` equals row p of a `generate_batch` with
        seed s, sampled or greedy. penalties: mlx-lm's (sampling_options.PENALTY_KEYS), on the
        prompt and the tokens generated."""
        stop = self._stop_ids(stop_token_ids)
        if seed is not None:
            check_seed(seed)
        sampler = RowSampler(temperature, top_p, int(self.options.seed if seed is None else seed),
                             top_k=top_k, min_p=min_p, prompt=prompt_tokens, penalties=penalties)
        self.reset()
        before = self._snapshot()
        t0 = time.perf_counter()
        logits = self.prefill(list(prompt_tokens))
        t1 = time.perf_counter()
        mid = self._snapshot()
        tokens: list[int] = []
        while len(tokens) < max_tokens:
            token = int(sampler(logits).item())
            tokens.append(token)
            if token in stop or len(tokens) >= max_tokens:
                break
            logits = self.step(token, sampler)
        t2 = time.perf_counter()
        self._last = self._phase_stats(before, mid, self._snapshot(), len(prompt_tokens),
                                       len(tokens), t1 - t0, t2 - t1)
        return GenerationResult(tokens=tokens, prompt_tokens=len(prompt_tokens), stats=self.stats())

    def generate_batch(self, prompts: list[list[int]], max_tokens: int, *,
                       batch_size: int | None = None, temperature: float = 0.0,
                       top_p: float = 1.0, stop_token_ids: set[int] | None = None,
                       seeds: list[int] | None = None, top_k: int = 0, min_p: float = 0.0,
                       penalties: dict | None = None,
                       logits_trace: list | None = None) -> list[GenerationResult]:
        """Decode many prompts, `batch_size` rows at a time (None: all at once); continuous
        batching: when a row finishes, the next waiting prompt joins (engine/batch.py).

        Results in prompt order. Row i samples from its own key (`seeds[i]`, default
        options.seed), so each row equals `generate(prompts[i], seed=seeds[i])` whatever its
        batch mates. Each result's stats hold the row's own figures (prompt_tokens,
        generated_tokens, prefill_s/prefill_tok_s of its own prefill, decode_s = its share of
        the decode steps, decode_tok_s = its stream rate) and the batch's: batch_size,
        batch_decode_tok_s (aggregate), bytes_per_token (per decoded token of the batch),
        mean_union_per_layer, peak_memory_gib, expert_buffer_mib.

        Slots: while the batch runs, a non-resident pool holds min(experts, rows x K) slots per
        layer when the configured budget (expert_budget_mib / slots_per_layer: the B = 1
        budget) holds fewer, so a layer's union always fits (prerouted never drops a planned
        expert). That buffer is the batch's expert_buffer_mib / slots_per_layer in the stats;
        afterwards the pool returns to the configured size.

        logits_trace: a list, filled with one list per prompt of the model's logits [vocab]
        each of its tokens was sampled from, before any penalty (parity checks).
        """
        rows_at_once = check_batch_args(prompts, max_tokens, batch_size, seeds)
        decoder = BatchDecoder(self, prompts, max_tokens, rows_at_once,
                               dict(temperature=temperature, top_p=top_p, top_k=top_k,
                                    min_p=min_p, penalties=penalties),
                               self._stop_ids(stop_token_ids), seeds,
                               logits_trace)
        configured = self.resolved.slots_per_layer
        self.reset()
        self._resize_slots(max(configured, min(rows_at_once * self.top_k,
                                               self.index.num_experts)))
        try:
            rows = decoder.run()
            self._last = decoder.batch_stats(rows)
            common = self.stats()           # with the batch's expert buffer
        finally:
            self.reset()     # the batch's caches and any plan in flight are dropped
            self._resize_slots(configured)
        return [GenerationResult(tokens=r.tokens, prompt_tokens=len(r.prompt),
                                 stats={**common, **decoder.row_stats(r)}) for r in rows]

    def _stop_ids(self, stop_token_ids: set[int] | None) -> set[int]:
        return set(self.tokenizer.eos_token_ids) if stop_token_ids is None else set(stop_token_ids)

    def _resize_slots(self, n_slots: int) -> None:
        """Every MoE layer's slot pool to `n_slots` (not in resident mode: all are held)."""
        if self.options.mode == "resident" or n_slots == self.slots_per_layer:
            return
        for block in self.blocks.values():
            block.switch_mlp.resize(n_slots)
        self.slots_per_layer = n_slots

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
            # Distinct experts per layer call, and such calls (reactive unions + staged sets).
            "union": self.counters.union_experts + (
                self.prerouter.counters.staged_experts if self.prerouter else 0),
            "union_layers": self.counters.union_calls + (
                self.prerouter.counters.staged_layers if self.prerouter else 0),
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
            "nonfinite_events": self.nonfinite_events,
        }
        out["lora"] = str(self.lora["path"]) if self.lora else None
        if self.prerouter is not None:
            out.update(self.prerouter.stats())
        out.update(self._last)
        return out

    def close(self) -> None:
        self.store.close()
