"""Stage 3 (`edge0-eval distill`): on-policy distillation of the student towards the teacher.

    edge0-eval distill TEACHER STUDENT --prompts prompts.jsonl \\
        --init-adapter STUDENT/lora.safetensors --out STUDENT/lora-distill.safetensors

Each step: the student samples a completion for every prompt of the batch on its own served path
(`Engine.generate`: int4 experts from the slot pool, prerouted routing with staging, the current
LoRA; temperature --temperature, top-p --top-p, seeded per (seed, step, row)); the teacher scores
the sequences teacher-forced; the loss at every position that predicts a sampled token is the
tail-aware top-k reverse KL

    S = the teacher's top-k tokens at that position, buckets B = S + {tail}
    p_s(b), p_t(b): student / teacher probability of each token of S, and the tail bucket's
                    mass 1 - sum_S (computed as a log-sum-exp over the complement, stable)
    loss = sum_b p_s(b) (log p_s(b) - log p_t(b))    = KL(student || teacher) on the buckets

summed over positions and divided by their count; gradients reach only the LoRA (teacher and
samples are constants). k = --kl-topk (capped at vocab - 1 so the tail bucket is not empty).
Checkpoints, progress, adapter format and the held-out report are those of stage 2.

The models may also be given as `distill STUDENT --teacher TEACHER`.
"""

from __future__ import annotations

import mlx.core as mx

from edge0_eval.errors import ConfigError
from edge0_eval.training.batches import (
    Example,
    batch_indices,
    collate,
    fit,
    stable_seed,
)
from edge0_eval.training.losses import masked_kl, teacher_topk
from edge0_eval.training.stage import StageImpl, run_stage
from edge0_eval.training.stage_options import StageOptions
from edge0_eval.training.teacher import teacher_log_probs


class Distill(StageImpl):
    name = "distill"
    loss_name = "tail-aware top-k reverse KL on student samples"

    def __init__(self, opts: StageOptions):
        self.opts = opts
        self.prompts = []

    def prepare(self, setup, data) -> None:
        self.prompts = [p for p in setup.train_prompts if len(p) < self.opts.seq_len]
        if not self.prompts:
            raise ConfigError(
                f"every training prompt is at least --seq-len {self.opts.seq_len} "
                f"tokens long; raise --seq-len"
            )
        self.pad = int(getattr(setup.tokenizer, "pad_token_id", None) or 0)

    def batch(self, setup, step: int):
        o = self.opts
        engine = setup.engine
        ids = batch_indices(step, o.batch, len(self.prompts), o.seed)
        examples = []
        seed = engine.options.seed
        try:
            for row, i in enumerate(ids):
                prompt = self.prompts[i]
                engine.options.seed = stable_seed(o.seed, "sample", step, row)
                budget = max(1, min(o.max_new_tokens, o.seq_len - len(prompt)))
                result = engine.generate(
                    prompt,
                    budget,
                    temperature=o.temperature,
                    top_p=o.top_p,
                    stop_token_ids=setup.stop_ids,
                )
                examples.append(fit(Example(prompt, list(result.tokens)), o.seq_len))
        finally:
            engine.options.seed = seed
        batch = collate(examples, self.pad)
        aux = teacher_topk(teacher_log_probs(setup.teacher, batch.tokens), o.kl_topk)
        mx.eval(aux)
        return batch, aux

    def loss_fn(self, logits, rows, batch, aux):
        return masked_kl(logits, rows, batch, aux, "reverse")

    def report_extra(self, opts: StageOptions) -> dict:
        return {
            "kl_topk": opts.kl_topk,
            "temperature": opts.temperature,
            "top_p": opts.top_p,
            "samples": "student, served path, seeded per (seed, step, row)",
        }


def distill(
    opts: StageOptions, stop_after: int | None = None, kill_after: int | None = None
) -> dict:
    return run_stage(opts, Distill, stop_after, kill_after)
