# The tiny gate, run in CI: the tier gate configs' design (edge0_35b_gate.py) on the tiny
# teacher and student that `edge0-eval demo` builds, gated against reports/tiny_gate/report.json:
#     edge0-eval demo --gate                  # whole sample in one pass
#     edge0-eval demo --gate --sequential     # in rounds, stopping when the rule decides
# Two parts: teacher-forced fidelity (configs/datasets/edge0_fidelity.py, the tiny set the demo
# makes) and, for the benchmark part, agreement with the tiny teacher's greedy answer
# (configs/datasets/edge0_agreement.py): the tiny random models pass almost none of the five
# benchmarks' items, so a sample of those could never fail; they pass about half of these.
# The sample is OpenCompass's own seeded draw (reader_cfg.test_range = K, the same items in the
# same order for every arm and run), sized for the budget below by
#     edge0-eval plan configs/edge0_tiny_gate.py --size-gate
# (tests/test_gate_configs.py checks `samples` and `drops` against it).
import os

from mmengine.config import read_base

from model_wrappers.partitioners.round_partitioner import Edge0RoundPartitioner
from model_wrappers.summarizers.summarizer import Edge0Summarizer
from opencompass.runners import LocalRunner
from opencompass.tasks import OpenICLEvalTask, OpenICLInferTask

with read_base():
    from .datasets.edge0_agreement import edge0_agreement_datasets
    from .datasets.edge0_fidelity import edge0_fidelity_datasets
    from .tiers.edge0_arms import edge0_arm_paths, edge0_arms

# The gate's inputs (edge0_eval/evaluation/plan/planner.py says how they size the sample): 36 s
# of the tiny student. Measured on the project's 2-core machine by `edge0-eval plan
# configs/edge0_tiny_gate.py --from RUN` of a first run: the student answers its one token per
# item at 27 tok/s (prefill included), scores fidelity at 36 positions/s, and a run costs 22 s
# per arm besides that.
edge0_gate = dict(
    budget_h=0.01,
    tok_s=27.0,
    overhead_s=22.0,
    fidelity_positions=192,
    fidelity_tok_s=36.0,  # 12 prompts x 16 teacher tokens, step by step
    benchmarks=["edge0_agreement"],
    churn=0.10,
    alpha=0.05,
    rounds=[0.125, 0.25, 0.5, 1.0],
    # edge0-eval plan configs/edge0_tiny_gate.py --size-gate: paste into edge0_gate
    samples={"edge0_agreement": 234},
    drops={"edge0_agreement": 12.0},
)

# EDGE0_GATE_ROUND (set by `gate-run --sequential`): 0 runs the whole sample, r its round r.
edge0_gate_round = os.environ.get("EDGE0_GATE_ROUND") or "0"
if not edge0_gate_round.isdigit():
    raise SystemExit(
        f"edge0-eval: EDGE0_GATE_ROUND={edge0_gate_round!r} is not a round number"
    )
# EDGE0_GATE_SEED (drawn by `gate-run --sequential` before round 1): the order the rounds take
# the sample in, fresh for every run (edge0_eval/evaluation/gate/rounds.py says why).
edge0_gate_seed = os.environ.get("EDGE0_GATE_SEED") or ""
# The datasets the sample is drawn from (the sizing reads them), then the sample.
edge0_gate_sources = edge0_agreement_datasets
datasets = [
    dict(
        d, reader_cfg=dict(d["reader_cfg"], test_range=edge0_gate["samples"][d["abbr"]])
    )
    for d in edge0_gate_sources
    if edge0_gate["samples"].get(d["abbr"])
] + edge0_fidelity_datasets

# Greedy, thinking off, one answer token (the references were made with exactly these settings
# by the teacher arm); batch_size 4.
tiny_generation = dict(
    max_out_len=1,
    max_seq_len=2048,
    batch_size=4,
    generation_kwargs=dict(temperature=0.0),
    chat_template_kwargs=dict(enable_thinking=False),
    run_cfg=dict(num_gpus=0),
)
# Arms (EDGE0_ARMS): the expert faults of tests/test_fidelity.py show on int4_exact, the LoRA
# fault on the student; prerouted_nolora adds nothing the gate needs, so it is not run.
tiny_arms = os.environ.get("EDGE0_ARMS", "teacher,int4_exact,student").split(",")
if set(tiny_arms) - set(edge0_arms):
    raise SystemExit(
        f"edge0-eval: EDGE0_ARMS has unknown arms "
        f"{sorted(set(tiny_arms) - set(edge0_arms))}; choose from "
        f"{', '.join(edge0_arms)}"
    )
tiny_paths = dict(
    teacher=os.environ.get("EDGE0_TINY_TEACHER"),
    student=os.environ.get("EDGE0_TINY_STUDENT"),
)
tiny_unset = sorted(
    {edge0_arm_paths[a] for a in tiny_arms if not tiny_paths[edge0_arm_paths[a]]}
)
if tiny_unset:
    raise SystemExit(
        f"edge0-eval: EDGE0_TINY_{tiny_unset[0].upper()} is not set (run "
        f"`edge0-eval demo --gate`)"
    )
models = [
    dict(
        abbr="edge0-tiny-" + arm.replace("_", "-"),
        path=tiny_paths[edge0_arm_paths[arm]],
        **edge0_arms[arm],
        **({} if arm == "teacher" else dict(slots_per_layer=8)),
        **tiny_generation,
    )
    for arm in tiny_arms
]

infer = dict(
    partitioner=dict(
        type=Edge0RoundPartitioner,
        full_data=False,
        rounds=edge0_gate["rounds"],
        round=int(edge0_gate_round),
        seed=edge0_gate_seed,
        stage="infer",
    ),
    runner=dict(type=LocalRunner, max_num_workers=1, task=dict(type=OpenICLInferTask)),
)
eval = dict(
    partitioner=dict(
        type=Edge0RoundPartitioner,
        full_data=False,
        check_models=False,
        rounds=edge0_gate["rounds"],
        round=int(edge0_gate_round),
        seed=edge0_gate_seed,
        stage="eval",
    ),
    runner=dict(type=LocalRunner, max_num_workers=2, task=dict(type=OpenICLEvalTask)),
)
summarizer = dict(type=Edge0Summarizer, dataset_abbrs=["edge0_agreement"])
work_dir = "outputs/edge0_tiny_gate"

# A module in the config namespace would break the config dump OpenCompass re-reads.
del os
