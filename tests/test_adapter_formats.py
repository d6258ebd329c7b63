"""LoRA adapters in the formats people publish (mlx-lm tuner, PEFT, ours without alpha, under
Hugging Face module names) change the logits exactly as mlx-lm's own adapter loading does on the
same weights, or are refused naming the format."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest
from bad_inputs import copy_model
from mlx_lm import load

from edge0_eval.engine.engine import Engine
from edge0_eval.engine.lora import load_adapter
from edge0_eval.engine.options import EngineOptions
from edge0_eval.errors import CheckpointError

TOKENS = mx.array([[5, 17, 42, 99, 3, 250, 7, 64]])
TARGETS = ("self_attn.q_proj", "self_attn.o_proj")
LAYER = 3  # the tiny qwen3_5_moe's full-attention layer
RANK, SCALE = 4, 2.0  # PEFT: lora_alpha = SCALE x RANK


def _mlx_path(target: str) -> str:
    return f"language_model.model.layers.{LAYER}.{target}"


def _hf_path(target: str) -> str:
    return f"model.language_model.layers.{LAYER}.{target}"


@pytest.fixture(scope="module")
def lora_weights(tiny_qwen_q4):
    """mlx-lm tuner weights (lora_a [in, r], lora_b [r, out]) for TARGETS, large enough to move
    the logits well beyond rounding."""
    model, _ = load(str(tiny_qwen_q4))
    key = mx.random.key(7)
    weights = {}
    for target in TARGETS:
        module = model.language_model.model.layers[LAYER]
        for name in target.split("."):
            module = getattr(module, name)
        out_dims, in_dims = (
            module.weight.shape[0],
            module.weight.shape[1] * 32 // module.bits,
        )
        ka, kb, key = mx.random.split(key, 3)
        weights[_mlx_path(target)] = (
            mx.random.normal((in_dims, RANK), key=ka) * 0.3,
            mx.random.normal((RANK, out_dims), key=kb) * 0.3,
        )
    return weights


def _mlx_lm_dir(weights, directory: Path, **config) -> Path:
    directory.mkdir()
    arrays = {}
    for path, (a, b) in weights.items():
        arrays[f"{path}.lora_a"], arrays[f"{path}.lora_b"] = a, b
    mx.save_safetensors(str(directory / "adapters.safetensors"), arrays)
    (directory / "adapter_config.json").write_text(
        json.dumps(
            {
                "fine_tune_type": "lora",
                "num_layers": 4,
                "lora_parameters": {
                    "rank": RANK,
                    "scale": SCALE,
                    "dropout": 0.0,
                    "keys": list(TARGETS),
                },
                **config,
            }
        )
    )
    return directory / "adapters.safetensors"


def _peft_dir(weights, directory: Path, **config) -> Path:
    directory.mkdir()
    arrays = {}
    for target in TARGETS:
        a, b = weights[_mlx_path(target)]
        base = f"base_model.model.{_hf_path(target)}"
        arrays[f"{base}.lora_A.weight"], arrays[f"{base}.lora_B.weight"] = a.T, b.T
    mx.save_safetensors(
        str(directory / "adapter_model.safetensors"), arrays, metadata={"format": "pt"}
    )
    (directory / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "r": RANK,
                "lora_alpha": SCALE * RANK,
                "target_modules": ["q_proj", "o_proj"],
                **config,
            }
        )
    )
    return directory / "adapter_model.safetensors"


def _ours_hf_names(weights, path: Path) -> Path:
    """Our layout without alpha metadata, under Hugging Face module names."""
    arrays = {}
    for target in TARGETS:
        a, b = weights[_mlx_path(target)]
        arrays[f"{_hf_path(target)}.lora_A"], arrays[f"{_hf_path(target)}.lora_B"] = (
            a.T,
            b.T,
        )
    mx.save_safetensors(str(path), arrays, metadata={"kind": "lora", "r": str(RANK)})
    return path


def _ours_logits(src, adapter, **kwargs):
    model, _ = load(str(src))
    meta = load_adapter(model, adapter, compute_dtype=mx.float16, **kwargs)
    assert sorted(meta["targets"]) == sorted(map(_mlx_path, TARGETS))
    return model(TOKENS)


@pytest.fixture(scope="module")
def reference(tiny_qwen_q4, lora_weights, tmp_path_factory):
    """(logits without, logits with the adapter) as mlx-lm's own loading computes them."""
    adapter = _mlx_lm_dir(lora_weights, tmp_path_factory.mktemp("ref") / "mlx")
    base, _ = load(str(tiny_qwen_q4))
    with_adapter, _ = load(str(tiny_qwen_q4), adapter_path=str(adapter.parent))
    return base(TOKENS), with_adapter(TOKENS)


def _assert_as_mlx_lm(ours, reference):
    base, want = reference
    moved = float(mx.abs(want - base).max())
    assert moved > 0.1  # the adapter matters at this scale
    assert float(mx.abs(ours - want).max()) < 0.01 * moved


@pytest.mark.parametrize("fmt", ["mlx-lm", "peft", "ours-hf-names"])
def test_published_formats_match_mlx_lm_adapter_loading(
    fmt, tiny_qwen_q4, lora_weights, reference, tmp_path
):
    if fmt == "mlx-lm":
        logits = _ours_logits(tiny_qwen_q4, _mlx_lm_dir(lora_weights, tmp_path / "a"))
    elif fmt == "peft":
        logits = _ours_logits(tiny_qwen_q4, _peft_dir(lora_weights, tmp_path / "a"))
    else:
        logits = _ours_logits(
            tiny_qwen_q4,
            _ours_hf_names(lora_weights, tmp_path / "a.safetensors"),
            alpha=SCALE * RANK,
        )
    _assert_as_mlx_lm(logits, reference)


def test_rslora_scale(tiny_qwen_q4, lora_weights, reference, tmp_path):
    """rsLoRA scales by alpha/sqrt(r): the same effective scale with lora_alpha = SCALE*sqrt(r)."""
    adapter = _peft_dir(
        lora_weights, tmp_path / "a", use_rslora=True, lora_alpha=SCALE * RANK**0.5
    )
    _assert_as_mlx_lm(_ours_logits(tiny_qwen_q4, adapter), reference)


@pytest.mark.parametrize(
    "build,config,match",
    [
        (_mlx_lm_dir, {"fine_tune_type": "dora"}, "'dora' adapter; only plain LoRA"),
        (_peft_dir, {"use_dora": True}, "'DoRA' adapter; only plain LoRA"),
        (
            _peft_dir,
            {"rank_pattern": {"q_proj": 8}},
            "rank_pattern gives modules their own rank",
        ),
    ],
)
def test_other_adapter_kinds_refused_naming_them(
    build, config, match, tiny_qwen_q4, lora_weights, tmp_path
):
    adapter = build(lora_weights, tmp_path / "a", **config)
    model, _ = load(str(tiny_qwen_q4))
    with pytest.raises(CheckpointError, match=match):
        load_adapter(model, adapter)


def test_expert_lora_refused(tiny_qwen_q4, lora_weights, tmp_path):
    adapter = _mlx_lm_dir(lora_weights, tmp_path / "a")
    arrays = dict(mx.load(str(adapter)))
    arrays["language_model.model.layers.1.mlp.switch_mlp.up_proj.lora_a"] = mx.zeros(
        (16, 64, 4)
    )
    mx.save_safetensors(str(adapter), arrays)
    model, _ = load(str(tiny_qwen_q4))
    with pytest.raises(
        CheckpointError, match="LoRA on routed experts .* is not served"
    ):
        load_adapter(model, adapter)


def test_lora_alpha_option_reaches_the_engine(edge0_qwen, lora_weights, tmp_path):
    model = copy_model(edge0_qwen, tmp_path / "m")
    adapter = _ours_hf_names(lora_weights, tmp_path / "lora.safetensors")
    with pytest.raises(CheckpointError, match="--lora-alpha"):
        Engine.load(model, EngineOptions(lora_path=str(adapter)))
    engine = Engine.load(
        model, EngineOptions(lora_path=str(adapter), lora_alpha=SCALE * RANK)
    )
    try:
        assert engine.lora["alpha"] == SCALE * RANK and engine.lora["scale"] == SCALE
    finally:
        engine.close()


def test_heads_without_kind_or_k_are_inferred_from_their_keys(edge0_qwen, tmp_path):
    """A heads file whose metadata lost kind and K loads as the same heads (at the engine's K,
    with a warning); a file whose keys are not all heads' still names its missing kind."""
    from test_bad_inputs import _heads_file

    from edge0_eval.engine.heads import load_heads

    engine = Engine.load(edge0_qwen, EngineOptions(mode="reactive", no_lora=True))
    try:
        full = _heads_file(engine, tmp_path / "full.safetensors")
        dims = dict(
            hidden=engine.family.hidden_size(engine.config),
            num_experts=engine.index.num_experts,
            experts_per_token=engine.experts_per_token,
        )
    finally:
        engine.close()
    arrays, meta = mx.load(str(full), return_metadata=True)
    bare = {k: v for k, v in meta.items() if k not in ("kind", "K")}
    mx.save_safetensors(str(tmp_path / "bare.safetensors"), arrays, metadata=bare)
    with pytest.warns(UserWarning, match="records no K.*served at the engine's K=4"):
        got = load_heads(tmp_path / "bare.safetensors", **dims)
    want = load_heads(full, **dims)
    assert mx.array_equal(got.fc1, want.fc1).item() and got.config == want.config
    mx.save_safetensors(
        str(tmp_path / "mixed.safetensors"),
        {**arrays, "extra.weight": mx.zeros((2, 2))},
        metadata=bare,
    )
    with pytest.raises(CheckpointError, match="kind=None, expected 'prerouter'"):
        load_heads(tmp_path / "mixed.safetensors", **dims)


THINKING_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% if enable_thinking %}"
    "{{ 'x = 1\\n' }}{% endif %}{% endif %}"
)


def _generate(model, tmp_path, *extra):
    import subprocess
    import sys

    out = tmp_path / "gen.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "edge0_eval",
            "generate",
            str(model),
            "--prompt",
            "hi",
            "--max-tokens",
            "1",
            "--json",
            str(out),
            *extra,
        ],
        capture_output=True,
        text=True,
    )
    return proc, (
        json.loads(out.read_text())["prompt_tokens"] if proc.returncode == 0 else None
    )


def test_generate_chat_template_config_reaches_the_template(edge0_qwen, tmp_path):
    """As mlx-lm's --chat-template-config: '{"enable_thinking": true}' is passed to the
    template (this one marks thinking on with a fixed suffix; mlx-lm's tokenizer wrapper turns
    it off by default for a vocabulary without think tokens)."""
    from bad_inputs import edit_json

    model = copy_model(edge0_qwen, tmp_path / "m")
    edit_json(
        model / "tokenizer_config.json",
        lambda c: c.__setitem__("chat_template", THINKING_TEMPLATE),
    )
    _, default = _generate(model, tmp_path)
    proc, on = _generate(
        model, tmp_path, "--chat-template-config", '{"enable_thinking": true}'
    )
    assert proc.returncode == 0, proc.stderr
    engine = Engine.load(model, EngineOptions(no_lora=True))
    try:
        suffix = engine.tokenizer.encode("x = 1\n", add_special_tokens=False)
    finally:
        engine.close()
    assert on == default + suffix
    for bad in ("[1]", "{"):
        proc, _ = _generate(model, tmp_path, "--chat-template-config", bad)
        assert proc.returncode == 2 and "--chat-template-config" in proc.stderr
        assert "Traceback" not in proc.stderr
