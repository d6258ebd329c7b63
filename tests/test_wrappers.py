"""OpenCompass model wrappers: prompt shapes, chat template, stop words, sampling, stats."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from opencompass.utils.prompt import PromptList

from edge0_eval.engine.batch import trim_at_stop
from edge0_eval.engine.inputs import to_messages
from edge0_eval.errors import ConfigError
from model_wrappers.models.chat import sampling_options


@pytest.fixture(scope="module")
def teacher(tiny_qwen):
    from model_wrappers.models.mlx_lm_model import MLXLMModel

    return MLXLMModel(path=str(tiny_qwen), generation_kwargs=dict(temperature=0.0))


@pytest.fixture(scope="module")
def student(edge0_qwen):
    from model_wrappers.models.edge0_model import Edge0Model

    return Edge0Model(
        path=str(edge0_qwen),
        mode="reactive",
        no_lora=True,
        no_prerouter=True,
        experts_per_token=2,
        slots_per_layer=4,
        generation_kwargs=dict(temperature=0.0),
    )


HUMAN = PromptList([dict(role="HUMAN", prompt="What is 2 + 2?")])
RAW = [{"role": "user", "content": "What is 2 + 2?"}]


def test_prompt_shapes_become_chat_messages():
    assert to_messages("hi") == [{"role": "user", "content": "hi"}]
    pl = PromptList(
        [
            dict(role="SYSTEM", prompt="Be brief."),
            dict(role="HUMAN", prompt="a"),
            dict(role="HUMAN", prompt="b"),
            dict(role="BOT", prompt="c"),
            dict(role="HUMAN", prompt=""),
        ]
    )
    assert to_messages(pl) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "c"},
    ]
    raw = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]
    assert to_messages(raw) == raw
    with pytest.raises(ValueError, match="unknown prompt role"):
        to_messages([{"role": "narrator", "content": "x"}])


def test_trim_at_first_stop_word():
    assert trim_at_stop("abc<END>def<STOP>", ["<STOP>", "<END>"]) == ("abc", "<END>")
    assert trim_at_stop("abc", ["x", ""]) == ("abc", None)


def test_generation_kwargs_are_validated():
    assert (
        sampling_options({"temperature": 0.6, "top_p": 0.95}, "x")["temperature"] == 0.6
    )
    assert (
        sampling_options({"do_sample": False, "temperature": 1.0}, "x")["temperature"]
        == 0.0
    )
    with pytest.raises(
        ConfigError, match="unsupported generation_kwargs \\['temprature'\\]"
    ):
        sampling_options({"temprature": 0.6}, "x")


def test_unknown_model_option_is_refused(tiny_qwen):
    from model_wrappers.models.mlx_lm_model import MLXLMModel

    with pytest.raises(ConfigError, match="unknown model options"):
        MLXLMModel(path=str(tiny_qwen), tokenizer_only=True, chat_template_kwarg={})


def test_teacher_compute_dtype(tiny_qwen):
    """`auto` follows the engine's policy (float32 on the CPU); an explicit dtype is kept;
    a misspelt one is refused before loading."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from edge0_eval.engine.mlx_compat import resolve_compute_dtype
    from model_wrappers.models.mlx_lm_model import MLXLMModel

    def floating(model):
        # Unquantized experts are float32 on the CPU whatever the policy (gather_mm).
        return {
            v.dtype
            for k, v in tree_flatten(model.model.parameters())
            if mx.issubdtype(v.dtype, mx.floating) and "switch_mlp" not in k
        }

    auto = MLXLMModel(path=str(tiny_qwen))
    want = resolve_compute_dtype("auto")
    if want is not None:
        assert floating(auto) == {want}
    half = MLXLMModel(path=str(tiny_qwen), compute_dtype="bfloat16")
    assert floating(half) == {mx.bfloat16}
    with pytest.raises(ConfigError, match="compute_dtype"):
        MLXLMModel(path=str(tiny_qwen), compute_dtype="fp8")


def test_promptlist_and_raw_messages_give_the_same_prompt(teacher):
    text = teacher.chat_text(HUMAN)
    assert (
        text == teacher.chat_text(RAW) == "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert (
        teacher.get_token_len(HUMAN)
        == teacher.get_token_len(RAW)
        == len(teacher.tokenizer.encode(text, add_special_tokens=False))
    )


def test_system_prompt_from_a_dataset_template_reaches_the_chat_template(teacher):
    from opencompass.openicl.icl_prompt_template import PromptTemplate

    template = PromptTemplate(
        template=dict(
            begin=[dict(role="SYSTEM", fallback_role="HUMAN", prompt="Grade it.")],
            round=[dict(role="HUMAN", prompt="{q}"), dict(role="BOT", prompt="")],
        )
    )
    prompt = template.generate_item({"q": "Is 4 right?"})
    parsed = teacher.parse_template(prompt, mode="gen")
    assert teacher.chat_text(parsed).startswith(
        "<|im_start|>system\nGrade it.<|im_end|>\n<|im_start|>user\nIs 4 right?"
    )


def test_teacher_honours_max_out_len_and_records_stats(teacher):
    teacher.pop_sample_stats()
    outs = teacher.generate([HUMAN, RAW], max_out_len=5)
    assert len(outs) == 2 and outs[0] == outs[1]  # same prompt, greedy
    stats = teacher.pop_sample_stats()
    assert len(stats) == 2 and teacher.pop_sample_stats() == []
    for s in stats:
        assert 0 < s["tokens"] <= 5
        assert s["prompt_tokens"] == teacher.get_token_len(HUMAN)
        for key in ("decode_tok_s", "prefill_tok_s", "peak_memory_gib", "wall_s"):
            assert isinstance(s[key], float) and s[key] >= 0
        assert s["arm"] == "teacher"


def test_stop_words_trim_the_output(teacher):
    base = teacher.generate([HUMAN], max_out_len=16)[0]
    stop = next(
        base[i : i + 2] for i in range(2, len(base) - 2) if base[i : i + 2].strip()
    )
    want = base[: base.find(stop)]
    assert (
        teacher.generate([HUMAN], max_out_len=16, stopping_criteria=[stop])[0] == want
    )
    from model_wrappers.models.mlx_lm_model import MLXLMModel

    configured = MLXLMModel(path=teacher.path, stop_words=[stop])
    assert configured.generate([HUMAN], max_out_len=16)[0] == want
    assert configured.pop_sample_stats()[0]["stop_word"] == stop


def test_sampling_follows_generation_kwargs(tiny_qwen):
    from model_wrappers.models.mlx_lm_model import MLXLMModel

    def sample(seed):
        m = MLXLMModel(
            path=str(tiny_qwen), generation_kwargs=dict(temperature=1.0, seed=seed)
        )
        return m.generate([HUMAN], max_out_len=12)[0]

    assert sample(0) == sample(0)
    assert sample(0) != sample(1)


def test_stats_jsonl_option(tiny_qwen, tmp_path):
    from model_wrappers.models.mlx_lm_model import MLXLMModel

    path = tmp_path / "stats" / "teacher.jsonl"
    m = MLXLMModel(path=str(tiny_qwen), stats_jsonl=str(path))
    m.generate([HUMAN, RAW], max_out_len=3)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == 2 and all(line["tokens"] <= 3 for line in lines)


def test_student_generates_with_engine_options_and_stats(student):
    assert student.engine.experts_per_token == 2 and student.engine.slots_per_layer == 4
    student.pop_sample_stats()
    outs = student.generate([HUMAN, RAW], max_out_len=6)
    assert len(outs) == 2 and outs[0] == outs[1]
    stats = student.pop_sample_stats()
    for s in stats:
        assert s["arm"] == "student" and 0 < s["tokens"] <= 6
        assert (
            s["decode_tok_s"] >= 0
            and s["prefill_tok_s"] > 0
            and s["peak_memory_gib"] > 0
        )
        assert {"decode_hit_rate", "bytes_read", "blocked_load_ms_per_step"} <= set(
            s["pool"]
        )
        assert s["cache"] == "not evicted"
        assert s["engine"]["mode"] == "reactive"


def test_student_and_teacher_share_prompt_handling(student, teacher):
    assert student.chat_text(HUMAN) == teacher.chat_text(HUMAN)
    assert student.get_token_len(RAW) == teacher.get_token_len(RAW)


def test_student_missing_adapters_fail_before_loading(
    edge0_qwen, tmp_path, monkeypatch
):
    from edge0_eval.engine import engine
    from model_wrappers.models.edge0_model import Edge0Model

    def no_load(*a, **k):
        raise AssertionError("the engine must not load")

    monkeypatch.setattr(engine.Engine, "load", no_load)
    with pytest.raises(ConfigError, match="lora.safetensors is missing"):
        Edge0Model(path=str(edge0_qwen), mode="reactive")
    with pytest.raises(ConfigError, match="prerouter.safetensors is missing"):
        Edge0Model(path=str(edge0_qwen), mode="prerouted", no_lora=True)
    with pytest.raises(ConfigError, match="not a converted Edge0 model"):
        Edge0Model(path=str(tmp_path), mode="reactive", no_lora=True)
    with pytest.raises(ConfigError, match="does not exist"):
        Edge0Model(path=str(tmp_path / "nope"), mode="reactive", no_lora=True)
    with pytest.raises(ConfigError, match="not one of"):
        Edge0Model(path=str(edge0_qwen), mode="streaming", no_lora=True)


BAD_SAMPLING = [
    (dict(repetition_penalty=0), "repetition_penalty must be a number > 0"),
    (dict(repetition_penalty="1.1"), "repetition_penalty must be a number > 0"),
    (dict(presence_penalty=float("nan")), "presence_penalty must be a number in"),
    (dict(frequency_penalty=True), "frequency_penalty must be a number in"),
    # vLLM's ranges, which a served arm's server checks too: refused in-process as well.
    (dict(presence_penalty=2.5), "presence_penalty must be a number in \\[-2, 2\\]"),
    (dict(temperature=2.5), "temperature must be a number in \\[0, 2\\]"),
    (
        dict(presence_penalty=1.5, presence_context_size=0),
        "presence_context_size must be a whole",
    ),
    (dict(repetition_context_size=64), "repetition_context_size has no effect without"),
    (dict(top_k=-1), "top_k must be a whole number"),
    (dict(top_k=2.5), "top_k must be a whole number"),
    (dict(min_p=1.0), "min_p must be a number in"),
]


@pytest.mark.parametrize(
    "gen,message",
    BAD_SAMPLING,
    ids=[f"{m.split()[0]}{i}" for i, (_, m) in enumerate(BAD_SAMPLING)],
)
def test_both_arms_refuse_bad_sampling_values_before_loading(
    edge0_qwen, tiny_qwen, monkeypatch, gen, message
):
    from edge0_eval.engine.engine import Engine
    from model_wrappers.models import mlx_lm_model
    from model_wrappers.models.edge0_model import Edge0Model

    def no_load(*a, **k):
        raise AssertionError("the model must not load")

    monkeypatch.setattr(Engine, "load", no_load)
    monkeypatch.setattr(mlx_lm_model, "load", no_load)
    gen = {"temperature": 0.6, **gen}
    with pytest.raises(ConfigError, match=f"student: generation_kwargs: {message}"):
        Edge0Model(
            path=str(edge0_qwen), mode="reactive", no_lora=True, generation_kwargs=gen
        )
    with pytest.raises(ConfigError, match=f"teacher: generation_kwargs: {message}"):
        mlx_lm_model.MLXLMModel(path=str(tiny_qwen), generation_kwargs=gen)


@pytest.mark.parametrize("key,value", [("prerouted_weights", "head")])
def test_removed_engine_options_are_refused_naming_them(
    edge0_qwen, monkeypatch, key, value
):
    """Options of the deleted prerouter variants in an old config: one ConfigError
    naming the key, from the student and from its option check, before anything loads."""
    from edge0_eval.engine.engine import Engine
    from model_wrappers.models.edge0_model import Edge0Model, resolve_engine_options

    def no_load(*a, **k):
        raise AssertionError("the engine must not load")

    monkeypatch.setattr(Engine, "load", no_load)
    with pytest.raises(ConfigError, match=key):
        resolve_engine_options(str(edge0_qwen), no_lora=True, **{key: value})
    with pytest.raises(ConfigError, match=key):
        Edge0Model(path=str(edge0_qwen), mode="reactive", no_lora=True, **{key: value})


def test_adapter_defaults_match_the_engine(edge0_qwen, tmp_path):
    from edge0_eval.engine.options import LORA_FILE, PREROUTER_FILE, EngineOptions
    from model_wrappers.models.edge0_model import resolve_engine_options

    student = tmp_path / "student"
    shutil.copytree(edge0_qwen, student)
    for name in (LORA_FILE, PREROUTER_FILE):
        (student / name).write_bytes(b"")
    opts = resolve_engine_options(str(student), mode="prerouted")
    resolved = opts.resolve(student)
    assert (resolved.lora_path, resolved.prerouter_path) == (
        student / LORA_FILE,
        student / PREROUTER_FILE,
    )
    assert EngineOptions(mode="prerouted").resolve(student) == resolved


def test_classes_resolve_by_dotted_path_in_a_fresh_process(tmp_path):
    # OpenCompass task subprocesses re-read a dumped config where types are dotted strings.
    code = (
        "from opencompass.registry import MODELS, ICL_EVALUATORS, ICL_INFERENCERS\n"
        'print(MODELS.get("model_wrappers.models.mlx_lm_model.MLXLMModel").__name__,\n'
        '      MODELS.get("model_wrappers.models.edge0_model.Edge0Model").__name__,\n'
        '      ICL_INFERENCERS.get("model_wrappers.inferencers.inferencer.Edge0GenInferencer").__name__,\n'
        '      ICL_EVALUATORS.get("model_wrappers.evaluators.benchmark_evaluators.CheckedIFBenchEvaluator")'
        ".__name__)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == [
        "MLXLMModel",
        "Edge0Model",
        "Edge0GenInferencer",
        "CheckedIFBenchEvaluator",
    ]


def test_summarizer_reports_the_per_question_average(tmp_path):
    from mmengine.config import ConfigDict

    from model_wrappers.summarizers.summarizer import Edge0Summarizer

    def dataset(abbr):
        return dict(abbr=abbr, infer_cfg=dict(inferencer=dict(type="GenInferencer")))

    results = tmp_path / "results" / "m"
    results.mkdir(parents=True)
    # 3 questions all right (AccEvaluator-style details) and 1 question wrong.
    (results / "mmlu_pro_a.json").write_text(
        json.dumps(
            {"accuracy": 100.0, "details": {"type": "GEN", "0": {}, "1": {}, "2": {}}}
        )
    )
    (results / "mmlu_pro_b.json").write_text(
        json.dumps({"accuracy": 0.0, "details": [{"correct": False}]})
    )
    cfg = ConfigDict(
        models=[dict(abbr="m")],
        work_dir=str(tmp_path),
        datasets=[dataset("mmlu_pro_a"), dataset("mmlu_pro_b")],
    )
    subsets = ["mmlu_pro_a", "mmlu_pro_b"]
    s = Edge0Summarizer(
        cfg,
        summary_groups=[
            dict(name="mmlu_pro", subsets=subsets),
            dict(name="mmlu_pro_per_question", subsets=subsets, weights="num_items"),
        ],
    )
    parsed = s._calculate_group_metrics(*s._pick_up_results())[1]["m"]
    assert parsed["mmlu_pro"]["naive_average"] == pytest.approx(50.0)
    assert parsed["mmlu_pro_per_question"]["weighted_average"] == pytest.approx(75.0)


def test_stats_file_sits_beside_the_predictions():
    from model_wrappers.inferencers.inferencer import stats_path

    assert stats_path("p/m", "IFBench.json") == os.path.join(
        "p/m", "IFBench.engine_stats.json"
    )
    assert stats_path("p/m", "mmlu_pro_math_0.json").endswith(
        "mmlu_pro_math_0.engine_stats.json"
    )
