# The five Edge0 benchmarks from OpenCompass's *_rawprompt_* configs: prompts reach the model
# as {role, content} message lists instead of PromptLists. Same fixes as edge0_bundle.py; the
# shipped raw-prompt GPQA and MMLU-Pro configs score with an LLM judge only, so they are given
# the rule-based scorers of their PromptList twins (the judge stays optional for AIME; MMLU-Pro's
# AccwithDetailsEvaluator for the reason edge0_bundle.py gives).
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
from opencompass.utils.text_postprocessors import match_answer_pattern

with read_base():
    from .edge0_bundle import edge0_open_thinking  # the open-thinking rule, chosen once
    from opencompass.configs.datasets.aime2026.aime2026_cascade_eval_rawprompt_gen_0970dd import (
        aime2026_datasets as aime2026_raw_datasets,
    )
    from opencompass.configs.datasets.gpqa.gpqa_cascade_eval_rawprompt_gen_706039 import (
        gpqa_datasets as gpqa_raw_datasets,
    )
    from opencompass.configs.datasets.humaneval.humaneval_openai_sample_evals_rawprompt_gen_6ce2ca import (
        humaneval_datasets as humaneval_raw_datasets,
    )  # noqa: E501
    from opencompass.configs.datasets.IFBench.IFBench_rawprompt_gen import (
        ifbench_datasets as ifbench_raw_datasets,
    )
    from opencompass.configs.datasets.mmlu_pro.mmlu_pro_0shot_nocot_genericllmeval_rawprompt_gen_0321fb import (
        mmlu_pro_datasets as mmlu_pro_raw_datasets,
    )  # noqa: E501

if not os.environ.get("OC_JUDGE_MODEL"):
    for d in aime2026_raw_datasets:
        d["eval_cfg"]["evaluator"] = dict(type=MATHVerifyEvaluator)
    for d in gpqa_raw_datasets:
        d["eval_cfg"]["evaluator"] = d["eval_cfg"]["evaluator"]["rule_evaluator"]
    for d in mmlu_pro_raw_datasets:
        d["eval_cfg"] = dict(
            evaluator=dict(type=AccwithDetailsEvaluator),
            pred_postprocessor=dict(
                type=match_answer_pattern, answer_pattern=r"(?i)ANSWER\s*:\s*([A-P])"
            ),
        )
for d in humaneval_raw_datasets:
    d["eval_cfg"]["evaluator"] = dict(type=SubsetHumanEvalEvaluator)
for d in ifbench_raw_datasets:
    d["eval_cfg"]["evaluator"] = dict(type=CheckedIFBenchEvaluator)

edge0_raw_datasets = [
    *aime2026_raw_datasets,
    *humaneval_raw_datasets,
    *gpqa_raw_datasets,
    *mmlu_pro_raw_datasets,
    *ifbench_raw_datasets,
]
for d in edge0_raw_datasets:
    d["infer_cfg"]["inferencer"]["type"] = Edge0GenInferencer
    d["infer_cfg"]["inferencer"].pop("max_out_len", None)
    # First the thinking rule, then the dataset's own postprocessor (`then`).
    d["eval_cfg"]["pred_postprocessor"] = dict(
        type=edge0_answer_text,
        then=d["eval_cfg"].get("pred_postprocessor"),
        **edge0_open_thinking,
    )

# A module in the config namespace would break the config dump OpenCompass re-reads.
del os
