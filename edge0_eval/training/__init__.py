"""Stages 2 and 3: LoRA training of the student on the path it is served on.

    sft.py       `edge0-eval train-lora`: SFT on the fp16 teacher's completions
    distill.py   `edge0-eval distill`: on-policy distillation, tail-aware top-k reverse KL
    served.py    the student's served forward over whole sequences, with gradients
    common.py    options, prompts, model checks, teacher data, training step, checkpoints
    stage.py     the loop both stages share
    evaluate.py  held-out KL(student || teacher) and top-1 agreement, report
"""
