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
# Served arms (configs/tiers/edge0_api.py): EDGE0_ARMS=...,student_api,teacher_api with
#     EDGE0_TINY_STUDENT_API=http://127.0.0.1:8001/v1,http://127.0.0.1:8002/v1   # edge0-eval serve
#     EDGE0_TINY_TEACHER_API=http://127.0.0.1:8080/v1                            # mlx_lm.server
# EDGE0_TINY_SAMPLED=1 samples (temperature 0.6, top_p 0.95, seed 0) two answers per question.
import os

from mmengine.config import read_base

from model_wrappers.summarizers.summarizer import Edge0Summarizer

with read_base():
    from .datasets.edge0_bundle import edge0_dataset_abbrs, edge0_datasets
    from .datasets.edge0_bundle_rawprompt import edge0_raw_datasets
    from .datasets.edge0_fidelity import edge0_fidelity_datasets
    from .tiers.edge0_api import edge0_api_arms, edge0_api_paths
    from .tiers.edge0_arms import edge0_arm_paths, edge0_arms
    from .tiers.edge0_local import eval, infer

# The MMLU-Pro categories the fixture has
# (edge0_eval.evaluation.data.fixtures.MMLU_PRO_FIXTURE_CATEGORIES).
tiny_mmlu_pro = ["mmlu_pro_math", "mmlu_pro_physics"]
tiny_arms = os.environ.get("EDGE0_ARMS", "teacher,student").split(",")
tiny_sampled = os.environ.get("EDGE0_TINY_SAMPLED") == "1"
datasets = [d for d in edge0_raw_datasets if d["abbr"] in ("aime2026", "IFBench")] + [
    d
    for d in edge0_datasets
    if d["abbr"] in ("openai_humaneval", "GPQA_diamond", *tiny_mmlu_pro)
]
datasets = [dict(d, n=2) if tiny_sampled else d for d in datasets]
# Teacher-forced fidelity on the set `edge0-eval demo` makes from the tiny teacher (in-process
# arms only: a run with a served arm leaves it out).
datasets += [] if set(tiny_arms) & set(edge0_api_arms) else edge0_fidelity_datasets

# Identical generation settings for both arms: greedy, thinking off, 24 new tokens. batch_size
# (EDGE0_TINY_BATCH, default 4): prompts decoded together; every row equals its run alone, so
# predictions are those of batch_size 1 (tests/test_batch_wrappers.py runs both).
tiny_batch = os.environ.get("EDGE0_TINY_BATCH", "4")
if not (tiny_batch.isdigit() and int(tiny_batch) > 0):
    raise SystemExit(
        f"edge0-eval: EDGE0_TINY_BATCH={tiny_batch!r} is not a whole number > 0"
    )
tiny_generation = dict(
    max_out_len=24,
    max_seq_len=2048,
    batch_size=int(tiny_batch),
    generation_kwargs=dict(temperature=0.6, top_p=0.95, seed=0)
    if tiny_sampled
    else dict(temperature=0.0),
    chat_template_kwargs=dict(enable_thinking=False),
    run_cfg=dict(num_gpus=0),
)
# Arms (EDGE0_ARMS, comma-separated; `edge0-eval demo` runs the four in-process ones;
# configs/tiers/edge0_arms.py and edge0_api.py say what each is): teacher, int4_exact,
# prerouted_nolora, student, teacher_api, student_api.
tiny_roles = {**edge0_arm_paths, **edge0_api_paths}
if set(tiny_arms) - set(tiny_roles):
    raise SystemExit(
        f"edge0-eval: EDGE0_ARMS has unknown arms "
        f"{sorted(set(tiny_arms) - set(tiny_roles))}; choose from "
        f"{', '.join(tiny_roles)}"
    )
if any(tiny_roles[a] == "teacher" for a in tiny_arms) and not os.environ.get(
    "EDGE0_TINY_TEACHER"
):
    raise SystemExit(
        "edge0-eval: EDGE0_TINY_TEACHER is not set: export it to a tiny "
        "checkpoint from `edge0-eval make-tiny` (or run `edge0-eval demo`)"
    )
if any(tiny_roles[a] == "student" for a in tiny_arms) and not os.environ.get(
    "EDGE0_TINY_STUDENT"
):
    raise SystemExit(
        "edge0-eval: EDGE0_TINY_STUDENT is not set: export it to the output of "
        "`edge0-eval convert` with its adapters (or run `edge0-eval demo`)"
    )
tiny_api = {arm: os.environ.get(f"EDGE0_TINY_{arm.upper()}") for arm in edge0_api_arms}
for arm in set(tiny_arms) & set(edge0_api_arms):
    if not tiny_api[arm]:
        raise SystemExit(
            f"edge0-eval: EDGE0_TINY_{arm.upper()} is not set: export it to the "
            f"server URL(s), comma-separated (http://HOST:PORT/v1)"
        )
tiny_paths = dict(
    teacher=os.environ.get("EDGE0_TINY_TEACHER"),
    student=os.environ.get("EDGE0_TINY_STUDENT"),
)
# A small slot pool, so the student arms really stream (the tiny model has 16 experts x 4 layers).
models = [
    dict(
        abbr="edge0-tiny-" + arm.replace("_", "-"),
        path=tiny_paths[edge0_arm_paths[arm]],
        **edge0_arms[arm],
        **({} if arm == "teacher" else dict(slots_per_layer=8)),
        **tiny_generation,
    )
    if arm in edge0_arms
    else dict(
        abbr="edge0-tiny-" + arm.replace("_", "-"),
        **edge0_api_arms[arm],
        openai_api_base=tiny_api[arm].split(","),
        tokenizer_path=tiny_paths[edge0_api_paths[arm]],
        **tiny_generation,
    )
    for arm in tiny_arms
]

summarizer = dict(
    type=Edge0Summarizer,
    dataset_abbrs=edge0_dataset_abbrs,
    summary_groups=[
        dict(name="mmlu_pro", subsets=tiny_mmlu_pro),
        dict(name="mmlu_pro_per_question", subsets=tiny_mmlu_pro, weights="num_items"),
    ],
)
work_dir = "outputs/edge0_tiny"

# A module in the config namespace would break the config dump OpenCompass re-reads.
del os
