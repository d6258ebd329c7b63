# Arms served over an OpenAI-compatible API (model_wrappers/models/edge0_api_model.py), beside the
# in-process arms of edge0_arms.py, with the same generation settings, seeds and stop rules, so
# the report pairs either kind with the other (data only: configs pick arms by name).
#   student_api  the student on one or several `edge0-eval serve` hosts, each started with the
#                student arm's engine options and `--served-model-name edge0-student`;
#                requests go to the least busy host, a host that fails is retried elsewhere
#   teacher_api  the teacher on mlx_lm.server (which answers to the model name 'default_model')
#                or any OpenAI-compatible engine; its sampled rows differ from the in-process
#                teacher's (mlx-lm's server seeds its global generator), greedy ones do not
# Each reads its model's tokenizer from a local copy (the in-process arm's model path): the
# chat template's thinking opener and the stop ids. Teacher-forced fidelity needs the model in
# the process: a run with an API arm leaves the fidelity datasets out.
from model_wrappers.models.edge0_api_model import Edge0APIModel

edge0_api_arms = dict(
    teacher_api=dict(type=Edge0APIModel, path="default_model"),
    student_api=dict(type=Edge0APIModel, path="edge0-student"),
)
# Whose files each reads (tokenizer_path), as edge0_arm_paths.
edge0_api_paths = dict(teacher_api="teacher", student_api="student")
