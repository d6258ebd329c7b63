"""The Edge0 engine: an mlx-lm model whose routed experts stream from disk into a slot pool.

    engine = Engine.load("model-edge0", EngineOptions(mode="reactive", expert_budget_mib=64))
    result = engine.generate(engine.tokenizer.encode("hi"), max_tokens=32)
    print(result.tokens, engine.stats())
    results = engine.generate_batch([p1, p2, p3], max_tokens=32, batch_size=2)   # batch.py

The model object is mlx-lm's own class for the family; only each MoE block's instance is
replaced (step.py). Everything runs through one step, `engine.step(tokens, cache, plans)
-> (logits, plans)` (step.py), the sequence's cache and the prerouter's plans passed in and
returned: `Sequence` carries them for one sequence, the batch decoder for its rows.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.utils import _get_classes

from edge0_eval.engine.batch import (
    Answer,
    BatchDecoder,
    Figures,
    Row,
    RowSampler,
    StopRule,
    check_batch_args,
    check_seed,
    decode_figures,
    snapshot,
)
from edge0_eval.engine.counters import Counters
from edge0_eval.engine.experts import StreamingSwitchGLU
from edge0_eval.engine.families import open_model_dir
from edge0_eval.engine.heads import attach_prerouter
from edge0_eval.engine.lora import load_adapter
from edge0_eval.engine.mlx_compat import (
    activation_dtype,
    cast_floating,
    quantize_like_mlx_lm,
    refuse_unserved_experts,
    resolve_compute_dtype,
)
from edge0_eval.engine.options import EngineOptions, ResolvedOptions
from edge0_eval.engine.step import DecodeStep, NonFiniteError  # noqa: F401 (NonFiniteError: API)
from edge0_eval.engine.store import ExpertStore
from edge0_eval.errors import CheckpointError, ConfigError
from edge0_eval.formats.config import eos_token_ids
from edge0_eval.formats.layout import INDEX_NAME, RESIDENT_NAME, ExpertIndex
from edge0_eval.formats.model_dir import (
    check_resident,
    check_resident_names,
    load_resident,
    load_tokenizer_checked,
)


# -- the engine ---------------------------------------------------------------------
@dataclass
class GenerationResult(Answer):
    """A finished row, as `generate` and `generate_batch` return it: its answer (batch.Answer:
    output, text, finish, stop_word, stats: the engine's figures with the row's own), and
    every token it decoded (`tokens`: a final stop id included)."""

    tokens: list[int]
    prompt_tokens: int

    @classmethod
    def of_row(cls, row: Row, stats: dict) -> "GenerationResult":
        answer = Answer.of(row.stop, stats)
        return cls(**vars(answer), tokens=row.tokens, prompt_tokens=len(row.prompt))


class Engine:
    def __init__(
        self,
        model: nn.Module,
        tokenizer,
        config: dict,
        index: ExpertIndex,
        store: ExpertStore,
        options: EngineOptions,
        resolved: ResolvedOptions,
        counters: Counters,
        directory: Path,
        lora: dict | None = None,
    ):
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.resolved, self.family = resolved, resolved.family
        self.index, self.store, self.options = index, store, options
        self.experts_per_token = resolved.experts_per_token
        self.counters, self.directory, self.lora = counters, directory, lora
        self.moe_layers = list(index.moe_layers)
        self.slot_bytes = index.slot_bytes  # one slot in every MoE layer
        self.blocks = {i: self.family.layers(model)[i].mlp for i in self.moe_layers}
        self._last = {}
        heads = resolved.prerouter_path
        self.prerouter = None if heads is None else attach_prerouter(self, heads)
        # The one step every caller runs (step.py).
        self.step = DecodeStep(
            model,
            self.family,
            self.blocks,
            self.prerouter,
            resolved.clip_hidden,
            counters,
            str(directory),
            options.prefill_chunk,
        )
        self.figures = Figures(
            options.mode,
            self.experts_per_token,
            options.io_throttle_mbps,
            resolved.clip_hidden,
            None if lora is None else str(lora["path"]),
            self.slot_bytes,
            counters,
            store,
            self.blocks,
            self.prerouter,
        )

    # -- loading ----------------------------------------------------------------------------
    @classmethod
    def load(
        cls, directory: str | Path, options: EngineOptions | None = None
    ) -> "Engine":
        options = options or EngineOptions()
        directory = Path(directory)
        config_path = directory / "config.json"
        if not config_path.is_file():
            raise CheckpointError(
                f"{config_path} not found; is {directory} a converted model?"
            )
        config, family, index = open_model_dir(directory)
        # Every model-dependent decision, before any weights load (a missing file fails here).
        resolved = options.resolve(directory, config, index)
        k, slots = resolved.experts_per_token, resolved.slots_per_layer

        mx.random.seed(options.seed)
        model, store, counters = _streaming_model(
            directory, config, family, index, options, (slots, k)
        )
        lora = None
        if resolved.lora_path is not None:
            # Unmerged: a parallel path on resident modules; int4 weights stay untouched.
            lora = load_adapter(
                model,
                resolved.lora_path,
                expect_kind="lora",
                experts_per_token=k,
                alpha=options.lora_alpha,
            )
        model.eval()
        mx.eval(model.parameters())

        tokenizer = load_tokenizer_checked(directory, eos_token_ids(directory, config))
        if options.mode == "resident":
            layers = family.layers(model)
            for i in index.moe_layers:
                layers[i].mlp.switch_mlp.preload_all()
        engine = cls(
            model,
            tokenizer,
            config,
            index,
            store,
            options,
            resolved,
            counters,
            directory,
            lora,
        )
        store.reset_stats()
        mx.reset_peak_memory()
        return engine

    # -- running ----------------------------------------------------------------------------
    def sequence(self) -> "Sequence":
        """A new sequence: `prefill(prompt)`, then `step(token)` per token."""
        return Sequence(self)

    def generate(
        self,
        prompt_tokens: list[int],
        max_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        stop_token_ids: set[int] | None = None,
        seed: int | None = None,
        top_k: int = 0,
        min_p: float = 0.0,
        penalties: dict | None = None,
        stop_words: list[str] = (),
    ) -> GenerationResult:
        """One sequence: a batch of one row (`generate_batch`), so a solo run and a batched
        row are one code path. Sampling draws from the row's own key (`seed`, default
        options.seed; see batch.py). penalties: mlx-lm's (inputs.PENALTY_KEYS),
        on the prompt and the tokens generated; stop_words: strings that end the row as soon
        as its text holds one."""
        if seed is not None:
            check_seed(seed)
        return self.generate_batch(
            [prompt_tokens],
            max_tokens,
            batch_size=1,
            temperature=temperature,
            top_p=top_p,
            stop_token_ids=stop_token_ids,
            seeds=None if seed is None else [seed],
            top_k=top_k,
            min_p=min_p,
            penalties=penalties,
            stop_words=stop_words,
        )[0]

    def generate_batch(
        self,
        prompts: list[list[int]],
        max_tokens: int,
        *,
        batch_size: int | None = None,
        temperature: float = 0.0,
        top_p: float = 1.0,
        stop_token_ids: set[int] | None = None,
        seeds: list[int] | None = None,
        top_k: int = 0,
        min_p: float = 0.0,
        penalties: dict | None = None,
        stop_words: list[str] = (),
        logits_trace: list | None = None,
    ) -> list[GenerationResult]:
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
        trace = None if logits_trace is None else {}
        decoder = BatchDecoder(self, rows_at_once, trace)
        sampling = dict(
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            penalties=penalties,
        )
        stop = self._stop_ids(stop_token_ids)
        for i, prompt in enumerate(prompts):
            decoder.add(
                i,
                prompt,
                stop=StopRule(self.tokenizer, max_tokens, stop, stop_words),
                sampling=sampling,
                seed=self.options.seed if seeds is None else seeds[i],
            )
        with self.batch_pool(rows_at_once):
            rows = decoder.run()
            self._last = decoder.batch_stats(rows) | decode_figures(
                decoder.decode,
                decoder.decode["batch_steps"],
                decoder.decode["batch_tokens"],
            )
            common = self.stats()  # with the batch's expert buffer
        if logits_trace is not None:
            logits_trace[:] = [trace[i] for i in range(len(prompts))]
        return [GenerationResult.of_row(r, r.stats(common)) for r in rows]

    @contextmanager
    def batch_pool(self, rows_at_once: int):
        """While the block runs, every layer's slot pool holds min(experts, rows x K) slots
        when the configured budget (the B = 1 budget) holds fewer, so a batch's union of
        experts always fits; then the configured size again."""
        configured = self.resolved.slots_per_layer
        wanted = min(rows_at_once * self.experts_per_token, self.index.num_experts)
        self._resize_slots(max(configured, wanted))
        try:
            yield self
        finally:
            self._resize_slots(configured)

    def _stop_ids(self, stop_token_ids: set[int] | None) -> set[int]:
        ids = self.tokenizer.eos_token_ids if stop_token_ids is None else stop_token_ids
        return set(ids)

    def _resize_slots(self, n_slots: int) -> None:
        """Every MoE layer's slot pool to `n_slots` (not in resident mode: all are held)."""
        if self.options.mode == "resident" or n_slots == self.slots_per_layer:
            return
        for block in self.blocks.values():
            block.switch_mlp.resize(n_slots)

    # -- accounting -------------------------------------------------------------------------
    def snapshot(self) -> dict:
        """The counters now, with the store's reads and the pools' lookups (moe.snapshot)."""
        return snapshot(self.counters, self.store, self.blocks)

    @property
    def slots_per_layer(self) -> int:
        """What each layer's pool holds now (the configured size, or a batch's)."""
        return self.figures.slots_per_layer

    def stats(self) -> dict:
        """The engine's figures since load (batch.py: `Figures`) with the last generate_batch's."""
        return self.figures() | self._last

    def close(self) -> None:
        self.store.close()


class Sequence:
    """One sequence (B = 1) on an engine: its cache and plans, carried from step to step."""

    def __init__(self, engine: Engine):
        self.engine, self.cache, self.plans = engine, engine.step.new_cache(), None
        self.position = self.steps = 0

    def prefill(self, tokens: list[int], sampler: RowSampler | None = None) -> mx.array:
        """The prompt into the cache, the first step planned; its last logits [vocab].
        `sampler`: the one that will sample from them (None: greedy), for a draft hedge."""
        logits, self.plans = self.engine.step.prefill(
            list(tokens), self.cache, samplers=None if sampler is None else [sampler]
        )
        self.position = len(tokens)
        return logits

    def step(self, token: int, sampler: RowSampler | None = None) -> mx.array:
        """Consume `token`; the next logits [vocab]. `sampler`: the one that will sample from
        them (None: greedy), for a draft hedge."""
        self.steps += 1
        logits, self.plans = self.engine.step(
            mx.array([[int(token)]]),
            self.cache,
            self.plans,
            samplers=None if sampler is None else [sampler],
            where=f"at decode step {self.steps} (position {self.position})",
        )
        self.position += 1
        return logits[0]

    def forced(self, tokens: list[int], chunk: int) -> Iterator[mx.array]:
        """Teacher forcing: consume `tokens` in pieces of up to `chunk` positions, one step a
        piece, yielding each piece's logits [L, vocab] (after each of its tokens, as `step`
        gives them one at a time). Prerouted, a piece routes each position on the heads'
        prediction from the position before it, made in the pass; under a wrap-around head
        a piece runs to a fixed point, in passes (step.py)."""
        if chunk < 1:
            raise ConfigError(f"chunk {chunk}: a piece holds at least one position")
        for start in range(0, len(tokens), chunk):
            piece = [int(t) for t in tokens[start : start + chunk]]
            self.steps += 1
            logits, self.plans = self.engine.step(
                mx.array([piece]),
                self.cache,
                self.plans,
                all_logits=True,
                where=f"teacher-forced at positions {self.position}.."
                f"{self.position + len(piece) - 1}",
            )
            self.position += len(piece)
            yield logits[0]


def _streaming_model(directory: Path, config, family, index, options, width):
    """(model, store, counters): mlx-lm's model with its MoE blocks replaced (on the
    instance) by streaming ones reading the store, its resident weights loaded;
    `width`: (slots per layer, K)."""
    slots, k = width
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    moe_in_model = family.moe_layers(model)
    if moe_in_model != list(index.moe_layers):
        raise CheckpointError(
            f"{directory}: index lists MoE layers {index.moe_layers} but the "
            f"config builds {moe_in_model}; re-run convert"
        )
    dtype = activation_dtype(options.compute_dtype, directory)
    refuse_unserved_experts(index, directory / INDEX_NAME, dtype)
    store = ExpertStore(
        directory,
        index,
        io_workers=options.io_workers,
        io_throttle_mbps=options.io_throttle_mbps,
        verify_crc=options.verify_crc,
    )
    counters = Counters()
    layers = family.layers(model)
    compute_dtype = resolve_compute_dtype(options.compute_dtype)
    for i in index.moe_layers:
        switch = StreamingSwitchGLU(
            i, index, store, slots, counters, scale_dtype=compute_dtype
        )
        # Instance-level replacement: mlx-lm's classes stay untouched.
        layers[i].mlp = family.block_class(layers[i].mlp, switch, k)

    check_resident(directory / RESIDENT_NAME, index)
    resident = load_resident(directory / RESIDENT_NAME)
    quantize_like_mlx_lm(model, config, resident)
    check_resident_names(model, resident, directory / RESIDENT_NAME)
    model.load_weights(list(resident.items()), strict=False)
    # Slot buffers were made in their serving dtypes above and are filled by reads.
    cast_floating(model, compute_dtype, skip=".switch_mlp.glu.")
    return model, store, counters
