# The embedded default: a tiny teacher and its Edge0 student on fixture data for all five
# benchmarks. Everything here is built by the project, offline:
#     edge0-eval demo          # makes the models and data, runs this config, checks the results
# or by hand:
#     edge0-eval make-tiny M/teacher --family qwen3_5_moe && edge0-eval convert M/teacher M/student
#     edge0-eval train-prerouter M/student --text T --out M/student/prerouter.safetensors
#     edge0-eval train-lora ... --out M/student/lora.safetensors
#     edge0-eval data fixtures --root D
#     COMPASS_DATA_CACHE=D EDGE0_TINY_TEACHER=M/teacher EDGE0_TINY_STUDENT=M/student \
#         opencompass configs/edge0_tiny.py
# AIME and IFBench use the raw-prompt ({role, content}) configs, the rest PromptLists, so one
# run exercises both prompt shapes. EDGE0_ARMS=teacher (or student) runs one arm. Fidelity
# (configs/datasets/edge0_fidelity.py) needs a set from the teacher:
#     edge0-eval fidelity make M/teacher --out D/data/fidelity/fidelity_set.json --limit 4
import os

from mmengine.config import read_base

from model_wrappers.edge0_model import Edge0Model
from model_wrappers.mlx_lm_model import MLXLMModel
from model_wrappers.partitioner import Edge0Partitioner
from model_wrappers.summarizer import Edge0Summarizer
from opencompass.runners import LocalRunner
from opencompass.tasks import OpenICLEvalTask, OpenICLInferTask

with read_base():
    from .datasets.edge0_bundle import edge0_dataset_abbrs, edge0_datasets
    from .datasets.edge0_bundle_rawprompt import edge0_raw_datasets
    from .datasets.edge0_fidelity import edge0_fidelity_datasets

# The MMLU-Pro categories the fixture has (edge0_eval.evaluation.fixtures.MMLU_PRO_FIXTURE_CATEGORIES).
tiny_mmlu_pro = ['mmlu_pro_math', 'mmlu_pro_physics']
datasets = ([d for d in edge0_raw_datasets if d['abbr'] in ('aime2026', 'IFBench')]
            + [d for d in edge0_datasets
               if d['abbr'] in ('openai_humaneval', 'GPQA_diamond', *tiny_mmlu_pro)]
            # Teacher-forced fidelity on the set `edge0-eval demo` makes from the tiny teacher.
            + edge0_fidelity_datasets)

# Identical generation settings for both arms: greedy, thinking off, 24 new tokens.
tiny_generation = dict(max_out_len=24, max_seq_len=2048, batch_size=1,
                       generation_kwargs=dict(temperature=0.0),
                       chat_template_kwargs=dict(enable_thinking=False),
                       run_cfg=dict(num_gpus=0))
# Arms (EDGE0_ARMS, comma-separated; `edge0-eval demo` runs all four):
#   teacher           the fp16 tiny checkpoint through mlx-lm
#   int4_exact        int4 experts streamed, exact routing (true router), no LoRA
#   prerouted_nolora  prediction-as-routing with the student's prerouter heads, no LoRA
#   student           prerouted + the recovery LoRA: exactly the served student path
tiny_arms = os.environ.get('EDGE0_ARMS', 'teacher,student').split(',')
unknown_arms = [a for a in tiny_arms
                if a not in ('teacher', 'student', 'int4_exact', 'prerouted_nolora')]
if unknown_arms:
    raise SystemExit(f'edge0-eval: EDGE0_ARMS has unknown arms {unknown_arms}; choose from '
                     'teacher, student, int4_exact, prerouted_nolora')
models = []
if 'teacher' in tiny_arms:
    if not os.environ.get('EDGE0_TINY_TEACHER'):
        raise SystemExit('edge0-eval: EDGE0_TINY_TEACHER is not set: export it to a tiny '
                         'checkpoint from `edge0-eval make-tiny` (or run `edge0-eval demo`)')
    models.append(dict(type=MLXLMModel, abbr='edge0-tiny-teacher',
                       path=os.environ['EDGE0_TINY_TEACHER'], **tiny_generation))
if set(tiny_arms) - {'teacher'} and not os.environ.get('EDGE0_TINY_STUDENT'):
    raise SystemExit('edge0-eval: EDGE0_TINY_STUDENT is not set: export it to the output of '
                     '`edge0-eval convert` with its adapters (or run `edge0-eval demo`)')
# A small slot pool, so the student arms really stream (the tiny model has 16 experts x 4 layers).
tiny_student = dict(type=Edge0Model, path=os.environ.get('EDGE0_TINY_STUDENT', ''),
                    slots_per_layer=8, **tiny_generation)
if 'int4_exact' in tiny_arms:
    models.append(dict(abbr='edge0-tiny-int4-exact', mode='reactive', no_lora=True,
                       no_prerouter=True, **tiny_student))
if 'prerouted_nolora' in tiny_arms:
    models.append(dict(abbr='edge0-tiny-prerouted-nolora', mode='prerouted', no_lora=True,
                       **tiny_student))
if 'student' in tiny_arms:
    models.append(dict(abbr='edge0-tiny-student', mode='prerouted', **tiny_student))

infer = dict(
    # One task per arm (all datasets in it, so each model loads once), one arm at a time. The
    # partitioner checks data and models before anything starts.
    partitioner=dict(type=Edge0Partitioner, full_data=False),
    runner=dict(type=LocalRunner, max_num_workers=1, task=dict(type=OpenICLInferTask)),
)
eval = dict(
    partitioner=dict(type=Edge0Partitioner, full_data=False, check_models=False),
    runner=dict(type=LocalRunner, max_num_workers=2, task=dict(type=OpenICLEvalTask)),
)
summarizer = dict(
    type=Edge0Summarizer,
    dataset_abbrs=edge0_dataset_abbrs,
    summary_groups=[dict(name='mmlu_pro', subsets=tiny_mmlu_pro),
                    dict(name='mmlu_pro_per_question', subsets=tiny_mmlu_pro,
                         weights='num_items')],
)
work_dir = 'outputs/edge0_tiny'

del os  # a module in the config namespace would break the config dump OpenCompass re-reads
