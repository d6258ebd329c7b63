# Teacher-forced fidelity: every arm's next-token log-probs on the teacher's own continuations,
# against the teacher's top-k (see edge0_eval/evaluation/fidelity/scoring.py). The set is made
# once with `edge0-eval fidelity make TEACHER --out FILE` and laid under the data root by
# `edge0-eval data stage --root $COMPASS_DATA_CACHE --fidelity FILE` (data/fidelity/...).
# Arms must be MLXLMModel or Edge0Model (they implement fidelity_logprobs); the model config's
# max_out_len does not apply: the set fixes every item's length.
from model_wrappers.datasets.fidelity_dataset import FidelityDataset
from model_wrappers.evaluators.fidelity_evaluator import FidelityEvaluator
from model_wrappers.inferencers.fidelity_inferencer import FidelityInferencer
from opencompass.openicl.icl_prompt_template import PromptTemplate
from opencompass.openicl.icl_retriever import ZeroRetriever

edge0_fidelity_datasets = [
    # abbr: edge0_eval.evaluation.fidelity.sets.DATASET_ABBR (the report finds fidelity by it;
    # a config turns an imported name into a dotted string, so it is spelt out).
    dict(
        abbr="edge0_fidelity",
        type=FidelityDataset,
        reader_cfg=dict(input_columns=["prompt"], output_column="item"),
        infer_cfg=dict(
            prompt_template=dict(type=PromptTemplate, template="{prompt}"),
            retriever=dict(type=ZeroRetriever),
            inferencer=dict(type=FidelityInferencer),
        ),
        eval_cfg=dict(evaluator=dict(type=FidelityEvaluator)),
    ),
]
