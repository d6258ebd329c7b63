"""The tier configs' logic (edge0_eval/evaluation/plan/tiers.py): the configs build what they
built when the logic was written inline (tests/tier_configs.json, every environment of
tests/tier_cases.py), and a missing or bad variable is one error naming it and the fix."""

from __future__ import annotations

import json

import pytest
from tier_cases import CASES, ENVIRONMENTS, RECORD, build

from edge0_eval.errors import ConfigError
from edge0_eval.evaluation.plan import tiers

RECORDED = json.loads(RECORD.read_text())


def test_every_case_is_recorded():
    assert sorted(RECORDED) == sorted(f"{c} / {e}" for c, e in CASES)


@pytest.mark.parametrize("config,env", CASES, ids=[f"{c}-{e}" for c, e in CASES])
def test_configs_build_what_they_built(config, env):
    built = build(config, ENVIRONMENTS[env])
    # As JSON text: the same values in the same order (the config dump's order).
    assert json.dumps(built) == json.dumps(RECORDED[f"{config} / {env}"])


SHARED = dict(
    arms=dict(teacher=dict(type="T"), student=dict(type="S", mode="prerouted")),
    arm_paths=dict(teacher="teacher", student="student"),
    api_arms=dict(student_api=dict(type="A", path="edge0-student")),
    api_paths=dict(student_api="student"),
    roles=dict(teacher="the teacher dir", student="the student dir"),
    sampling={"opencompass": {"35b": dict(temperature=0.6)}, "card": {}},
    students={"35b": dict(experts_per_token=4)},
    batch={"35b": dict(teacher=8, student=2)},
    generation=dict(max_out_len=64, chat_template_kwargs=dict(enable_thinking=True)),
)
PATHS = {"EDGE0_35B_TEACHER": "/t", "EDGE0_35B_STUDENT": "/s"}


def test_arms_in_their_order_with_the_tier_settings():
    env = {**PATHS, "EDGE0_ARMS": "student_api,student,teacher"}
    env["EDGE0_35B_STUDENT_API"] = "http://a/v1,http://b/v1"
    api, student, teacher = tiers.tier_models("35b", env, SHARED)
    assert teacher == dict(
        abbr="edge0-35b-teacher",
        path="/t",
        type="T",
        max_out_len=64,
        chat_template_kwargs=dict(enable_thinking=True),
        generation_kwargs=dict(temperature=0.6, seed=0),
        batch_size=8,
    )
    assert student["path"] == "/s" and student["experts_per_token"] == 4
    assert api["openai_api_base"] == ["http://a/v1", "http://b/v1"]
    assert api["tokenizer_path"] == "/s" and api["batch_size"] == 2 * 2
    # A gate's settings over every arm's, in place.
    gate = tiers.tier_models("35b", PATHS, SHARED, dict(max_out_len=8))
    assert [list(m) for m in gate] == [
        list(m) for m in tiers.tier_models("35b", PATHS, SHARED)
    ]
    assert {m["max_out_len"] for m in gate} == {8}


@pytest.mark.parametrize(
    "env,message",
    [
        (
            {**PATHS, "EDGE0_ARMS": "teacher,bogus", "EDGE0_SAMPLING": "x"},
            "EDGE0_ARMS has unknown arms ['bogus']; choose from teacher, student, "
            "student_api",
        ),
        (
            {**PATHS, "EDGE0_SAMPLING": "card"},
            "EDGE0_SAMPLING='card' is not a sampling of the 35b tier; choose from "
            "opencompass",
        ),
        (
            {"EDGE0_35B_STUDENT": "/s"},
            "EDGE0_35B_TEACHER is not set: export it to the teacher dir",
        ),
        (
            {**PATHS, "EDGE0_ARMS": "student_api"},
            "EDGE0_35B_STUDENT_API is not set: export it to the server URL(s), "
            "comma-separated (http://HOST:PORT/v1)",
        ),
    ],
    ids=["unknown arm first", "sampling", "model directory", "server URL"],
)
def test_a_bad_variable_is_one_error_naming_it_and_the_fix(env, message):
    with pytest.raises(ConfigError) as exc:
        tiers.tier_models("35b", env, SHARED)
    assert str(exc.value) == message
    # A config stops with that one line, which OpenCompass prints without a traceback.
    with pytest.raises(SystemExit) as stop:
        tiers.for_config(tiers.tier_models, "35b", env, SHARED)
    assert str(stop.value) == f"edge0-eval: {message}"


def test_gate_round_seed_and_sample():
    assert tiers.gate_round({}) == tiers.gate_round({"EDGE0_GATE_ROUND": ""}) == 0
    assert tiers.gate_round({"EDGE0_GATE_ROUND": "3"}) == 3
    for bad in ("x", "-1", "1.5"):
        with pytest.raises(ConfigError, match=rf"EDGE0_GATE_ROUND='{bad}' is not a"):
            tiers.gate_round({"EDGE0_GATE_ROUND": bad})
    assert (
        tiers.gate_seed({}) == "" and tiers.gate_seed({"EDGE0_GATE_SEED": "a"}) == "a"
    )
    sources = [
        dict(abbr="a", reader_cfg=dict(input_columns=["q"])),
        dict(abbr="b", reader_cfg=dict(input_columns=["q"])),
        dict(abbr="c", reader_cfg=dict(input_columns=["q"])),
    ]
    fidelity = [dict(abbr="edge0_fidelity")]
    sample = tiers.gate_datasets(
        {"35b": dict(samples=dict(a=3, b=0))}, sources, fidelity
    )["35b"]
    assert sample == [
        dict(abbr="a", reader_cfg=dict(input_columns=["q"], test_range=3)),
        dict(abbr="edge0_fidelity"),
    ]
    assert (
        "test_range" not in sources[0]["reader_cfg"]
    )  # the sources are left as they are
