"""Shared fixtures: tiny checkpoints built once per test session."""

from __future__ import annotations

import pytest

from edge0_eval.tiny import TinyShape, write_tiny


@pytest.fixture(scope="session")
def tiny_qwen(tmp_path_factory):
    """fp16 qwen3_5_moe, 4 layers (3 GatedDeltaNet + 1 full attention), 16 experts, top-4."""
    return write_tiny(tmp_path_factory.mktemp("ckpt") / "qwen", TinyShape(family="qwen3_5_moe"))


@pytest.fixture(scope="session")
def tiny_bailing(tmp_path_factory):
    """fp16 bailing_hybrid, 4 layers (layer 0 dense), 16 experts in 8 groups, top-4."""
    return write_tiny(tmp_path_factory.mktemp("ckpt") / "bailing",
                      TinyShape(family="bailing_hybrid"))


@pytest.fixture(scope="session")
def tiny_qwen_q4(tmp_path_factory):
    """The same qwen shape, quantized by mlx-lm to int4 (group 64)."""
    return write_tiny(tmp_path_factory.mktemp("ckpt") / "qwen_q4",
                      TinyShape(family="qwen3_5_moe"), quantize_bits=4)


@pytest.fixture(scope="session")
def tiny_bailing_q4(tmp_path_factory):
    return write_tiny(tmp_path_factory.mktemp("ckpt") / "bailing_q4",
                      TinyShape(family="bailing_hybrid"), quantize_bits=4)
