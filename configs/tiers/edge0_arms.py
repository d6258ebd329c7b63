# The evaluation arms every config offers, defined once (data only: configs pick arms by name).
#   teacher           the fp16 teacher, fully resident (mlx-lm)
#   int4_exact        ablation: int4 experts streamed, exact routing (true router), no LoRA
#   prerouted_nolora  ablation: prediction-as-routing with the student's heads, no LoRA
#   student           prerouted + the recovery LoRA: exactly the served student path
# so a report splits the teacher-student gap into quantization (teacher - int4_exact), prerouting
# (int4_exact - prerouted_nolora) and LoRA recovery (student - prerouted_nolora).
from model_wrappers.models.edge0_model import Edge0Model
from model_wrappers.models.mlx_lm_model import MLXLMModel

edge0_arms = dict(
    teacher=dict(type=MLXLMModel),
    int4_exact=dict(type=Edge0Model, mode="reactive", no_lora=True, no_prerouter=True),
    prerouted_nolora=dict(type=Edge0Model, mode="prerouted", no_lora=True),
    student=dict(type=Edge0Model, mode="prerouted"),
)
# Which model directory each arm reads.
edge0_arm_paths = dict(
    teacher="teacher",
    int4_exact="student",
    prerouted_nolora="student",
    student="student",
)
