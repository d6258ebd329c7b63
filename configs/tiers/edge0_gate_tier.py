# What the 35B and 8B gate configs share (configs/edge0_35b_gate.py, edge0_8b_gate.py): each
# picks its entry of `edge0_gate_tiers` and `edge0_gate_datasets`, and builds its arms from the
# tier base's `edge0_tier` with `edge0_gate_generation` over them. The tier's arms, paths,
# sampling, batch sizes and summary are the tier base's (configs/tiers/edge0_tier.py); what a
# gate changes is said here.
#
# Two parts, each gated against a baseline run of the same config:
#   fidelity  teacher-forced agreement with the teacher (configs/datasets/edge0_fidelity.py):
#             the sensitive signal, and the one that sees long thinking: make the set with
#             thinking on and long continuations (`edge0-eval fidelity make`).
#   sample    a seeded sample of each benchmark: OpenCompass's own draw (reader_cfg.test_range
#             = K: the same items in the same order for every arm, run and machine with the
#             same data), MMLU-Pro stratified by category (K per category, in proportion).
#
# Thinking off, answers of at most 1,024 tokens, for the sample (decided for the hour's budget):
# with thinking on a benchmark item costs 2,500 (MMLU-Pro) to 20,000 (AIME) tokens (run_config.py's
# PRIOR_TOKENS), so the hour's 57,000 benchmark tokens at 20 tok/s buy 14 items in all (1 to 5
# per benchmark: no drop is detectable at all on 1 to 3 items, 75 points on 4). Thinking off,
# the same time buys 56 items at the 1,024-token bound (more once lengths are measured), 14
# per benchmark: drops of ~74 points (fixed test; 91 sequential; each of the gate's 8 tests at
# alpha 0.05 / 8, so the gate as a whole fails an unchanged student at most 5% of the time)
# are detectable, enough to catch a broken student, not one that lost a few points. Long thinking is what fidelity
# covers, teacher-forced. AIME is left out: its problems need the long reasoning that
# thinking-off answers of 1,024 tokens cut short, so its items would spend a fifth of the
# budget on near-certain misses. Scores of the sample are not the tier's published numbers
# (another regime); they are compared with the baseline only.
#
# Sizing (data, pasted from the planner), per tier:
#     edge0-eval plan configs/edge0_35b_gate.py --size-gate     # prints samples and drops
# from the inputs below; tests/test_gate_configs.py checks that the sizes are that command's.
# After a first gate run, `--size-gate --from RUN` sizes with measured lengths and rate.
import os

from mmengine.config import read_base

from model_wrappers.partitioners.round_partitioner import Edge0RoundPartitioner
from opencompass.runners import LocalRunner
from opencompass.tasks import OpenICLEvalTask, OpenICLInferTask

with read_base():
    from ..datasets.edge0_bundle import edge0_datasets
    from ..datasets.edge0_fidelity import edge0_fidelity_datasets
    from .edge0_tier import *  # noqa: F401,F403 (edge0_tier, summarizer)

edge0_gate_generation = dict(
    max_out_len=1024, chat_template_kwargs=dict(enable_thinking=False)
)
# Rounds of a sequential run (`edge0-eval gate-run --sequential`): cumulative shares.
edge0_gate_rounds = [0.125, 0.25, 0.5, 1.0]
# Inputs, per tier. budget_h: hours of the student arm. tok_s: the student's aggregate decode
# rate, the paper's 35B figure (20.4 tok/s on an M4 Pro); none is published for the 8B tier, so
# the same is assumed. overhead_s: model load, OpenCompass start and scoring per run (assumed;
# `plan --from` measures it). Fidelity: 100 prompts x 1,024 teacher tokens, ASSUMED scored at
# 200 positions/s (10x the decode rate): not measured on a tier's device (no GPU or Apple-silicon
# run was made; the 2-core CPU's layer-major figures are in reports/perf.md, (LM)); measure the
# student's machine with `edge0-eval fidelity bench --prompts 64 --json FILE` and size with
# `plan --size-gate --fidelity-rate FILE`. churn: the share of items whose outcome changes
# between runs of an unchanged student (the power figures' assumption).
edge0_gate_inputs = dict(
    budget_h=1.0,
    tok_s=20.0,
    overhead_s=120.0,
    fidelity_positions=102400,
    fidelity_tok_s=200.0,
    benchmarks=["HumanEval", "GPQA-Diamond", "MMLU-Pro", "IFBench"],
    churn=0.10,
    alpha=0.05,
    rounds=edge0_gate_rounds,
)
# The tiers declare the same inputs (no 8B rate is published: the 35B figure is assumed) and
# sample the same benchmarks at the same max_out_len, so the sizing gives both the same sample;
# a tier given inputs of its own gets its own entry.
edge0_gate_sized = dict(
    edge0_gate_inputs,
    # `edge0-eval plan configs/edge0_35b_gate.py --size-gate` (the 8B config's alike): paste here
    samples={
        "openai_humaneval": 14,
        "GPQA_diamond": 14,
        "mmlu_pro_math": 2,
        "mmlu_pro_physics": 2,
        "mmlu_pro_chemistry": 1,
        "mmlu_pro_law": 1,
        "mmlu_pro_engineering": 1,
        "mmlu_pro_other": 1,
        "mmlu_pro_economics": 1,
        "mmlu_pro_health": 1,
        "mmlu_pro_psychology": 1,
        "mmlu_pro_business": 1,
        "mmlu_pro_biology": 1,
        "mmlu_pro_philosophy": 1,
        "mmlu_pro_computer_science": 0,
        "mmlu_pro_history": 0,
        "IFBench": 14,
    },
    drops={
        "HumanEval": 91.3,
        "GPQA-Diamond": 91.3,
        "MMLU-Pro": 91.3,
        "IFBench": 91.3,
    },
)
edge0_gate_tiers = {"35b": edge0_gate_sized, "8b": edge0_gate_sized}

# Project code, called at parse time: mmengine parses a config's import statements into
# placeholders that cannot be called, so this module comes through the builtin __import__.
edge0_tiers = __import__("edge0_eval.evaluation.plan.tiers", fromlist=["gate_round"])
# EDGE0_GATE_ROUND (set by `gate-run --sequential`): 0 runs the whole sample, r its round r; a
# value that is not a round number stops here, one line.
edge0_gate_round = edge0_tiers.for_config(edge0_tiers.gate_round, os.environ)
# EDGE0_GATE_SEED (drawn by `gate-run --sequential` before round 1): the order the rounds take
# the sample in, fresh for every run (edge0_eval/evaluation/gate/rounds.py says why).
edge0_gate_seed = edge0_tiers.gate_seed(os.environ)
# The datasets the sample is drawn from (the sizing reads them), then each tier's sample.
edge0_gate_sources = edge0_datasets
edge0_gate_datasets = edge0_tiers.gate_datasets(
    edge0_gate_tiers, edge0_gate_sources, edge0_fidelity_datasets
)

infer = dict(
    partitioner=dict(
        type=Edge0RoundPartitioner,
        rounds=edge0_gate_rounds,
        round=edge0_gate_round,
        seed=edge0_gate_seed,
        stage="infer",
    ),
    runner=dict(type=LocalRunner, max_num_workers=1, task=dict(type=OpenICLInferTask)),
)
eval = dict(
    partitioner=dict(
        type=Edge0RoundPartitioner,
        check_models=False,
        rounds=edge0_gate_rounds,
        round=edge0_gate_round,
        seed=edge0_gate_seed,
        stage="eval",
    ),
    runner=dict(type=LocalRunner, max_num_workers=2, task=dict(type=OpenICLEvalTask)),
)

# a module in the config namespace would break the config dump OpenCompass re-reads
del edge0_tiers, os
