"""OpenCompass model for a plain mlx-lm checkpoint: the teacher arm (any dtype, fully resident)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Dict, List

import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import stream_generate
from mlx_lm.sample_utils import make_logits_processors, make_sampler
from mlx_lm.utils import load_tokenizer
from opencompass.registry import MODELS

from edge0_eval.engine.mlx_compat import (COMPUTE_DTYPES, cast_floating, resolve_compute_dtype,
                                          upcast_unquantized_experts_for_cpu)
from edge0_eval.errors import CheckpointError, ConfigError
from edge0_eval.evaluation.fidelity import model_logprobs

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

    arm = 'teacher'

    def __init__(self, path: str, compute_dtype: str = 'auto', **kwargs):
        if compute_dtype not in COMPUTE_DTYPES:
            raise ConfigError(f'teacher: compute_dtype {compute_dtype!r} is not one of '
                              f'{", ".join(COMPUTE_DTYPES)}')
        self.compute_dtype = compute_dtype
        super().__init__(path=path, **kwargs)

    def _load(self, tokenizer_only: bool):
        if not os.path.isfile(os.path.join(self.path, 'config.json')):
            raise CheckpointError(f'{self.path}: no config.json; not an mlx-lm checkpoint')
        if tokenizer_only:
            return load_tokenizer(Path(self.path))
        self.model, tokenizer = load(self.path)
        cast_floating(self.model, resolve_compute_dtype(self.compute_dtype))
        # MLX's CPU gather_mm only runs float32 (a no-op on Metal and after a float32 cast).
        upcast_unquantized_experts_for_cpu(self.model)
        return tokenizer

    def _generate_tokens(self, prompt_ids: List[int], max_tokens: int, stop_ids: set,
                         stop_words: List[str]) -> tuple[List[int], Dict[str, Any]]:
        s = self.sampling
        # Re-seed per sample: a sample's output does not depend on what ran before it.
        mx.random.seed(int(s['seed']))
        sampler = make_sampler(temp=float(s['temperature']), top_p=float(s['top_p']),
                               min_p=float(s['min_p']), top_k=int(s['top_k']))
        processors = make_logits_processors(repetition_penalty=s['repetition_penalty'])
        mx.reset_peak_memory()
        tokens: List[int] = []
        text = ''
        prompt_tps = gen_tps = 0.0
        finish = 'length'
        tic = time.perf_counter()
        for resp in stream_generate(self.model, self.tokenizer, prompt_ids, max_tokens=max_tokens,
                                    sampler=sampler, logits_processors=processors):
            prompt_tps, gen_tps = resp.prompt_tps, resp.generation_tps
            text += resp.text
            if resp.finish_reason == 'stop':
                finish = 'eos'  # the final response repeats the EOS token: not output
                break
            if resp.token in stop_ids:
                finish = 'stop_token'
                break
            tokens.append(int(resp.token))
            if resp.finish_reason == 'length':
                break
            # Multi-token stop strings: stop as soon as one shows up in the text.
            if stop_words and any(w in text for w in stop_words):
                finish = 'stop_word'
                break
        return tokens, {
            'prefill_tok_s': round(float(prompt_tps), 2),
            'decode_tok_s': round(float(gen_tps), 2),
            'peak_memory_gib': round(mx.get_peak_memory() / 2**30, 4),
            'finish_reason': finish,
            'gen_wall_s': round(time.perf_counter() - tic, 4),
            'cache': 'resident',
        }

    def fidelity_logprobs(self, prompt_ids, tokens, topk_ids) -> dict:
        """Teacher-forced log-probs, mlx-lm's prefill then steps (datasets/edge0_fidelity.py)."""
        return model_logprobs(self.model, prompt_ids, tokens, topk_ids)
