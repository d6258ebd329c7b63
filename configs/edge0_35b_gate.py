# The 35B tier's CI gate: long-form fidelity plus a seeded sample of HumanEval, GPQA-Diamond,
# MMLU-Pro (stratified by category) and IFBench, sized to one hour of the student at a declared
# tok/s, gated against a baseline run of this config (configs/tiers/edge0_gate_tier.py says what
# the sample is, why thinking is off, and how it is sized).
#
#   export COMPASS_DATA_CACHE=D EDGE0_35B_TEACHER=... EDGE0_35B_STUDENT=...   # as edge0_35b.py
#   edge0-eval plan configs/edge0_35b_gate.py --tok-s 20           # what it costs and can detect
#   edge0-eval gate-run configs/edge0_35b_gate.py --baseline none --work-dir base   # the baseline
#   edge0-eval gate-run configs/edge0_35b_gate.py --baseline base/report/report.json --sequential
import os

from mmengine.config import read_base

with read_base():
    from .tiers.edge0_gate_tier import *  # noqa: F401,F403 (infer, eval, summarizer, edge0_tier)

edge0_gate = edge0_gate_tiers["35b"]
datasets = edge0_gate_datasets["35b"]
# The arms of EDGE0_ARMS on this tier, with the gate's generation; a missing or bad EDGE0_*
# variable stops here, one line.
edge0_tiers = __import__("edge0_eval.evaluation.plan.tiers", fromlist=["tier_models"])
models = edge0_tiers.for_config(
    edge0_tiers.tier_models, "35b", os.environ, edge0_tier, edge0_gate_generation
)
work_dir = "outputs/edge0_35b_gate"

# A module in the config namespace would break the config dump OpenCompass re-reads.
del edge0_tiers, os
