# Agreement with the teacher's greedy answer (edge0_eval/evaluation/agreement.py): the tiny
# gate's benchmark, on which the tiny random-weight models pass items (they pass none of the
# five benchmarks). The set is made from the teacher by `edge0-eval demo --gate`; the model
# config's generation settings apply (the references were made with the teacher arm's).
from model_wrappers.datasets.agreement_dataset import AgreementDataset
from model_wrappers.evaluators.agreement_evaluator import AgreementEvaluator
from model_wrappers.inferencers.inferencer import Edge0GenInferencer
from opencompass.openicl.icl_prompt_template import PromptTemplate
from opencompass.openicl.icl_retriever import ZeroRetriever

edge0_agreement_datasets = [
    # abbr: edge0_eval.evaluation.agreement.DATASET_ABBR (a config cannot import it).
    dict(
        abbr="edge0_agreement",
        type=AgreementDataset,
        reader_cfg=dict(input_columns=["prompt"], output_column="reference"),
        infer_cfg=dict(
            prompt_template=dict(
                type=PromptTemplate,
                template=dict(round=[dict(role="HUMAN", prompt="{prompt}")]),
            ),
            retriever=dict(type=ZeroRetriever),
            inferencer=dict(type=Edge0GenInferencer),
        ),
        eval_cfg=dict(evaluator=dict(type=AgreementEvaluator)),
    ),
]
