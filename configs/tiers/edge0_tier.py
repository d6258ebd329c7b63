# What the 35B and 8B tiers share: benchmarks, generation, arms, partitioning, summary. Each tier
# config builds its arms from `edge0_tier` and the EDGE0_* variables
# (edge0_eval/evaluation/plan/tiers.py says which), stopping on a missing or bad one.
#
# Generation settings, identical for every arm (see configs/README.md):
#   thinking on (chat template enable_thinking=True, ignored by a template without that switch;
#   the <think> block is removed before scoring, and an output cut inside it scores as an empty
#   answer: configs/datasets/ apply both), sampling below (EDGE0_SAMPLING), seed 0, at most
#   32768 new tokens, prompt + output within 40960 tokens, one sample per question.
import os

from mmengine.config import read_base

from model_wrappers.partitioners.partitioner import Edge0Partitioner
from model_wrappers.summarizers.summarizer import Edge0Summarizer
from opencompass.runners import LocalRunner
from opencompass.tasks import OpenICLEvalTask, OpenICLInferTask

with read_base():
    from ..datasets.edge0_bundle import (
        edge0_dataset_abbrs,
        edge0_datasets,
        edge0_summary_groups,
    )
    from ..datasets.edge0_fidelity import edge0_fidelity_datasets
    from .edge0_api import edge0_api_arms, edge0_api_paths
    from .edge0_arms import edge0_arm_paths, edge0_arms

# Project code, called at parse time: mmengine parses a config's import statements into
# placeholders that cannot be called, so this module comes through the builtin __import__.
edge0_tiers = __import__("edge0_eval.evaluation.plan.tiers", fromlist=["tier_models"])
# The five benchmarks, then teacher-forced fidelity on a set made from the tier's fp16 teacher
# (`edge0-eval fidelity make`, laid out by `edge0-eval data stage --fidelity FILE`); a run with
# a served arm (edge0_api.py) leaves fidelity out: it needs the model in the process.
datasets = edge0_tiers.tier_datasets(
    os.environ, edge0_datasets, edge0_fidelity_datasets, edge0_api_arms
)

# Sampling, chosen by EDGE0_SAMPLING (default `opencompass`), the same for every arm of a run
# (`report` refuses to pair arms, and `gate` a baseline, sampled otherwise):
#   opencompass  temperature 0.6, top_p 0.95: OpenCompass's setting for reasoning models
#                (docs/en/user_guides/deepseek_r1.md in its package), so scores sit beside
#                OpenCompass-style references, and the one the prerouter hedge's sampled
#                precision was measured at (reports/hedge). Neither tier's card setting is used by
#                default: the Qwen card's penalty means another thing under mlx-lm (below), the
#                card's temperature 1.0 draws more varied samples, so a paired gate sees more
#                churn (less power) per item, and OpenCompass gives a model one setting for all
#                benchmarks, so a coding-only value cannot apply to HumanEval alone.
#   card         35B only: the thinking settings copies of the Qwen3.5/3.6 model card recommend
#                for general tasks, temperature 1.0, top_p 0.95, top_k 20, presence_penalty 1.5
#                (temperature 0.6 for precise coding). mlx-lm's semantics, on both arms: the
#                presence penalty acts on the last 20 tokens, the prompt included
#                (presence_context_size), where the vLLM/OpenAI definition the card assumes acts on
#                every generated token and none of the prompt; and the prerouter hedge drafts the
#                next token without penalties. The 8B tier (Ling) has no card setting gathered.
edge0_tier_sampling = {
    "opencompass": {
        "35b": dict(temperature=0.6, top_p=0.95),
        "8b": dict(temperature=0.6, top_p=0.95),
    },
    "card": {"35b": dict(temperature=1.0, top_p=0.95, top_k=20, presence_penalty=1.5)},
}
generation = dict(
    max_out_len=32768,
    max_seq_len=40960,
    chat_template_kwargs=dict(enable_thinking=True),
    run_cfg=dict(num_gpus=0),
)

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
summarizer = dict(
    type=Edge0Summarizer,
    dataset_abbrs=edge0_dataset_abbrs,
    summary_groups=edge0_summary_groups,
)

# batch_size per tier and arm: the prompts OpenCompass hands a model per call, decoded together
# (each row equals its run alone). A row costs, at the 40,960-token limit (a batch's caches pad
# every row to the longest), 35B: 0.84 GiB of KV/SSM state + (student) K x 40 layers x 1.69 MiB
# of expert slots (the pool grows to rows x K per layer); 8B: 0.15 GiB + 8 x 23 x 1.27 MiB.
#   35B student: ~3 GiB at B=1 + 8 x 1.1 GiB <= 12 GiB, leaving a 24 GB machine ~10 GiB for
#     the OS and the page cache the experts stream through (B=12 would leave ~6 GiB).
#   8B student: 0.37 GiB a row; B=8 holds half of the 128 experts per layer, so it still streams.
#   Teachers (fp16, on a bigger machine): 35B 64.6 GiB of weights + 8 x 0.84 GiB = 71 GiB, a
#     128 GB machine (batch_size=1, 65 GiB, on 96 GB); 8B 14.5 + 8 x 0.15 = 16 GiB, 32 GB.
#   Served arms: the rows per host are its server's --max-batch; a call hands out batch_size
#     prompts at once, spread over the hosts, so student_api's batch_size is 8 x its hosts.
edge0_tier_batch = {"35b": dict(teacher=8, student=8), "8b": dict(teacher=8, student=8)}

# Per tier: the Edge0Model settings every student arm shares. 35B: served at K=4 (native top-8),
# as in the reference design; 8B: the native top-8 (the reference reduces K only on 35B).
edge0_tier_students = {
    "35b": dict(experts_per_token=4),
    "8b": dict(experts_per_token=None),
}
edge0_roles = dict(
    teacher="the fp16 teacher (an mlx-lm checkpoint directory)",
    student="the student directory (`edge0-eval convert` output holding "
    "lora.safetensors and prerouter.safetensors)",
)
# Everything a tier config builds its arms from (tiers.tier_models): each selected arm of
# EDGE0_ARMS, on its role's model directory (EDGE0_<TIER>_TEACHER, _STUDENT) or its servers
# (EDGE0_<TIER>_TEACHER_API, _STUDENT_API: http://host-a:8001/v1,http://host-b:8001/v1; the
# role's directory is then their local tokenizer copy).
edge0_tier = dict(
    arms=edge0_arms,
    arm_paths=edge0_arm_paths,
    api_arms=edge0_api_arms,
    api_paths=edge0_api_paths,
    roles=edge0_roles,
    sampling=edge0_tier_sampling,
    students=edge0_tier_students,
    batch=edge0_tier_batch,
    generation=generation,
)

# A module in the config namespace would break the config dump OpenCompass re-reads.
del edge0_tiers, os
