"""`edge0-eval convert`: bit-exact against mlx-lm, index integrity, and bad input."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from edge0_eval.checkpoints.conversion import convert
from edge0_eval.checkpoints.tiny import TinyShape, write_tiny
from edge0_eval.errors import CheckpointError, ConfigError
from edge0_eval.formats.layout import (
    EXPERTS_NAME,
    INDEX_NAME,
    RESIDENT_NAME,
    ExpertIndex,
    crc32,
    unpack_bundle,
)

TOKENS = mx.array([[5, 17, 42, 99, 3, 250, 7, 64, 128, 11]])


# -- helpers: rebuild an mlx-lm model from a converted directory -------------------------------


def restack_experts(out_dir: Path) -> dict[str, mx.array]:
    """experts.bin -> mlx-lm's stacked switch_mlp tensors ([E, ...] per projection/part)."""
    index = ExpertIndex.load(out_dir)
    data = np.fromfile(out_dir / index.file, dtype=np.uint8)
    weights = {}
    for layer in index.moe_layers:
        layout, bundles = index.layout(layer), []
        for e in range(index.num_experts):
            start = index.bundle_offset(layer, e)
            bundles.append(
                unpack_bundle(layout, data[start : start + layout.bundle_bytes])
            )
        for spec in layout.tensors:
            arr = mx.array(np.stack([b[spec.name] for b in bundles]))
            if spec.dtype == "bfloat16":
                arr = arr.view(mx.bfloat16)
            weights[f"{index.module_path.format(layer=layer)}.{spec.name}"] = arr
    return weights


def converted_weights(out_dir: Path) -> dict[str, mx.array]:
    weights = dict(mx.load(str(out_dir / RESIDENT_NAME)))
    experts = restack_experts(out_dir)
    assert not set(weights) & set(experts), (
        "resident.safetensors must not hold routed experts"
    )
    weights.update(experts)
    return weights


def load_converted(out_dir: Path):
    """The mlx-lm model for a converted directory, through mlx-lm's own loader."""
    from mlx_lm.utils import load_model

    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(out_dir / "config.json", tmp)
        mx.save_safetensors(
            str(Path(tmp) / "model.safetensors"), converted_weights(out_dir)
        )
        model, _ = load_model(Path(tmp), strict=True)
    return model


def assert_same_tensors(ours: dict, reference: dict) -> None:
    assert sorted(ours) == sorted(reference)
    for name, ref in reference.items():
        assert ours[name].dtype == ref.dtype, name
        assert ours[name].shape == ref.shape, name
        assert mx.array_equal(ours[name], ref).item(), f"{name} differs"


def nothing_written(parent: Path, keep: set[str]) -> bool:
    return {p.name for p in parent.iterdir()} == keep


# -- fp source: quantized exactly as mlx-lm's quantize_model ----------------------------------


def _assert_matches_quantize_model(src: Path, out: Path) -> None:
    from mlx_lm.utils import load_model, quantize_model, save_config

    model, config = load_model(src)
    model, qconfig = quantize_model(model, config, group_size=64, bits=4)
    assert_same_tensors(converted_weights(out), dict(tree_flatten(model.parameters())))
    ours = json.loads((out / "config.json").read_text())
    assert ours["quantization"] == qconfig["quantization"]
    # The config file is what mlx-lm's own save_config would write for that config.
    with tempfile.TemporaryDirectory() as tmp:
        raw = json.loads((src / "config.json").read_text())
        _, want = quantize_model(load_model(src)[0], raw, group_size=64, bits=4)
        save_config(want, Path(tmp) / "config.json")
        assert (out / "config.json").read_text() == (
            Path(tmp) / "config.json"
        ).read_text()


@pytest.mark.parametrize("fixture", ["tiny_qwen", "tiny_bailing", "tiny_qwen2"])
def test_float_source_bit_exact_with_mlx_lm_quantize_model(fixture, request, tmp_path):
    src = request.getfixturevalue(fixture)
    out = convert(src, tmp_path / "out", progress=False)
    _assert_matches_quantize_model(src, out)
    index = ExpertIndex.load(out)
    assert index.describe_quant() == "4-bit group 64 affine"
    assert index.format_version == 1  # what builds before version 2 read


def test_bfloat16_source_bit_exact(tmp_path):
    src = write_tiny(
        tmp_path / "src",
        TinyShape(family="bailing_hybrid", dtype="bfloat16", layers=3, seed=5),
    )
    out = convert(src, tmp_path / "out", progress=False)
    _assert_matches_quantize_model(src, out)
    index = ExpertIndex.load(out)
    assert {t.dtype for t in index.layouts[0].tensors} == {"uint32", "bfloat16"}


def test_sharded_source_gives_the_same_output(tiny_qwen, tmp_path):
    """Two shards + model.safetensors.index.json convert exactly like one file."""
    src = tmp_path / "sharded"
    shutil.copytree(tiny_qwen, src)
    weights = mx.load(str(src / "model.safetensors"))
    (src / "model.safetensors").unlink()
    names = sorted(weights)
    # Split mid-way through the experts so one layer's projections straddle two shards.
    cut = names.index(
        next(n for n in names if n.endswith("layers.2.mlp.switch_mlp.up_proj.weight"))
    )
    shards = {
        "model-00001-of-00002.safetensors": names[:cut],
        "model-00002-of-00002.safetensors": names[cut:],
    }
    weight_map = {}
    for file, part in shards.items():
        mx.save_safetensors(
            str(src / file), {n: weights[n] for n in part}, metadata={"format": "mlx"}
        )
        weight_map.update({n: file for n in part})
    (src / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": weight_map})
    )

    one = convert(tiny_qwen, tmp_path / "one", progress=False)
    two = convert(src, tmp_path / "two", progress=False)
    assert (one / EXPERTS_NAME).read_bytes() == (two / EXPERTS_NAME).read_bytes()
    assert_same_tensors(
        dict(mx.load(str(two / RESIDENT_NAME))), dict(mx.load(str(one / RESIDENT_NAME)))
    )
    assert sorted(ExpertIndex.load(two).source) == ["config.json", *shards]


# -- quantized source: repacked bit for bit ----------------------------------------------------


@pytest.mark.parametrize(
    "fixture", ["tiny_qwen_q4", "tiny_bailing_q4", "tiny_qwen2_q4"]
)
def test_quantized_source_same_logits_as_mlx_lm_load(fixture, request, tmp_path):
    from mlx_lm import load

    src = request.getfixturevalue(fixture)
    out = convert(src, tmp_path / "out", progress=False)
    reference, _ = load(str(src))
    ours = load_converted(out)
    assert_same_tensors(
        dict(tree_flatten(ours.parameters())),
        dict(tree_flatten(reference.parameters())),
    )
    want, got = reference(TOKENS), ours(TOKENS)
    assert mx.all(mx.isfinite(want)).item()
    assert mx.array_equal(got, want).item()
    assert (out / "config.json").read_bytes() == (src / "config.json").read_bytes()


def test_index_bundles_and_side_files(tiny_bailing_q4, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(tiny_bailing_q4, src)
    # a local cache of the source's own files (the weights' digests) is not a side file
    (src / ".edge0_weights_sha256.json").write_text("{}")
    out = convert(src, tmp_path / "out", progress=False)
    index = ExpertIndex.load(out)
    config = json.loads((src / "config.json").read_text())
    assert index.model_type == "bailing_hybrid"
    assert index.moe_layers == [1, 2, 3]  # layer 0 is dense
    assert index.module_path == "model.layers.{layer}.mlp.switch_mlp"
    assert index.num_experts == config["num_experts"]
    (layout,) = index.layouts
    assert layout.bundle_stride % 4096 == 0
    assert layout.bundle_stride >= layout.bundle_bytes
    data = (out / EXPERTS_NAME).read_bytes()
    assert len(data) == index.file_size == 3 * 16 * layout.bundle_stride
    for pos, layer in enumerate(index.moe_layers):
        for e in range(index.num_experts):
            start = index.bundle_offset(layer, e)
            assert start % 4096 == 0
            assert (
                zlib.crc32(data[start : start + layout.bundle_stride])
                == index.crc32[pos][e]
            )
    for name, info in index.source.items():
        body = (src / name).read_bytes()
        assert info == {"sha256": hashlib.sha256(body).hexdigest(), "bytes": len(body)}
    assert set(index.source) == {"config.json", "model.safetensors"}
    files = {p.name for p in out.iterdir()}
    assert files == {
        "config.json",
        "experts.bin",
        "experts.index.json",
        "resident.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
    }
    assert not any("switch_mlp" in k for k in mx.load(str(out / RESIDENT_NAME)))
    # the temp dir renamed, nothing left over
    assert nothing_written(tmp_path, {"out", "src"})
    # One affine quantization for every expert: format_version 1, field for field as builds
    # before version 2 wrote and read it.
    assert list(json.loads((out / INDEX_NAME).read_text())) == [
        "model_type",
        "num_experts",
        "moe_layers",
        "module_path",
        "bits",
        "group_size",
        "mode",
        "tensors",
        "bundle_bytes",
        "bundle_stride",
        "file",
        "file_size",
        "alignment",
        "source",
        "crc32",
        "format",
        "format_version",
    ]
    assert json.loads((out / INDEX_NAME).read_text())["format_version"] == 1


# -- bad input: one clear error, nothing written -----------------------------------------------


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_bundle_checksum_is_zlibs_crc32():
    """Indexes written with Python's zlib keep verifying: the engine's crc32 gives zlib's
    values, chained over a bundle's pieces alike (the store checks a bundle piece by piece)."""
    data = np.random.default_rng(0).bytes(100_003)
    assert crc32(data) == zlib.crc32(data)
    pieces = crc32(memoryview(data)[4096:], crc32(memoryview(data)[:4096]))
    assert pieces == zlib.crc32(data)


def test_truncated_shard_names_the_file(tiny_qwen_q4, tmp_path):
    src = _copy(tiny_qwen_q4, tmp_path / "src")
    shard = src / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*truncated"):
        convert(src, tmp_path / "out", progress=False)
    assert nothing_written(tmp_path, {"src"})


def test_corrupt_header_names_the_file(tiny_qwen_q4, tmp_path):
    src = _copy(tiny_qwen_q4, tmp_path / "src")
    (src / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(
        CheckpointError, match=r"model\.safetensors: .*not a valid safetensors"
    ):
        convert(src, tmp_path / "out", progress=False)
    assert nothing_written(tmp_path, {"src"})


def test_unknown_model_type_names_supported_ones(tiny_qwen_q4, tmp_path):
    src = _copy(tiny_qwen_q4, tmp_path / "src")
    config = json.loads((src / "config.json").read_text())
    config["model_type"] = "llama"
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        CheckpointError, match="'llama' is not supported.*qwen3_5_moe, bailing_hybrid"
    ):
        convert(src, tmp_path / "out", progress=False)
    assert nothing_written(tmp_path, {"src"})


def test_missing_config(tmp_path):
    (tmp_path / "src").mkdir()
    with pytest.raises(CheckpointError, match="config.json not found"):
        convert(tmp_path / "src", tmp_path / "out", progress=False)
    assert nothing_written(tmp_path, {"src"})


@pytest.mark.parametrize("fixture", ["tiny_qwen", "tiny_qwen_q4"])
def test_missing_expert_tensor(fixture, request, tmp_path):
    src = _copy(request.getfixturevalue(fixture), tmp_path / "src")
    weights = mx.load(str(src / "model.safetensors"))
    gone = next(n for n in sorted(weights) if "layers.2.mlp.switch_mlp.down_proj" in n)
    del weights[gone]
    mx.save_safetensors(
        str(src / "model.safetensors"), weights, metadata={"format": "mlx"}
    )
    with pytest.raises(
        CheckpointError,
        match=f"1 expert tensor.*missing after mlx-lm's sanitize, e.g. {gone};",
    ):
        convert(src, tmp_path / "out", progress=False)
    assert nothing_written(tmp_path, {"src"})


def test_requantizing_a_quantized_source_is_refused(tiny_qwen_q4, tmp_path):
    with pytest.raises(ConfigError, match="already quantized"):
        convert(tiny_qwen_q4, tmp_path / "out", bits=8, progress=False)
    assert nothing_written(tmp_path, set())


def test_non_empty_out_refused_by_cli(tiny_qwen_q4, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("user data")
    proc = subprocess.run(
        [sys.executable, "-m", "edge0_eval", "convert", str(tiny_qwen_q4), str(out)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert "exists and is not empty" in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert nothing_written(tmp_path, {"out"})


def test_cli_converts(tiny_bailing, tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "edge0_eval",
            "convert",
            str(tiny_bailing),
            str(tmp_path / "out"),
            "--bits",
            "4",
            "--group-size",
            "64",
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert "3 MoE layers x 16 experts" in proc.stdout
    ExpertIndex.load(tmp_path / "out")
