"""OpenCompass model for a plain mlx-lm checkpoint: the teacher arm (any dtype, fully resident)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import List

import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import BatchGenerator, stream_generate
from mlx_lm.sample_utils import make_logits_processors
from mlx_lm.utils import load_tokenizer
from opencompass.registry import MODELS

from edge0_eval.engine.batch import Answer, StopRule, row_sampler
from edge0_eval.engine.inputs import penalties_of
from edge0_eval.engine.mlx_compat import (
    COMPUTE_DTYPES,
    cast_floating,
    resolve_compute_dtype,
    upcast_unquantized_experts_for_cpu,
)
from edge0_eval.errors import CheckpointError, ConfigError
from edge0_eval.evaluation.fidelity.scoring import model_logprobs

from .chat import ChatModelBase


@MODELS.register_module()
class MLXLMModel(ChatModelBase):
    """An mlx-lm model (e.g. the fp16 teacher) loaded with `mlx_lm.load`.

    Config example::

        dict(type=MLXLMModel, abbr='teacher', path='/models/teacher', max_out_len=4096,
             generation_kwargs=dict(temperature=0.6, top_p=0.95),
             chat_template_kwargs=dict(enable_thinking=True), run_cfg=dict(num_gpus=0))

    compute_dtype: the engine's activation policy (`auto`: float32 on the CPU, where MLX
    emulates half precision, the checkpoint's own dtype elsewhere; or float16/bfloat16/float32).
    On the CPU `auto` doubles the memory of unquantized fp16 weights.
    """

    arm = "teacher"

    def __init__(self, path: str, compute_dtype: str = "auto", **kwargs):
        if compute_dtype not in COMPUTE_DTYPES:
            raise ConfigError(
                f"teacher: compute_dtype {compute_dtype!r} is not one of "
                f"{', '.join(COMPUTE_DTYPES)}"
            )
        self.compute_dtype = compute_dtype
        super().__init__(path=path, **kwargs)

    def _load(self, tokenizer_only: bool):
        if not os.path.isfile(os.path.join(self.path, "config.json")):
            raise CheckpointError(
                f"{self.path}: no config.json; not an mlx-lm checkpoint"
            )
        if tokenizer_only:
            return load_tokenizer(Path(self.path))
        self.model, tokenizer = load(self.path)
        cast_floating(self.model, resolve_compute_dtype(self.compute_dtype))
        # MLX's CPU gather_mm only runs float32 (a no-op on Metal and after a float32 cast).
        upcast_unquantized_experts_for_cpu(self.model)
        return tokenizer

    def _sampler(self, seed: int):
        s = self.sampling
        return row_sampler(
            seed,
            float(s["temperature"]),
            top_p=float(s["top_p"]),
            min_p=float(s["min_p"]),
            top_k=int(s["top_k"]),
        )

    def _processors(self):
        """mlx-lm's penalties; mlx-lm hands them the row's prompt and generated tokens."""
        return make_logits_processors(**penalties_of(self.sampling))

    def _generate_tokens(
        self,
        prompt_ids: List[int],
        max_tokens: int,
        stop_ids: set,
        stop_words: List[str],
        seed: int,
    ) -> Answer:
        """One prompt: mlx-lm's stream_generate (the batch_size 1 path)."""
        row = StopRule(self.tokenizer, max_tokens, stop_ids, stop_words)
        mx.reset_peak_memory()
        prompt_tps = gen_tps = 0.0
        tic = time.perf_counter()
        # stream_generate ends on EOS by repeating it in its final response; RowStop drops it.
        for resp in stream_generate(
            self.model,
            self.tokenizer,
            prompt_ids,
            max_tokens=max_tokens,
            sampler=self._sampler(seed),
            logits_processors=self._processors(),
        ):
            prompt_tps, gen_tps = resp.prompt_tps, resp.generation_tps
            if row.add(resp.token):
                break
        return Answer.of(
            row,
            {
                "prefill_tok_s": round(float(prompt_tps), 2),
                "decode_tok_s": round(float(gen_tps), 2),
                "peak_memory_gib": round(mx.get_peak_memory() / 2**30, 4),
                "gen_wall_s": round(time.perf_counter() - tic, 4),
                "cache": "resident",
            },
        )

    def _batch_generator(
        self, rows: int, max_tokens: int, stop_ids: set
    ) -> BatchGenerator:
        """mlx-lm's BatchGenerator as the batch path runs it (rows prefilled one at a time)."""
        return BatchGenerator(
            self.model,
            max_tokens=max_tokens,
            stop_tokens=[[t] for t in sorted(stop_ids)],
            completion_batch_size=rows,
            prefill_batch_size=1,
        )

    def _generate_batch(
        self,
        prompts: List[List[int]],
        max_tokens: int,
        stop_ids: set,
        stop_words: List[str],
        seeds: List[int],
    ) -> List[Answer]:
        """Several prompts at once: mlx-lm's BatchGenerator, one sampler (own key) per row.

        prefill_batch_size=1: each row's prompt is prefilled alone, then joins the batch's
        decode. Batched prefill right-pads shorter prompts, which moves their logits (measured
        on the tiny bailing_hybrid teacher); prefilled alone, every row's logits and tokens equal
        its stream_generate run here.
        """
        if len(prompts) == 1:
            return super()._generate_batch(
                prompts, max_tokens, stop_ids, stop_words, seeds
            )
        rows = [
            StopRule(self.tokenizer, max_tokens, stop_ids, stop_words) for _ in prompts
        ]
        figures = [
            dict(prefill_s=0.0, decode_s=0.0, steps=0, wall_s=None, peak=None)
            for _ in prompts
        ]
        mx.reset_peak_memory()
        start = time.perf_counter()
        gen = self._batch_generator(len(prompts), max_tokens, stop_ids)
        try:
            uids = gen.insert(
                prompts,
                [max_tokens] * len(prompts),
                samplers=[self._sampler(seed) for seed in seeds],
                logits_processors=[self._processors() for _ in prompts],
            )
            totals = _decode_rows(
                gen, {u: i for i, u in enumerate(uids)}, rows, figures, start
            )
        finally:
            gen.close()
        return _answers(prompts, rows, figures, totals, time.perf_counter() - start)

    def fidelity_logprobs(self, items: list[dict]) -> list[dict]:
        """Teacher-forced log-probs of fidelity items (datasets/edge0_fidelity.py), scored
        together by the set's scorer (evaluation.fidelity.scoring.model_logprobs)."""
        return model_logprobs(self.model, items)


def _decode_rows(gen, where: dict, rows: list, figures: list, start: float) -> dict:
    """Step the generator until every row's stop rules end it, timing each row; the
    batch's prompt and decode totals."""
    totals = dict(prompt_s=0.0, decode_s=0.0, tokens=0)
    left = len(rows)
    while left:
        with gen.stats() as st:
            prompt_resps, gen_resps = gen.next()
        if not prompt_resps and not gen_resps:
            raise RuntimeError(
                f"teacher: BatchGenerator stopped with {left} rows unfinished"
            )
        totals["prompt_s"] += st.prompt_time
        totals["decode_s"] += st.decode_time
        totals["tokens"] += len(gen_resps)
        # Prefill time belongs to the rows whose prompt was processed this call; the
        # rest of the call (the first decode step's graph) to the rows entering decode.
        chunk = [where[r.uid] for r in prompt_resps if not r.end_of_prompt]
        entering = [where[r.uid] for r in prompt_resps if r.end_of_prompt]
        other = max(0.0, st.wall_time - st.prompt_time - st.decode_time)
        for i in chunk:
            figures[i]["prefill_s"] += st.prompt_time / len(chunk)
        for i in entering:
            figures[i]["prefill_s"] += other / len(entering)
        ended = []
        for r in gen_resps:
            i = where[r.uid]
            if rows[i].finish is not None:
                continue
            figures[i]["decode_s"] += st.decode_time
            figures[i]["steps"] += 1
            if rows[i].add(r.token):
                figures[i]["wall_s"] = time.perf_counter() - start
                figures[i]["peak"] = mx.get_peak_memory()
                left -= 1
                if r.finish_reason is None:  # a stop word: only RowStop sees text
                    ended.append(r.uid)
            elif r.finish_reason is not None:
                raise RuntimeError(
                    f"teacher: BatchGenerator ended row {i} "
                    f"({r.finish_reason}) before its stop rules did"
                )
        if ended:
            gen.remove(ended)
    return totals


def _answers(prompts, rows, figures, totals: dict, wall_s: float) -> List[Answer]:
    """Each row's answer with its own figures and the batch's."""
    batch = {
        "batch_wall_s": round(wall_s, 4),
        "batch_prefill_tok_s": round(sum(map(len, prompts)) / totals["prompt_s"], 2)
        if totals["prompt_s"] > 0
        else 0.0,
        "batch_decode_tok_s": round(totals["tokens"] / totals["decode_s"], 2)
        if totals["decode_s"] > 0
        else 0.0,
    }
    out = []
    for ids, row, f in zip(prompts, rows, figures):
        prefill, decode = f["prefill_s"], f["decode_s"]
        stats = {
            "wall_s": f["wall_s"],
            "prefill_tok_s": round(len(ids) / prefill, 2) if prefill else 0.0,
            # The row's own rate: its tokens over the decode steps it took part in.
            "decode_tok_s": round(f["steps"] / decode, 2) if decode else 0.0,
            "peak_memory_gib": round(f["peak"] / 2**30, 4),
            "gen_wall_s": round(f["wall_s"], 4),
            "cache": "resident",
            **batch,
        }
        out.append(Answer.of(row, stats))
    return out
