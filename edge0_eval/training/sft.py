"""Stage 2 (`edge0-eval train-lora`): LoRA SFT of the student on the teacher's completions.

    edge0-eval train-lora TEACHER STUDENT --prompts prompts.jsonl \\
        --out STUDENT/lora.safetensors [--steps 200 --batch 4 --lr 1e-4 --rank 16 --alpha 32]

The fp16 teacher (mlx-lm) completes every prompt once (greedy unless --teacher-temperature;
cached in `<out>.ckpt/teacher.jsonl`, resumable per prompt). The student - int4 experts streamed
into the slot pool, prerouted routing, exactly the path served (see served.py) - is trained on
those completions (prompt tokens carry no loss) with one of two losses:

  --loss kl (default)  the teacher's next-token distribution at every completion position:
                       forward KL(teacher || student) over the teacher's top-k tokens plus a
                       tail bucket (--kl-topk; the teacher re-scores each batch, teacher-forced)
  --loss ce            next-token cross-entropy on the completion tokens (hard labels)

Why kl is the default: the adapter's job is to recover the teacher's distribution that int4 and
routing replacement distorted; soft labels carry that distribution at every position, while hard
labels only carry its argmax (or one sample of it), which on a flat distribution mostly teaches
the student to be over-confident - on the tiny random-weight models `ce` with a sampled or
greedy teacher raised held-out KL(student || teacher) in some settings where `kl` lowered it.

Only the unmerged LoRA matrices on resident attention / linear-attention / shared-expert
projections train; base weights are frozen and routed experts stay int4 and untrained.

Checkpoints and the resume rule: see training/stage.py; the memory bound: training/trainer.py.
After training the adapter is written in the served format (metadata source, stage="sft", step,
model, K) and evaluated on held-out prompts (training/evaluate.py); report `<out
stem>.report.json` / `.md`.

The models may also be given as `train-lora STUDENT --teacher TEACHER`.
"""

from __future__ import annotations

import mlx.core as mx

from edge0_eval.errors import ConfigError
from edge0_eval.training.batches import batch_indices, collate, fit
from edge0_eval.training.losses import cross_entropy_loss, masked_kl, teacher_topk
from edge0_eval.training.stage import StageImpl, run_stage
from edge0_eval.training.stage_options import StageOptions
from edge0_eval.training.teacher import teacher_log_probs


class SFT(StageImpl):
    name = "sft"
    needs_teacher_train = True

    def __init__(self, opts: StageOptions):
        self.opts = opts
        self.examples = []
        self.loss_name = (
            "next-token cross-entropy on the teacher's completion tokens"
            if opts.loss == "ce"
            else f"forward KL(teacher || student), tail-aware top-{opts.kl_topk}, on "
            f"the teacher's completions"
        )

    def prepare(self, setup, data) -> None:
        n = len(setup.train_prompts)
        examples = [
            fit(data.example(f"train:{i}"), self.opts.seq_len) for i in range(n)
        ]
        self.examples = [e for e in examples if e is not None]
        if not self.examples:
            raise ConfigError(
                f"no training prompt leaves room for a completion within "
                f"--seq-len {self.opts.seq_len}; raise --seq-len"
            )
        self.pad = int(getattr(setup.tokenizer, "pad_token_id", None) or 0)

    def batch(self, setup, step: int):
        ids = batch_indices(step, self.opts.batch, len(self.examples), self.opts.seed)
        batch = collate([self.examples[i] for i in ids], self.pad)
        if self.opts.loss == "ce":
            return batch, None
        aux = teacher_topk(
            teacher_log_probs(setup.teacher, batch.tokens), self.opts.kl_topk
        )
        mx.eval(aux)
        return batch, aux

    def loss_fn(self, logits, rows, batch, aux):
        if self.opts.loss == "ce":
            return cross_entropy_loss(logits, rows, batch, aux)
        return masked_kl(logits, rows, batch, aux, "forward")

    def report_extra(self, opts: StageOptions) -> dict:
        return {
            "train_examples": len(self.examples),
            "loss": opts.loss,
            "kl_topk": opts.kl_topk if opts.loss == "kl" else None,
            "teacher_temperature": opts.teacher_temperature,
        }


def train_lora(
    opts: StageOptions, stop_after: int | None = None, kill_after: int | None = None
) -> dict:
    return run_stage(opts, SFT, stop_after, kill_after)
