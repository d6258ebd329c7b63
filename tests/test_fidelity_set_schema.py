"""Fidelity sets: the schema check on read (and so on `data stage`), a seeded fuzz of corrupting
mutations with its fault-injected control, and the run's preflight (vocabulary, teacher)."""

from __future__ import annotations

import copy
import json
import random

import mlx.core as mx
import pytest
from bad_inputs import expect_clear_error, outcome
from fidelity_sets import fidelity_set

from edge0_eval.cli import main
from edge0_eval.evaluation.fidelity import sets as fs
from edge0_eval.formats.safetensors import checkpoint_float_dtype, write_safetensors
from model_wrappers.datasets.fidelity_dataset import preflight_problems


def _valid_set(fingerprint: str = "0" * 64) -> dict:
    items = [
        {
            "id": f"t/{n}",
            "source": "text",
            "prompt": "p",
            "prompt_ids": [1, 2, 3 + n],
            "tokens": [4, 5],
            "topk_ids": [[4, 6], [5, 7]],
            "topk_logprobs": [[-0.1, -2.5], [-0.2, -3.0]],
            "rest": [0.05, 0.1],
            "end": "stop",
        }
        for n in range(3)
    ]
    return fidelity_set(items, fingerprint=fingerprint)


def _write(fset, path):
    path.write_text(json.dumps(fset))
    return path


# Each mutation makes the set wrong by construction: a type lie, a value out of range, or a
# shape that no longer lines up. (name, function of (set, rng)).
def _leaf_paths(fset):
    item = fset["items"][0]
    return (
        [
            ("items", 0, "prompt_ids", 0),
            ("items", 0, "tokens", 1),
            ("items", 0, "topk_ids", 0, 1),
            ("items", 0, "topk_logprobs", 1, 0),
            ("items", 0, "rest", 0),
        ]
        + [("items", 0, key) for key in item if key != "prompt"]
        + [
            ("max_new",),
            ("min_new",),
            ("top_k",),
            ("teacher",),
            ("teacher", "fingerprint"),
            ("teacher", "dtype"),
            ("items",),
        ]
    )


def _set_at(fset, path, value):
    node = fset
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value


_LIES = ["7", None, [1], {"a": 1}, True, float("nan"), float("inf"), -1, 1.5, "", []]
_NUMERIC = {
    ("items", 0, "topk_logprobs", 1, 1): [0.5, float("nan"), "x", True, None],
    ("items", 0, "rest", 1): [-0.01, 1.5, float("nan"), "0.1", None],
    ("items", 0, "prompt_ids", 2): [-1, 2.0, "3", None],
    ("items", 0, "topk_ids", 1, 1): [-2, "4", None, 1.5, 5],
}  # 5: a repeated id


def _legal_lie(path, value) -> bool:
    """The oracle, independent of the code under test: which lies are in fact legal values."""
    whole = isinstance(value, int) and not isinstance(value, bool)
    if path[-1] == "id":
        return isinstance(value, str) or whole
    if path[-1] == "source":
        return isinstance(value, str)
    if path == ("teacher", "dtype"):  # absent in older sets
        return value is None
    if "topk_logprobs" in path and len(path) == 5:  # any finite log-prob <= 0
        return (
            isinstance(value, (int, float))
            and not isinstance(value, bool)
            and value == value
            and value <= 0
            and value != float("-inf")
        )
    return False


def _mutations(seed: int, n: int):
    rng = random.Random(seed)
    base = _valid_set()
    paths = _leaf_paths(base)
    out = []
    while len(out) < n:
        fset = copy.deepcopy(base)
        kind = rng.choice(["lie", "numeric", "drop", "extend", "duplicate"])
        if kind == "numeric":
            path = rng.choice(list(_NUMERIC))
            _set_at(fset, path, rng.choice(_NUMERIC[path]))
        elif kind == "lie":
            path, value = rng.choice(paths), rng.choice(_LIES)
            if _legal_lie(path, value):
                continue
            _set_at(fset, path, value)
        elif kind == "drop":
            fset["items"][rng.randrange(3)][
                rng.choice(["topk_ids", "topk_logprobs", "rest"])
            ].pop()
        elif kind == "extend":
            key = rng.choice(["topk_ids", "topk_logprobs", "rest", "tokens"])
            fset["items"][0][key].append(fset["items"][0][key][0])
        else:
            fset["items"][1]["id"] = fset["items"][0]["id"]
        out.append((kind, fset))
    return out


def _accepted(cases, tmp_path) -> list:
    accepted = []
    for n, (kind, fset) in enumerate(cases):
        path = tmp_path / f"case{n}.json"
        path.write_text(json.dumps(fset))  # NaN/Infinity as JSON writes them
        got, message = outcome(lambda: fs.read_set(path))
        if got != "error" or str(path) not in message:
            accepted.append((kind, got, message[:200]))
    return accepted


def test_valid_set_reads(tmp_path):
    assert fs.read_set(_write(_valid_set(), tmp_path / "s.json"))["top_k"] == 2


def test_v1_sets_still_read_and_v2_needs_its_fields(tmp_path):
    """v1 (rows decoded one step at a time; no min_new, left_out, end) stays readable."""
    v1 = _valid_set()
    v1["format"] = "edge0-eval/fidelity/v1"
    for key in ("min_new", "thinking_in_template", "left_out"):
        v1.pop(key)
    for item in v1["items"]:
        item.pop("end")
    assert fs.read_set(_write(v1, tmp_path / "v1.json"))["format"].endswith("/v1")
    short = _valid_set()
    short["min_new"] = 3  # its items hold 2 tokens
    with pytest.raises(Exception, match="min_new..max_new"):
        fs.read_set(_write(short, tmp_path / "short.json"))
    v2 = _valid_set()
    v2["items"][1].pop("end")
    with pytest.raises(Exception, match="end None"):
        fs.read_set(_write(v2, tmp_path / "v2.json"))


def test_fuzzed_sets_are_each_one_clear_error(tmp_path):
    cases = _mutations(seed=30, n=240)
    assert len(cases) >= 200
    assert _accepted(cases, tmp_path) == []


def test_fuzz_control_sees_a_weakened_check(tmp_path, monkeypatch):
    """The fuzz can fail: with the value-range checks switched off, corrupt sets get through."""
    monkeypatch.setattr(fs, "_is_real", lambda v: True)
    assert _accepted(_mutations(seed=30, n=240), tmp_path)


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda s: s["items"][0]["topk_logprobs"][0].__setitem__(0, "-0.1"),
            "log-probs",
        ),
        (lambda s: s.update(max_new="8"), "max_new"),
        (lambda s: s.update(top_k="2"), "top_k"),
        (lambda s: s["items"][0].update(id=["t"]), "id"),
        (lambda s: s["items"][0].update(tokens="45"), "tokens"),
        (lambda s: s["items"][0]["rest"].__setitem__(0, -0.5), "tail mass"),
    ],
)
def test_data_stage_refuses_type_lies(tmp_path, edit, message, capsys):
    fset = _valid_set()
    edit(fset)
    path = _write(fset, tmp_path / "set.json")
    code = main(
        ["data", "stage", "--root", str(tmp_path / "root"), "--fidelity", str(path)]
    )
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert str(path) in err and message in err
    assert not (tmp_path / "root" / fs.SET_PATH).exists()


def _staged(tmp_path, fset, monkeypatch):
    monkeypatch.setenv("COMPASS_DATA_CACHE", str(tmp_path))
    path = tmp_path / fs.SET_PATH
    path.parent.mkdir(parents=True, exist_ok=True)
    _write(fset, path)
    return [{"abbr": fs.DATASET_ABBR}]


def test_preflight_pairs_the_set_with_this_runs_teacher(
    tiny_qwen, tiny_bailing, tmp_path, monkeypatch
):
    datasets = _staged(tmp_path, _valid_set(fs.fingerprint(tiny_qwen)), monkeypatch)
    assert (
        preflight_problems(datasets, [("teacher", str(tiny_qwen), True, "auto")]) == []
    )
    problems = preflight_problems(
        datasets, [("teacher", str(tiny_bailing), True, "auto")]
    )
    assert len(problems) == 1 and str(tiny_bailing) in problems[0]
    assert "fingerprints differ" in problems[0]
    # A student arm is no teacher: only its vocabulary is checked.
    assert (
        preflight_problems(datasets, [("student", str(tiny_bailing), False, "auto")])
        == []
    )


def test_preflight_refuses_ids_beyond_an_arms_vocabulary(
    tiny_qwen, tmp_path, monkeypatch
):
    vocab = (
        json.loads((tiny_qwen / "config.json").read_text()).get("vocab_size")
        or json.loads((tiny_qwen / "config.json").read_text())["text_config"][
            "vocab_size"
        ]
    )
    fset = _valid_set(fs.fingerprint(tiny_qwen))
    fset["items"][2]["prompt_ids"][0] = vocab  # one past the embedding
    datasets = _staged(tmp_path, fset, monkeypatch)
    problems = preflight_problems(datasets, [("teacher", str(tiny_qwen), True, "auto")])
    assert len(problems) == 1 and f"token id {vocab}" in problems[0]
    assert str(tmp_path / fs.SET_PATH) in problems[0]


def test_preflight_refuses_a_set_made_in_another_dtype(
    tiny_qwen, tmp_path, monkeypatch
):
    # A set made where the teacher ran in bfloat16 (Metal's 'auto' on a bf16 checkpoint) cannot
    # be reproduced by a teacher arm computing in float32 (the CPU's 'auto'): refused before
    # any task, naming the file, both dtypes and the fix; the matching dtype passes.
    fset = _valid_set(fs.fingerprint(tiny_qwen))
    fset["teacher"]["dtype"] = "bfloat16"
    datasets = _staged(tmp_path, fset, monkeypatch)
    problems = preflight_problems(
        datasets, [("teacher", str(tiny_qwen), True, "float32")]
    )
    assert len(problems) == 1, problems
    assert str(tmp_path / fs.SET_PATH) in problems[0] and str(tiny_qwen) in problems[0]
    assert "bfloat16" in problems[0] and "float32" in problems[0]
    assert "compute_dtype='bfloat16'" in problems[0]
    assert (
        preflight_problems(datasets, [("teacher", str(tiny_qwen), True, "bfloat16")])
        == []
    )
    # Students are scored against the set whatever their dtype; sets without one are not checked.
    assert (
        preflight_problems(datasets, [("student", str(tiny_qwen), False, "float32")])
        == []
    )
    del fset["teacher"]["dtype"]
    datasets = _staged(tmp_path, fset, monkeypatch)
    assert (
        preflight_problems(datasets, [("teacher", str(tiny_qwen), True, "float32")])
        == []
    )
    fset["teacher"]["dtype"] = "fp8"
    datasets = _staged(tmp_path, fset, monkeypatch)
    problems = preflight_problems(
        datasets, [("teacher", str(tiny_qwen), True, "float32")]
    )
    assert len(problems) == 1 and "teacher dtype 'fp8'" in problems[0]


def test_checkpoint_float_dtype_is_the_embeddings(tmp_path):
    # A bf16 embedding among more float32 tensors (norms an mlx-vlm conversion keeps in f32):
    # mlx-lm computes in the embedding's dtype, not the commonest.
    write_safetensors(
        tmp_path / "model.safetensors",
        {
            "model.embed_tokens.weight": mx.zeros((4, 2), dtype=mx.bfloat16),
            **{f"model.layers.{i}.norm.weight": mx.zeros((2,)) for i in range(3)},
        },
        {},
    )
    assert checkpoint_float_dtype(tmp_path) == "bfloat16"
    write_safetensors(
        tmp_path / "model.safetensors",
        {
            f"model.layers.{i}.norm.weight": mx.zeros((2,), dtype=mx.float16)
            for i in range(3)
        },
        {},
    )
    assert checkpoint_float_dtype(tmp_path) == "float16"


def _v2_relabelled_v1(fset):
    fset["format"] = "edge0-eval/fidelity/v1"  # min_new, left_out, items' end stay


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda s: s.update(format_version=2), "unknown key(s) ['format_version']"),
        (_v2_relabelled_v1, "v2 set relabelled"),
        (lambda s: s.update(format="edge0-eval/fidelity/v3"), "expected one of"),
        (lambda s: s["teacher"].update(version=2), "teacher has unknown key"),
        (lambda s: s["items"][1].update(weight=2.0), "item 1: unknown key"),
    ],
)
def test_unknown_versions_are_refused(tmp_path, edit, message):
    """A set whose format version was 2 (a key the reader did not know, or v2 fields
    under a v1 label) was scored as v1."""
    fset = _valid_set()
    edit(fset)
    path = _write(fset, tmp_path / "set.json")
    text = expect_clear_error(lambda: fs.read_set(path), path)
    assert message in text


class _Teacher:
    """A teacher arm as the inferencer sees one (MLXLMModel: a checkpoint path, no engine
    options) whose outputs reproduce the set exactly."""

    is_api = False

    def __init__(self, path):
        self.path = str(path)

    def fidelity_logprobs(self, items):
        by_tokens = {tuple(it["tokens"]): it for it in self.items}
        return [
            {
                "logprobs": by_tokens[tuple(it["tokens"])]["topk_logprobs"],
                "argmax": list(it["tokens"]),
            }
            for it in items
        ]


def _infer(model, fset, out_dir):
    from types import SimpleNamespace

    from model_wrappers.inferencers.fidelity_inferencer import FidelityInferencer

    model.items = fset["items"]
    rows = [
        {
            "prompt": it["prompt"],
            "item": json.dumps(it),
            "teacher": json.dumps(fset["teacher"]),
        }
        for it in fset["items"]
    ]
    inferencer = FidelityInferencer(model=model, output_json_filepath=str(out_dir))
    return inferencer.inference(
        SimpleNamespace(test_ds=rows), output_json_filename="edge0_fidelity.json"
    )


def test_a_teacher_arm_refuses_a_set_made_from_another_teacher(
    tiny_qwen, tiny_bailing, tmp_path
):
    """A set whose fingerprint names another teacher was scored without a word when
    the teacher's outputs matched (a run the preflight did not see: another partitioner, a
    set staged since). Refused before its first item, nothing written."""
    ours = _valid_set(fs.fingerprint(tiny_qwen))
    assert len(_infer(_Teacher(tiny_qwen), ours, tmp_path / "ok")) == 3  # the control
    theirs = _valid_set(fs.fingerprint(tiny_bailing))
    text = expect_clear_error(
        lambda: _infer(_Teacher(tiny_qwen), theirs, tmp_path / "bad"), tiny_qwen
    )
    assert "fingerprints differ" in text
    assert not list((tmp_path / "bad").glob("*.json"))
