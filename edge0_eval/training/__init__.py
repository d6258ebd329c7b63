"""The three training stages, one module each, on one shared stack (their verbs:
train_prerouter.py, train_lora.py and distill.py at the package's top).

    prerouter_fit.py  `edge0-eval train-prerouter`: stage 1, distil prerouter heads
    features.py       stage 1's data: the teacher's routing records, batches of them
    sft.py            `edge0-eval train-lora`: stage 2, SFT on the fp16 teacher's completions
    on_policy.py      `edge0-eval distill`: stage 3, on-policy distillation (top-k reverse KL)

Shared by them:
    stage_options.py  options and command lines (the run/checkpoint arguments defined once)
    corpus.py         documents and prompts, held-out splits, encoding
    models.py         teacher and student loading and checks; the defaults derived from a model
    state.py          checkpoint files, fingerprints, the resume rule, report paths, test hooks
    batches.py        examples and padded batches, seeded per (seed, step)
    teacher.py        teacher completions (cached, resumable) and log-probabilities
    losses.py         cross-entropy, tail-aware top-k KL, stage 1's K-hot loss and recall
    served.py         the student's served forward over whole sequences, with gradients
    trainer.py        the optimizer step on the served path, LoRA state, the LR schedule
    stage.py          the loop stages 2 and 3 share
    evaluate.py       held-out KL(student || teacher) and top-1 agreement, report
"""
