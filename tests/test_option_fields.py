"""Each option declared once: every options dataclass field carries its flag's metadata (or says
it has none), every verb's flag defaults to its field's default, and parsing no flags builds the
dataclass's defaults back."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

import pytest

from edge0_eval import (
    bench,
    distill,
    draft_vocab,
    fidelity,
    gate,
    generate,
    make_tiny,
    plan,
    serve,
    testbed,
    train_lora,
    train_prerouter,
)
from edge0_eval.arguments.engine_flags import add_engine_arguments, options_from_args
from edge0_eval.arguments.fields import (
    add_fields,
    check_fields,
    field_default,
    from_args,
    option,
)
from edge0_eval.checkpoints import testbed_model
from edge0_eval.checkpoints.tiny import TinyShape
from edge0_eval.engine.options import EngineOptions
from edge0_eval.errors import ConfigError
from edge0_eval.evaluation.plan.planner import PlanOptions
from edge0_eval.training.stage_options import (
    DISTILL_LR,
    STAGE_ONLY,
    PrerouterOptions,
    StageOptions,
)

# options class -> the verbs (with the action, for a verb that has actions) whose command
# lines are generated from it
CLASSES = {
    EngineOptions: ((generate,), (serve,), (bench,), (fidelity, "bench")),
    PrerouterOptions: ((train_prerouter,),),
    StageOptions: ((train_lora,), (distill,)),
    bench.BenchOptions: ((bench,),),
    gate.GateOptions: ((gate,),),
    fidelity.MakeOptions: ((fidelity, "make"),),
    fidelity.BenchOptions: ((fidelity, "bench"),),
    generate.GenerateOptions: ((generate,),),
    plan.PlanFlags: ((plan,),),
    PlanOptions: ((plan,),),
    draft_vocab.DraftVocabOptions: ((draft_vocab,),),
    TinyShape: ((make_tiny,),),
    testbed_model.TestbedOptions: ((testbed, "build"),),
}
# A verb's deliberate change of a field's default: stage 3 starts from a trained adapter (a
# smaller step); serve refuses --seed (a request gives its own).
CHANGED = {(distill, "lr"): DISTILL_LR, (serve, "seed"): None}
STAGES = {train_lora: "sft", distill: "distill"}


def undeclared(cls) -> list[str]:
    """The fields of `cls` declared without flag metadata (`option(...)`)."""
    return [f.name for f in fields(cls) if not f.metadata]


def _parser(module, action=None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    if action is None:
        return parser
    (sub,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[action]


@pytest.mark.parametrize("cls", list(CLASSES), ids=lambda c: c.__name__)
def test_every_field_declares_its_flag(cls):
    assert undeclared(cls) == []


def test_a_field_without_metadata_is_caught():
    @dataclass
    class Injected:
        declared: int = option(1, "declared once")
        bare: int = 2  # the fault: a new field with no flag metadata

    assert undeclared(Injected) == ["bare"]


@pytest.mark.parametrize(
    "cls,verb",
    [(c, v) for c, vs in CLASSES.items() for v in vs],
    ids=lambda x: getattr(x, "__name__", None) or x[0].__name__.split(".")[-1],
)
def test_every_flag_defaults_to_its_field(cls, verb):
    parser, module = _parser(*verb), verb[0]
    flags = {a.dest: a for a in parser._actions if a.option_strings}
    for f in fields(cls):
        if f.metadata.get("flag", "") is False or f.metadata.get("required"):
            continue
        if f.name in STAGE_ONLY.get(STAGES.get(module), ()):
            continue  # the other stage's option
        if not f.metadata.get("flag", "-").startswith("-"):
            continue  # positional
        assert f.name in flags, f"{module.__name__}: no flag for {f.name}"
        want = CHANGED.get((module, f.name), field_default(f))
        assert flags[f.name].default == want, (module.__name__, f.name)


def test_stage_flags_default_to_the_stage_engine():
    parser = _parser(train_lora)
    args = parser.parse_args(["S", "--teacher", "T", "--prompts", "p", "--out", "o"])
    engine = StageOptions.__dataclass_fields__["engine"].default_factory()
    assert from_args(EngineOptions, args, no_lora=True) == engine


def test_no_flags_give_the_dataclass_defaults():
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert options_from_args(parser.parse_args([])) == EngineOptions()
    assert options_from_args(parser.parse_args(["--no-guard"])).clip_hidden is None
    parser = argparse.ArgumentParser()
    add_fields(parser, PrerouterOptions)
    args = parser.parse_args(["M", "--text", "a", "--out", "o"])
    assert from_args(PrerouterOptions, args) == PrerouterOptions(
        model="M", texts=["a"], out="o"
    )


def test_a_flag_replaces_only_its_field():
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(["--lora", "L", "--no-verify-crc", "--io-workers", "2"])
    assert options_from_args(args) == EngineOptions(
        lora_path="L", verify_crc=False, io_workers=2
    )


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"steps": 0}, "--steps must be at least 1"),
        ({"train_tokens": 1}, "--train-tokens must be at least 2"),
        ({"collect": "fp8"}, "--collect must be one of served, float32, not 'fp8'"),
        ({"save_dtype": "int4"}, "--save-dtype must be one of"),
    ],
)
def test_a_field_below_its_least_or_off_its_choices_is_refused(changes, message):
    """Options built without the flags (a test, a config) keep the fields' bounds."""
    options = PrerouterOptions(model="M", texts=["a"], out="o", **changes)
    with pytest.raises(ConfigError, match=message):
        check_fields(options)
