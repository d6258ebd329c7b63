import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

from edge0_eval.checkpoints.tiny import TinyShape, write_tiny
from edge0_eval.checkpoints.tiny_configs import TINY_CONFIGS
from edge0_eval.engine.families import FAMILIES
from edge0_eval.errors import ConfigError


def _digest(path: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.iterdir())
    }


@pytest.mark.parametrize(
    "fixture",
    [
        "tiny_qwen",
        "tiny_bailing",
        "tiny_qwen2",
        "tiny_qwen_q4",
        "tiny_bailing_q4",
        "tiny_qwen2_q4",
    ],
)
def test_mlx_lm_loads_and_generates(fixture, request):
    from mlx_lm import generate, load

    from edge0_eval.engine.mlx_compat import upcast_unquantized_experts_for_cpu

    model, tokenizer = load(str(request.getfixturevalue(fixture)))
    upcast_unquantized_experts_for_cpu(model)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hello"}], add_generation_prompt=True
    )
    text = generate(model, tokenizer, prompt, max_tokens=8)
    assert isinstance(text, str) and len(text) > 0


def test_transformers_tokenizer_loads_offline(tiny_qwen):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_qwen))
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(tok.encode("def add(a, b):")) == "def add(a, b):"


def test_same_seed_byte_identical(tmp_path):
    a = write_tiny(tmp_path / "a", TinyShape(family="bailing_hybrid", seed=3))
    b = write_tiny(tmp_path / "b", TinyShape(family="bailing_hybrid", seed=3))
    c = write_tiny(tmp_path / "c", TinyShape(family="bailing_hybrid", seed=4))
    assert _digest(a) == _digest(b)
    assert _digest(a)["model.safetensors"] != _digest(c)["model.safetensors"]


def test_every_family_has_a_tiny_shape():
    # The registry and the tiny shapes are keyed by the same names, in the same order (make-tiny's
    # --family help lists the tiny shapes'), so a new family cannot miss its tiny checkpoint.
    assert list(TINY_CONFIGS) == list(FAMILIES)


def test_realistic_shape_options_reach_config(tmp_path):
    cfg = TINY_CONFIGS["qwen3_5_moe"](
        TinyShape(
            family="qwen3_5_moe",
            experts=256,
            experts_per_token=8,
            hidden=2048,
            heads=16,
            layers=40,
        )
    )
    text = cfg["text_config"]
    assert (text["num_experts"], text["num_experts_per_tok"], text["hidden_size"]) == (
        256,
        8,
        2048,
    )
    assert text["head_dim"] == 128


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(family="llama"), "unknown family"),
        (dict(experts_per_token=20, experts=16), "larger than --experts"),
        (dict(hidden=66, heads=4), "not divisible"),
    ],
)
def test_bad_shape_is_one_clear_error_and_writes_nothing(tmp_path, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        write_tiny(tmp_path / "out", TinyShape(**kwargs))
    assert list(tmp_path.iterdir()) == []


def test_non_empty_out_refused(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("user data")
    proc = subprocess.run(
        [sys.executable, "-m", "edge0_eval", "make-tiny", str(out)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert "exists and is not empty" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
