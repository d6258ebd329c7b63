# Edge0 35B tier (Qwen3.6-35B-A3B, mlx-lm qwen3_5_moe): fp16 teacher vs Edge0 student on
# AIME 2026, HumanEval, GPQA-Diamond, MMLU-Pro and IFBench.
#
#   edge0-eval data stage --root D --aime2026 aime2026.jsonl --gpqa gpqa_diamond.csv \
#       --mmlu-pro mmlu_pro/ --nltk-data ~/nltk_data
#   export COMPASS_DATA_CACHE=D
#   export EDGE0_35B_TEACHER=/models/qwen3.6-35b-a3b-fp16    # mlx-lm checkpoint
#   export EDGE0_35B_STUDENT=/models/qwen3.6-35b-a3b-edge0   # `edge0-eval convert` output with
#                                                            # lora.safetensors, prerouter.safetensors
#   opencompass configs/edge0_35b.py
#
# Arms (EDGE0_ARMS, comma-separated; default teacher,student; configs/tiers/edge0_arms.py says
# what each is): teacher, student (K=4, LoRA), int4_exact, prerouted_nolora.
# Shared settings (generation, arms, partitioning, summary): configs/tiers/edge0_tier.py.
# Sampling (EDGE0_SAMPLING; configs/tiers/edge0_tier.py says why): `opencompass` (default),
# temperature 0.6, top_p 0.95; or `card`, the Qwen3.5/3.6 card's thinking settings for general
# tasks, temperature 1.0, top_p 0.95, top_k 20, presence_penalty 1.5 (mlx-lm's penalty: the
# last 20 tokens, prompt included). Identical on every arm.
import os

from mmengine.config import read_base

with read_base():
    from .tiers.edge0_tier import *  # noqa: F401,F403 (datasets, infer, eval, summarizer, edge0_tier)

# The arms of EDGE0_ARMS on this tier; a missing or bad EDGE0_* variable stops here, one line.
edge0_tiers = __import__("edge0_eval.evaluation.plan.tiers", fromlist=["tier_models"])
models = edge0_tiers.for_config(edge0_tiers.tier_models, "35b", os.environ, edge0_tier)
work_dir = "outputs/edge0_35b"

# A module in the config namespace would break the config dump OpenCompass re-reads.
del edge0_tiers, os
