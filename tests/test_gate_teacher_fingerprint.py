"""A fidelity set's teacher fingerprint covers the weights' bytes: a set made from another
teacher of the same shape (another seed: the same config, tokenizer and safetensors headers)
is refused at the preflight, before any task runs, naming both. Before, the fingerprint hashed
config, tokenizer and headers only, so the two shared it and only the report's teacher-sanity
check, after the whole run, noticed."""

from __future__ import annotations

import json

from edge0_eval.checkpoints.tiny import TinyShape, write_tiny
from edge0_eval.evaluation.fidelity import sets as fs
from model_wrappers.datasets.fidelity_dataset import preflight_problems


def test_a_same_shape_teachers_set_is_refused_at_the_preflight(
    tiny_qwen, tmp_path, monkeypatch
):
    other = write_tiny(tmp_path / "seed1", TinyShape(family="qwen3_5_moe", seed=1))
    assert (other / "config.json").read_bytes() == (
        tiny_qwen / "config.json"
    ).read_bytes()
    made_by = fs.fingerprint(other)
    assert made_by != fs.fingerprint(tiny_qwen)
    # Hashed once: the digest is cached beside the checkpoint, by name, size and mtime.
    cache = json.loads((other / fs.DIGEST_CACHE).read_text())
    assert set(cache) == {p.name for p in other.glob("*.safetensors")}
    assert fs.fingerprint(other) == made_by
    monkeypatch.setenv("COMPASS_DATA_CACHE", str(tmp_path))
    path = tmp_path / fs.SET_PATH
    path.parent.mkdir(parents=True)
    fset = json.loads(json.dumps(_set(made_by)))
    fs.write_set(fset, path)
    datasets = [{"abbr": fs.DATASET_ABBR}]
    assert preflight_problems(datasets, [("teacher", str(other), True, "auto")]) == []
    (problem,) = preflight_problems(
        datasets, [("teacher", str(tiny_qwen), True, "auto")]
    )
    assert "fingerprints differ" in problem and str(tiny_qwen) in problem
    assert fset["teacher"]["name"] in problem and str(path) in problem


def _set(fingerprint: str) -> dict:
    from test_fidelity_set_schema import _valid_set

    fset = _valid_set(fingerprint)
    fset["teacher"]["name"] = "seed-1-teacher"
    return fset
