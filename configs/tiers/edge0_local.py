# Partitioning for the small configs (tiny, testbed): like the tiers' (configs/tiers/edge0_tier.py),
# but the preflight accepts benchmark slices (full_data=False). One task per arm (all datasets in
# it, so each model loads once), one arm at a time; data and models are checked before anything
# starts.
from model_wrappers.partitioners.partitioner import Edge0Partitioner
from opencompass.runners import LocalRunner
from opencompass.tasks import OpenICLEvalTask, OpenICLInferTask

infer = dict(
    partitioner=dict(type=Edge0Partitioner, full_data=False),
    runner=dict(type=LocalRunner, max_num_workers=1, task=dict(type=OpenICLInferTask)),
)
eval = dict(
    partitioner=dict(type=Edge0Partitioner, full_data=False, check_models=False),
    runner=dict(type=LocalRunner, max_num_workers=2, task=dict(type=OpenICLEvalTask)),
)
