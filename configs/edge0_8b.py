# Edge0 8B tier (Ling 3.0 tiny, mlx-lm bailing_hybrid): fp16 teacher vs Edge0 student on
# AIME 2026, HumanEval, GPQA-Diamond, MMLU-Pro and IFBench.
#
#   edge0-eval data stage --root D --aime2026 aime2026.jsonl --gpqa gpqa_diamond.csv \
#       --mmlu-pro mmlu_pro/ --nltk-data ~/nltk_data
#   export COMPASS_DATA_CACHE=D
#   export EDGE0_8B_TEACHER=/models/ling-3.0-tiny-fp16      # mlx-lm checkpoint
#   export EDGE0_8B_STUDENT=/models/ling-3.0-tiny-edge0     # `edge0-eval convert` output with
#                                                            # lora.safetensors, prerouter.safetensors
#   opencompass configs/edge0_8b.py
#
# Arms (EDGE0_ARMS, comma-separated; default teacher,student):
#   teacher           fp16 teacher, fully resident (mlx-lm)
#   student           int4 experts streamed from disk, prerouted, native top-8, LoRA
#   int4_exact        ablation: int4 experts, exact routing (true router), no LoRA
#   prerouted_nolora  ablation: prerouted without LoRA
# so a report can split the teacher-student gap into quantization (teacher - int4_exact),
# prerouting (int4_exact - prerouted_nolora) and LoRA recovery (student - prerouted_nolora).
#
# Generation settings, identical for every arm (see configs/README.md):
#   thinking on (chat template enable_thinking=True, ignored by a template without that switch;
#   the <think> block is removed before
#   scoring), temperature 0.6, top_p 0.95, seed 0, at most 32768 new tokens, prompt + output
#   within 40960 tokens, one sample per question.
import os

from mmengine.config import read_base

from model_wrappers.edge0_model import Edge0Model
from model_wrappers.mlx_lm_model import MLXLMModel
from model_wrappers.partitioner import Edge0Partitioner
from model_wrappers.summarizer import Edge0Summarizer
from opencompass.runners import LocalRunner
from opencompass.tasks import OpenICLEvalTask, OpenICLInferTask
from opencompass.utils.text_postprocessors import extract_non_reasoning_content

with read_base():
    from .datasets.edge0_bundle import (edge0_dataset_abbrs, edge0_datasets,
                                        edge0_summary_groups)

datasets = edge0_datasets

generation = dict(
    max_out_len=32768, max_seq_len=40960, batch_size=1,
    generation_kwargs=dict(temperature=0.6, top_p=0.95, seed=0),
    chat_template_kwargs=dict(enable_thinking=True),
    pred_postprocessor=dict(type=extract_non_reasoning_content),
    run_cfg=dict(num_gpus=0),
)
# Routing width the student is served at: None = the model's native top-8 (the reference
# states a reduced K only for the 35B tier).
student_k = None
arms = os.environ.get('EDGE0_ARMS', 'teacher,student').split(',')
unknown_arms = [a for a in arms if a not in ('teacher', 'student', 'int4_exact',
                                             'prerouted_nolora')]
if unknown_arms:
    raise SystemExit(f'edge0-eval: EDGE0_ARMS has unknown arms {unknown_arms}; choose from '
                     'teacher, student, int4_exact, prerouted_nolora')
if 'teacher' in arms and not os.environ.get('EDGE0_8B_TEACHER'):
    raise SystemExit('edge0-eval: EDGE0_8B_TEACHER is not set: export it to the fp16 '
                     'teacher (an mlx-lm checkpoint directory)')
if set(arms) - {'teacher'} and not os.environ.get('EDGE0_8B_STUDENT'):
    raise SystemExit('edge0-eval: EDGE0_8B_STUDENT is not set: export it to the student '
                     'directory (`edge0-eval convert` output holding lora.safetensors and '
                     'prerouter.safetensors)')

models = []
if 'teacher' in arms:
    models.append(dict(type=MLXLMModel, abbr='edge0-8b-teacher',
                       path=os.environ['EDGE0_8B_TEACHER'], **generation))
if 'student' in arms:
    models.append(dict(type=Edge0Model, abbr='edge0-8b-student',
                       path=os.environ['EDGE0_8B_STUDENT'], mode='prerouted', top_k=student_k,
                       **generation))
if 'int4_exact' in arms:
    models.append(dict(type=Edge0Model, abbr='edge0-8b-int4-exact',
                       path=os.environ['EDGE0_8B_STUDENT'], mode='reactive', top_k=student_k,
                       no_lora=True, no_prerouter=True, **generation))
if 'prerouted_nolora' in arms:
    models.append(dict(type=Edge0Model, abbr='edge0-8b-prerouted-nolora',
                       path=os.environ['EDGE0_8B_STUDENT'], mode='prerouted',
                       top_k=student_k, no_lora=True, **generation))

# One machine: each arm is one task holding all datasets (the model loads once), and arms run
# one after another so the fp16 teacher and the students never share memory or SSD bandwidth.
infer = dict(
    partitioner=dict(type=Edge0Partitioner),
    runner=dict(type=LocalRunner, max_num_workers=1, task=dict(type=OpenICLInferTask)),
)
eval = dict(
    partitioner=dict(type=Edge0Partitioner, check_models=False),
    runner=dict(type=LocalRunner, max_num_workers=2, task=dict(type=OpenICLEvalTask)),
)
summarizer = dict(type=Edge0Summarizer, dataset_abbrs=edge0_dataset_abbrs,
                  summary_groups=edge0_summary_groups)
work_dir = 'outputs/edge0_8b'

del os  # a module in the config namespace would break the config dump OpenCompass re-reads
