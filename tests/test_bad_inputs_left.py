"""Bad inputs left over from the first reliability pass (inputs that still ended in a traceback)."""

from __future__ import annotations

import pytest
from bad_inputs import copy_model, edit_json, expect_clear_error

from edge0_eval import generate as generate_verb
from edge0_eval.cli import main
from edge0_eval.engine.engine import Engine
from edge0_eval.engine.families import family_for
from edge0_eval.engine.options import EngineOptions
from edge0_eval.formats.config import read_config
from edge0_eval.formats.layout import INDEX_NAME, ExpertIndex


def _text(config: dict) -> dict:
    return config.get("text_config") or config


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda c: _text(c).update(num_experts_per_tok=0), "num_experts_per_tok"),
        (lambda c: _text(c).update(num_experts_per_tok=-3), "num_experts_per_tok"),
        (
            lambda c: _text(c).update(num_experts_per_tok=_text(c)["num_experts"] + 1),
            "more than the",
        ),
        (lambda c: _text(c).update(num_experts=0), "num_experts"),
    ],
)
def test_routing_width_in_config_refused(edge0_qwen, tmp_path, change, message):
    model = copy_model(edge0_qwen, tmp_path / "m")
    edit_json(model / "config.json", change)
    error = expect_clear_error(
        lambda: read_config(model / "config.json", family_for), "config.json"
    )
    assert message in error
    expect_clear_error(lambda: Engine.load(model), "config.json")


def test_index_dtype_that_is_a_list_refused(edge0_qwen, tmp_path):
    model = copy_model(edge0_qwen, tmp_path / "m")
    edit_json(model / INDEX_NAME, lambda d: d["tensors"][0].update(dtype=["uint32"]))
    expect_clear_error(lambda: ExpertIndex.load(model), INDEX_NAME)


@pytest.mark.parametrize(
    "name, options",
    [
        ("lora.safetensors", {}),
        ("prerouter_hedge.safetensors", {"mode": "prerouted"}),
    ],
)
def test_adapter_name_held_by_a_directory_refused(edge0_qwen, tmp_path, name, options):
    """A directory where the default adapter file goes is not 'no adapter': the base model
    would be served without a word."""
    model = copy_model(edge0_qwen, tmp_path / "m")
    (model / name).mkdir()
    if options.get("mode") == "prerouted":
        from perturbed_heads import perturbed_heads

        heads, _ = perturbed_heads(model, tmp_path / "heads")
        options = dict(options, prerouter_path=str(heads))
    message = expect_clear_error(lambda: EngineOptions(**options).resolve(model), name)
    assert "not a file" in message


def test_ctrl_c_is_one_line_not_a_traceback(edge0_qwen, monkeypatch, capsys):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(generate_verb, "run", interrupted)
    code = main(["generate", str(edge0_qwen), "--prompt", "hi"])
    err = capsys.readouterr().err
    assert code == 130 and "interrupted" in err and "Traceback" not in err


# -- LoRA alpha from the adapter_config.json beside the file ---------------------------


def _lora_without_alpha(engine, path):
    import mlx.core as mx
    from test_bad_inputs import _lora_file

    arrays = mx.load(str(_lora_file(engine, path)))
    mx.save_safetensors(str(path), arrays, metadata={"kind": "lora", "r": "4"})
    return path


@pytest.fixture
def bare_engine(edge0_qwen):
    engine = Engine.load(edge0_qwen, EngineOptions(no_lora=True))
    yield engine
    engine.close()


@pytest.mark.parametrize(
    "config",
    [{"lora_alpha": 8, "r": 4}, {"lora_parameters": {"rank": 4, "scale": 2.0}}],
    ids=["peft", "mlx-lm"],
)
def test_lora_alpha_from_adapter_config(bare_engine, tmp_path, config):
    import json

    from edge0_eval.engine.lora import load_adapter

    path = _lora_without_alpha(bare_engine, tmp_path / "lora.safetensors")
    expect_clear_error(
        lambda: load_adapter(bare_engine.model, path), "adapter_config.json"
    )
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    meta = load_adapter(bare_engine.model, path)
    assert meta["alpha"] == 8.0 and meta["scale"] == 2.0


def test_bad_adapter_config_alpha_refused(bare_engine, tmp_path):
    from edge0_eval.engine.lora import load_adapter

    path = _lora_without_alpha(bare_engine, tmp_path / "lora.safetensors")
    (tmp_path / "adapter_config.json").write_text('{"lora_alpha": "32"}')
    expect_clear_error(
        lambda: load_adapter(bare_engine.model, path), "adapter_config.json"
    )
