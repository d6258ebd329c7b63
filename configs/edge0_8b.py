# Edge0 8B tier (Ling 3.0 tiny, mlx-lm bailing_hybrid): fp16 teacher vs Edge0 student on
# AIME 2026, HumanEval, GPQA-Diamond, MMLU-Pro and IFBench.
#
#   edge0-eval data stage --root D --aime2026 aime2026.jsonl --gpqa gpqa_diamond.csv \
#       --mmlu-pro mmlu_pro/ --nltk-data ~/nltk_data
#   export COMPASS_DATA_CACHE=D
#   export EDGE0_8B_TEACHER=/models/ling-3.0-tiny-fp16       # mlx-lm checkpoint
#   export EDGE0_8B_STUDENT=/models/ling-3.0-tiny-edge0      # `edge0-eval convert` output with
#                                                            # lora.safetensors, prerouter.safetensors
#   opencompass configs/edge0_8b.py
#
# Arms (EDGE0_ARMS, comma-separated; default teacher,student; configs/tiers/edge0_arms.py says
# what each is): teacher, student (native top-8, LoRA), int4_exact, prerouted_nolora.
# Shared settings (generation, arms, partitioning, summary): configs/tiers/edge0_tier.py.
# Sampling (EDGE0_SAMPLING; configs/tiers/edge0_tier.py says why): `opencompass`, temperature
# 0.6, top_p 0.95, on every arm; the Qwen card's `card` settings are the 35B tier's only.
import os

from mmengine.config import read_base

with read_base():
    from .tiers.edge0_tier import *  # noqa: F401,F403 (datasets, infer, eval, summarizer, edge0_tier)

# The arms of EDGE0_ARMS on this tier; a missing or bad EDGE0_* variable stops here, one line.
edge0_tiers = __import__("edge0_eval.evaluation.plan.tiers", fromlist=["tier_models"])
models = edge0_tiers.for_config(edge0_tiers.tier_models, "8b", os.environ, edge0_tier)
work_dir = "outputs/edge0_8b"

# A module in the config namespace would break the config dump OpenCompass re-reads.
del edge0_tiers, os
