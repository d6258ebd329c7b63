"""Bad inputs: every corrupt or invalid input ends in one clear Edge0Error naming the file or
option; none is accepted, none gives a traceback or hangs (see bad_inputs.expect_clear_error).

Hand-made cases per input class, then a seeded fuzz (FUZZ_SEED) of index JSON and safetensors
headers (resident, LoRA, prerouter heads). Loaders are called in-process.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import mlx.core as mx
import pytest
from bad_inputs import (
    copy_model,
    edit_header,
    edit_json,
    expect_clear_error,
    mutate_header,
    mutate_index,
    outcome,
    read_header,
    write_header,
    write_mutated,
)

from edge0_eval.cli import main
from edge0_eval.engine.engine import Engine, EngineOptions
from edge0_eval.engine.families import check_model_dir, family_for
from edge0_eval.engine.heads import (
    default_owners,
    init_heads_from_routers,
    load_heads,
    save_heads,
)
from edge0_eval.engine.lora import (
    default_targets,
    find_targets,
    linear_dims,
    load_adapter,
)
from edge0_eval.engine.store import ExpertStore
from edge0_eval.errors import ConfigError
from edge0_eval.evaluation.gate.inputs import load_report
from edge0_eval.formats.config import read_config
from edge0_eval.formats.layout import (
    EXPERTS_NAME,
    INDEX_NAME,
    RESIDENT_NAME,
    ExpertIndex,
)
from edge0_eval.formats.model_dir import load_tokenizer_checked

FUZZ_SEED = 16


# -- shared objects ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(edge0_qwen):
    e = Engine.load(edge0_qwen, EngineOptions(mode="reactive"))
    yield e
    e.close()


def _lora_file(engine, path: Path, **meta) -> Path:
    targets = find_targets(engine.model, default_targets(engine.family.name))[:2]
    arrays = {}
    for i, t in enumerate(targets):
        module = engine.model
        for part in t.split("."):
            module = module[int(part)] if part.isdigit() else getattr(module, part)
        in_dims, out_dims = linear_dims(module)
        arrays[f"{t}.lora_A"] = mx.full((4, in_dims), 0.01, dtype=mx.float16)
        arrays[f"{t}.lora_B"] = mx.full((out_dims, 4), 0.01, dtype=mx.float16)
    metadata = {"kind": "lora", "r": "4", "alpha": "8", "format_version": "1"}
    metadata.update(meta)
    mx.save_safetensors(str(path), arrays, metadata=metadata)
    return path


def _heads_file(engine, path: Path) -> Path:
    owners = default_owners(1, len(engine.model.layers), engine.moe_layers)
    save_heads(
        path,
        init_heads_from_routers(engine, owners, width=16, seed=0),
        {"model_type": engine.config["model_type"]},
    )
    return path


def _load_lora(engine, path):
    return lambda: load_adapter(
        engine.model, path, experts_per_token=engine.experts_per_token
    )


def _load_heads(engine, path):
    return lambda: load_heads(
        path,
        hidden=engine.family.hidden_size(engine.config),
        num_experts=engine.index.num_experts,
        experts_per_token=engine.experts_per_token,
    )


def _full_check(model: Path):
    """What the engine checks before serving, plus every bundle read with its CRC."""

    def run():
        ExpertIndex.load(model)
        check_model_dir(model)
        store = ExpertStore(model, verify_crc=True)
        try:
            for layer in store.index.moe_layers:
                for e in range(store.index.num_experts):
                    store.read(layer, e)
        finally:
            store.close()

    return run


# -- expert index ----------------------------------------------------------------------------


def _index_case(name):
    def change(d):
        t = {x["name"]: x for x in d["tensors"]}
        if name == "float count":
            d["num_experts"] = 16.0
        elif name == "unknown dtype":
            t["gate_proj.scales"]["dtype"] = "float8"
        elif name == "file null":
            d["file"] = None
        elif name == "bits 0":
            d["bits"] = 0
        elif name == "bits 7":
            d["bits"] = 7
        elif name == "group 48":
            d["group_size"] = 48
        elif name == "mode mxfp4":
            d["mode"] = "mxfp4"
        elif name == "gate/up swapped":
            t["gate_proj.weight"]["offset"], t["up_proj.weight"]["offset"] = (
                t["up_proj.weight"]["offset"],
                t["gate_proj.weight"]["offset"],
            )
        elif name == "overlap":
            t["up_proj.weight"]["offset"] -= 64
        elif name == "past the end":
            d["bundle_stride"] *= 2
        elif name == "list":
            return [d]
        elif name == "string count":
            d["num_experts"] = "16"
        elif name == "bool bits":
            d["bits"] = True
        elif name == "negative offset":
            t["gate_proj.weight"]["offset"] = -8

    return change


INDEX_CASES = [
    "float count",
    "unknown dtype",
    "file null",
    "bits 0",
    "bits 7",
    "group 48",
    "mode mxfp4",
    "gate/up swapped",
    "overlap",
    "past the end",
    "list",
    "string count",
    "bool bits",
    "negative offset",
]


@pytest.mark.parametrize("case", INDEX_CASES)
def test_index_lies_refused(case, edge0_qwen, tmp_path):
    model = copy_model(edge0_qwen, tmp_path / "m")
    edit_json(model / INDEX_NAME, _index_case(case))
    expect_clear_error(lambda: ExpertIndex.load(model), INDEX_NAME)


def test_index_not_utf8(edge0_qwen, tmp_path):
    model = copy_model(edge0_qwen, tmp_path / "m")
    (model / INDEX_NAME).write_bytes(b"\xff\xfe{" + (model / INDEX_NAME).read_bytes())
    message = expect_clear_error(lambda: ExpertIndex.load(model), INDEX_NAME)
    assert "UTF-8" in message


def test_scale_dtype_relabelled_everywhere(edge0_qwen, tmp_path):
    """float16 -> bfloat16 for every scale/bias: consistent in the index, caught against the
    resident weights (same bytes, so sizes and CRCs cannot see it)."""
    model = copy_model(edge0_qwen, tmp_path / "m")

    def change(d):
        for t in d["tensors"]:
            if t["dtype"] == "float16":
                t["dtype"] = "bfloat16"

    edit_json(model / INDEX_NAME, change)
    ExpertIndex.load(model)  # the index alone is self-consistent
    expect_clear_error(lambda: Engine.load(model), RESIDENT_NAME, INDEX_NAME)


# -- config.json -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "case",
    ["invalid", "list", "missing key", "string int", "float int", "nan", "quant bits"],
)
def test_config_refused(case, edge0_qwen, tmp_path):
    model = copy_model(edge0_qwen, tmp_path / "m")
    path = model / "config.json"
    cfg = json.loads(path.read_text())
    text = cfg.get("text_config", cfg)
    if case == "invalid":
        path.write_text(path.read_text()[:-10])
    else:
        if case == "list":
            cfg = [cfg]
        elif case == "missing key":
            del text["hidden_size"]
        elif case == "string int":
            text["num_hidden_layers"] = "4"
        elif case == "float int":
            text["num_experts"] = 16.5
        elif case == "quant bits":
            cfg["quantization"]["bits"] = "4"
        elif case == "nan":
            text["rms_norm_eps"] = float("nan")
        path.write_text(json.dumps(cfg))
    expect_clear_error(lambda: read_config(path, family_for), "config.json")
    expect_clear_error(lambda: Engine.load(model), "config.json")


# -- resident header -------------------------------------------------------------------------


def _resident_case(model: Path, case: str):
    path = model / RESIDENT_NAME
    if case == "one F16 -> BF16":

        def change(h):
            name = next(k for k, v in h.items() if k.endswith("norm.weight"))
            h[name]["dtype"] = "BF16"

        edit_header(path, change)
    elif case == "all F16 -> BF16":
        edit_header(
            path,
            lambda h: (
                [
                    v.update(dtype="BF16")
                    for k, v in h.items()
                    if k != "__metadata__" and v["dtype"] == "F16"
                ]
                and None
            ),
        )
    elif case == "missing quantized tensor":
        weights = mx.load(str(path))
        del weights[next(k for k in weights if k.endswith(".biases"))]
        mx.save_safetensors(str(path), weights)
    elif case == "header list":
        header, body = read_header(path)
        write_header(path, list(header.items()), body)
    elif case == "metadata not a dict":
        edit_header(path, lambda h: h.update(__metadata__=["mlx"]))
    elif case == "unknown dtype":
        edit_header(
            path,
            lambda h: next(v for k, v in h.items() if k != "__metadata__").update(
                dtype="Q4"
            ),
        )
    elif case == "huge length":
        raw = bytearray(path.read_bytes())
        raw[:8] = (2**50).to_bytes(8, "little")
        path.write_bytes(bytes(raw))


RESIDENT_CASES = [
    "one F16 -> BF16",
    "all F16 -> BF16",
    "missing quantized tensor",
    "header list",
    "metadata not a dict",
    "unknown dtype",
    "huge length",
]


@pytest.mark.parametrize("case", RESIDENT_CASES)
def test_resident_header_refused(case, edge0_qwen, tmp_path):
    model = copy_model(edge0_qwen, tmp_path / "m")
    _resident_case(model, case)
    expect_clear_error(lambda: Engine.load(model), RESIDENT_NAME)


# -- adapters and heads ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "case",
    [
        "alpha 1e30",
        "alpha nan",
        "alpha negative",
        "owners dict",
        "nan values",
        "metadata list",
        "mixed dtypes",
    ],
)
def test_lora_refused(case, engine, tmp_path):
    path = tmp_path / "lora.safetensors"
    meta = {
        "alpha 1e30": {"alpha": "1e30"},
        "alpha nan": {"alpha": "nan"},
        "alpha negative": {"alpha": "-8"},
        "owners dict": {"owners": '{"a": 1}'},
    }
    _lora_file(engine, path, **meta.get(case, {}))
    if case == "nan values":
        arrays = mx.load(str(path))
        key = sorted(arrays)[0]
        arrays[key] = mx.full(arrays[key].shape, float("inf"), dtype=arrays[key].dtype)
        mx.save_safetensors(
            str(path), arrays, metadata={"kind": "lora", "r": "4", "alpha": "8"}
        )
    elif case == "metadata list":
        edit_header(path, lambda h: h.update(__metadata__=[["kind", "lora"]]))
    elif case == "mixed dtypes":
        edit_header(
            path,
            lambda h: h[sorted(k for k in h if k != "__metadata__")[0]].update(
                dtype="BF16"
            ),
        )
    expect_clear_error(_load_lora(engine, path), path)


def test_refused_lora_leaves_the_model_untouched(engine, tmp_path):
    """Every key of an adapter file is read before the model changes: a malformed 'step' (read
    after the layers were swapped, before the file reader was split from the engine) leaves the
    model's LoRA layers as they were."""
    from edge0_eval.engine.lora import lora_modules

    before = {p: id(m) for p, m in lora_modules(engine.model).items()}
    path = _lora_file(engine, tmp_path / "lora.safetensors", step="ten")
    expect_clear_error(_load_lora(engine, path), path)
    assert {p: id(m) for p, m in lora_modules(engine.model).items()} == before


def test_valid_lora_and_heads_load(engine, tmp_path):
    """The fixtures of the two tests around this one are themselves valid."""
    load_adapter(
        engine.model,
        _lora_file(engine, tmp_path / "l.safetensors"),
        experts_per_token=engine.experts_per_token,
    )
    from edge0_eval.engine.lora import remove_lora

    remove_lora(engine.model)
    _load_heads(engine, _heads_file(engine, tmp_path / "h.safetensors"))()


@pytest.mark.parametrize("case", ["nan", "inf", "header list", "metadata list"])
def test_heads_refused(case, engine, tmp_path):
    path = _heads_file(engine, tmp_path / "heads.safetensors")
    if case in ("nan", "inf"):
        arrays, meta = mx.load(str(path), return_metadata=True)
        key = sorted(arrays)[0]
        arrays[key] = mx.full(arrays[key].shape, float(case), dtype=arrays[key].dtype)
        mx.save_safetensors(str(path), arrays, metadata=meta)
    elif case == "header list":
        header, body = read_header(path)
        write_header(path, list(header.items()), body)
    else:
        edit_header(path, lambda h: h.update(__metadata__=["prerouter"]))
    expect_clear_error(_load_heads(engine, path), path)


@pytest.mark.parametrize("kind", ["heads", "lora", "resident"])
@pytest.mark.parametrize(
    "field, value",
    [
        ("dtype", {}),
        ("dtype", ["F16"]),
        ("dtype", 16),
        ("dtype", True),
        ("shape", {}),
        ("shape", [{}]),
        ("shape", [[4]]),
        ("data_offsets", {}),
        ("data_offsets", [0, {}]),
        ("data_offsets", [[0], 4]),
    ],
)
def test_header_field_of_the_wrong_json_type(
    kind, field, value, engine, edge0_qwen, tmp_path
):
    """`"dtype": {}` in a heads file ended in `TypeError: unhashable type`."""
    if kind == "resident":
        model = copy_model(edge0_qwen, tmp_path / "m")
        path, load = model / RESIDENT_NAME, lambda: Engine.load(model).close()
    elif kind == "lora":
        path = _lora_file(engine, tmp_path / "lora.safetensors")
        load = _load_lora(engine, path)
    else:
        path = _heads_file(engine, tmp_path / "heads.safetensors")
        load = _load_heads(engine, path)

    def change(header):
        name = sorted(k for k in header if k != "__metadata__")[0]
        header[name][field] = value

    edit_header(path, change)
    message = expect_clear_error(load, path)
    assert f"{value!r}" in message


def test_heads_of_another_family_refused(edge0_qwen, edge0_bailing, tmp_path):
    bailing = Engine.load(edge0_bailing, EngineOptions(mode="reactive"))
    try:
        heads = _heads_file(bailing, tmp_path / "bailing_heads.safetensors")
    finally:
        bailing.close()
    expect_clear_error(
        lambda: Engine.load(
            edge0_qwen, EngineOptions(mode="prerouted", prerouter_path=str(heads))
        ),
        heads,
    )


# -- tokenizer ------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["missing", "truncated", "template"])
def test_tokenizer_refused(case, edge0_qwen, tmp_path):
    model = copy_model(edge0_qwen, tmp_path / "m")
    if case == "missing":
        (model / "tokenizer.json").unlink()
    elif case == "truncated":
        text = (model / "tokenizer.json").read_text()
        (model / "tokenizer.json").write_text(text[: len(text) // 2])
    else:
        edit_json(
            model / "tokenizer_config.json",
            lambda c: c.update(
                chat_template="{% for m in messages %}{{ m['content'] }"
            ),
        )
    expect_clear_error(lambda: load_tokenizer_checked(model), model)
    if case == "missing":
        expect_clear_error(lambda: check_model_dir(model), model)


# -- expert integrity at the default -------------------------------------------------------


def _decode(model, **options):
    e = Engine.load(model, EngineOptions(mode="reactive", slots_per_layer=4, **options))
    try:
        return e.generate([1, 2, 3, 4], max_tokens=4, stop_token_ids=set()).tokens
    finally:
        e.close()


@pytest.mark.parametrize("case", ["bit flip", "zeroed", "foreign"])
def test_corrupt_experts_fail_at_default(case, edge0_qwen, tmp_path):
    model = copy_model(edge0_qwen, tmp_path / "m")
    path = model / EXPERTS_NAME
    data = bytearray(path.read_bytes())
    index = ExpertIndex.load(model)
    if case == "bit flip":
        for pos in range(
            len(index.moe_layers)
        ):  # one bit in every expert of every layer
            for e in range(index.num_experts):
                layer = index.moe_layers[pos]
                data[index.bundle_offset(layer, e) + 100] ^= 0x10
    elif case == "zeroed":
        data = bytearray(len(data))
    else:  # another conversion's bundles, same size: this file's bundles in another order
        (stride,) = {layout.bundle_stride for layout in index.layouts}
        bundles = [data[i : i + stride] for i in range(0, len(data), stride)]
        data = bytearray(b"".join(bundles[1:] + bundles[:1]))
    path.write_bytes(bytes(data))
    message = expect_clear_error(lambda: _decode(model), "checksum mismatch for layer")
    assert str(path) in message
    assert _decode(model, verify_crc=False)  # an explicit opt-out still serves


def test_overwrite_during_decode_is_caught(edge0_qwen, tmp_path):
    model = copy_model(edge0_qwen, tmp_path / "m")
    e = Engine.load(model, EngineOptions(mode="reactive", slots_per_layer=4))
    try:
        e.generate([1, 2, 3], max_tokens=3)
        size = (model / EXPERTS_NAME).stat().st_size
        with open(model / EXPERTS_NAME, "r+b") as f:  # in place: same inode, same size
            f.write(b"\x5a" * size)
        expect_clear_error(
            lambda: e.generate([5, 6, 7, 8, 9], max_tokens=6, stop_token_ids=set()),
            "changed while the engine was reading it",
        )
    finally:
        e.close()


def test_index_without_crc_refused_unless_opted_out(edge0_qwen, tmp_path):
    model = copy_model(edge0_qwen, tmp_path / "m")
    edit_json(model / INDEX_NAME, lambda d: d.update(crc32=[]))
    message = expect_clear_error(lambda: Engine.load(model), INDEX_NAME)
    assert "--no-verify-crc" in message
    expect_clear_error(lambda: check_model_dir(model), INDEX_NAME)
    assert _decode(model, verify_crc=False)


def test_preflight_stops_a_bad_student(edge0_qwen, tmp_path):
    from model_wrappers.partitioners.partitioner import model_problems

    model = copy_model(edge0_qwen, tmp_path / "m")
    assert (
        model_problems(
            [
                {
                    "abbr": "s",
                    "path": str(model),
                    "type": "Edge0Model",
                    "mode": "reactive",
                    "no_lora": True,
                }
            ]
        )
        == []
    )
    with open(model / EXPERTS_NAME, "ab") as f:
        f.write(b"\0" * 4096)
    problems = model_problems(
        [
            {
                "abbr": "s",
                "path": str(model),
                "type": "Edge0Model",
                "mode": "reactive",
                "no_lora": True,
            }
        ]
    )
    assert len(problems) == 1 and EXPERTS_NAME in problems[0]


@pytest.mark.parametrize("batch", [0, -2, 2.5, "4", True, None])
def test_preflight_refuses_a_bad_batch_size(tmp_path, batch):
    from model_wrappers.partitioners.partitioner import model_problems

    (tmp_path / "config.json").write_text("{}")
    good = model_problems(
        [{"abbr": "t", "path": str(tmp_path), "type": "MLXLMModel", "batch_size": 4}]
    )
    assert good == []
    problems = model_problems(
        [
            {
                "abbr": "t",
                "path": str(tmp_path),
                "type": "MLXLMModel",
                "batch_size": batch,
            }
        ]
    )
    assert len(problems) == 1 and "t: batch_size" in problems[0]


# -- CLI values ------------------------------------------------------------------------------

CLI_CASES = [
    (["generate", "M", "--prompt", "x", "--max-tokens", "0"], "--max-tokens"),
    (["generate", "M", "--prompt", "x", "--max-tokens", "-5"], "--max-tokens"),
    (["generate", "M", "--prompt", "x", "--temp", "-1"], "--temp"),
    (["generate", "M", "--prompt", "x", "--temp", "nan"], "--temp"),
    (["generate", "M", "--prompt", "x", "--top-p", "2"], "--top-p"),
    (["generate", "M", "--prompt", "x", "--top-p", "nan"], "--top-p"),
    (["generate", "M", "--prompt", "x", "--io-workers", "0"], "--io-workers"),
    (
        ["generate", "M", "--prompt", "x", "--io-throttle-mbps", "nan"],
        "--io-throttle-mbps",
    ),
    (
        ["generate", "M", "--prompt", "x", "--expert-budget-mib", "nan"],
        "--expert-budget-mib",
    ),
    (["generate", "M", "--prompt", "x", "--seed", "-1"], "--seed"),
    (["generate", "M", "--prompt", "x", "--json", "/nonexistent-dir/x.json"], "--json"),
    (["bench", "M", "--raw-reads", "-1"], "--raw-reads"),
    (["bench", "M", "--tokens", "0"], "--tokens"),
    (["bench", "M", "--repeats", "0"], "--repeats"),
    (["bench", "M", "--arms", ""], "--arms"),
    (["gate", "R", "--baseline", "B", "--max-drop", "nan"], "--max-drop"),
    (
        ["gate", "R", "--baseline", "B", "--max-gap-increase", "inf"],
        "--max-gap-increase",
    ),
    (["data", "verify", "--benchmarks", ","], "--benchmarks"),
]


@pytest.mark.parametrize(
    "argv,option",
    CLI_CASES,
    ids=[" ".join(a[2:] if a[0] != "data" else a) for a, _ in CLI_CASES],
)
def test_cli_value_refused_at_parse_time(argv, option, capsys):
    expect_clear_error(lambda: main(argv), option, capsys=capsys)


def test_cli_root_naming_a_file(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    expect_clear_error(
        lambda: main(["data", "verify", "--root", str(f)]), "--root", capsys=capsys
    )
    expect_clear_error(
        lambda: main(["report", str(tmp_path), "--out", str(f)]), "--out", capsys=capsys
    )


def test_cli_bad_model_exits_2_without_traceback(edge0_qwen, tmp_path, capsys):
    model = copy_model(edge0_qwen, tmp_path / "m")
    edit_json(model / INDEX_NAME, lambda d: d.update(bits=0))
    assert main(["generate", str(model), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and INDEX_NAME in err


# -- gate and report ------------------------------------------------------------------------


def _row(**kw):
    row = {
        "benchmark": "GPQA-Diamond",
        "status": "ok",
        "items": 100,
        "version": "abc",
        "teacher": 80.0,
        "student": 78.0,
        "gap": 2.0,
        "delta_half_width": 3.0,
        "arms": {"teacher": {"status": "ok"}, "student": {"status": "ok"}},
    }
    row.update(kw)
    return row


def _report(path: Path, rows, raw: str | None = None) -> Path:
    from edge0_eval.evaluation.report.gap import SCHEMA

    # Every arm the gate judges carries its settings (it refuses arms without).
    settings = {"generation": {"max_out_len": 1}, "scoring": {}, "model": {}}
    arms = {a: {"settings": settings} for a in ("teacher", "student")}
    text = (
        raw
        if raw is not None
        else json.dumps({"schema": SCHEMA, "benchmarks": rows, "arms": arms})
    )
    path.write_text(text)
    return path


GATE_CASES = {
    "nan gap": lambda p: _report(
        p,
        None,
        json.dumps(
            {"schema": "edge0-eval/report/v1", "benchmarks": [_row(gap=float("nan"))]}
        ),
    ),
    "nan student": lambda p: _report(
        p,
        None,
        json.dumps(
            {
                "schema": "edge0-eval/report/v1",
                "benchmarks": [_row(student=float("nan"))],
            }
        ),
    ),
    "inf half width": lambda p: _report(
        p,
        None,
        json.dumps(
            {
                "schema": "edge0-eval/report/v1",
                "benchmarks": [_row(delta_half_width=float("inf"))],
            }
        ),
    ),
    "string score": lambda p: _report(p, [_row(student="78")]),
    "null score": lambda p: _report(p, [_row(gap=None)]),
    "no student arm": lambda p: _report(p, [_row(arms={"teacher": {"status": "ok"}})]),
    "missing keys": lambda p: _report(p, [{"benchmark": "GPQA-Diamond"}]),
    "empty": lambda p: _report(p, []),
    "wrong type": lambda p: _report(p, None, "[1, 2]"),
    "duplicate rows": lambda p: _report(p, [_row(), _row()]),
}


@pytest.mark.parametrize("case", sorted(GATE_CASES))
@pytest.mark.parametrize("side", ["report", "baseline"])
def test_gate_refuses(case, side, tmp_path):
    good = _report(tmp_path / "good.json", [_row()])
    bad = GATE_CASES[case](tmp_path / "bad.json")
    current, baseline = (bad, good) if side == "report" else (good, bad)
    assert main(["gate", str(current), "--baseline", str(baseline)]) != 0
    expect_clear_error(lambda: load_report(str(bad)), bad)


def test_gate_passes_good_report(tmp_path):
    good = _report(tmp_path / "good.json", [_row()])
    assert main(["gate", str(good), "--baseline", str(good)]) == 0


def _oc_run(root: Path, stats: list | None = None, preds_text: str | None = None):
    from oc_tree import OCRun

    run = OCRun(root)
    run.add("qwen-teacher", "GPQA_diamond", [1, 0, 1, 1])
    run.add("edge0-student", "GPQA_diamond", [1, 0, 0, 1])
    out = run.finish()
    pred_dir = out / "predictions" / "edge0-student"
    pred_dir.mkdir(parents=True, exist_ok=True)
    if preds_text is not None:
        (pred_dir / "GPQA_diamond.json").write_text(preds_text)
    elif not (pred_dir / "GPQA_diamond.json").exists():
        (pred_dir / "GPQA_diamond.json").write_text(
            json.dumps({str(i): {"prediction": "A"} for i in range(4)})
        )
    if stats is not None:
        (pred_dir / "GPQA_diamond.engine_stats.json").write_text(json.dumps(stats))
    return out


def test_report_refuses_resumed_engine_stats(tmp_path, capsys):
    # a SIGKILL after 2 of 4 samples, then `-r`: only the 2 new samples have stats
    run = _oc_run(
        tmp_path / "oc", stats=[{"index": 2, "tokens": 5}, {"index": 3, "tokens": 5}]
    )
    assert main(["report", str(run), "--out", str(tmp_path / "rep")]) == 1
    report = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert report["benchmarks"][0]["status"] == "inconsistent"
    assert "engine stats cover 2 of 4" in json.dumps(report["notes"])


def test_report_complete_engine_stats_ok(tmp_path):
    run = _oc_run(tmp_path / "oc", stats=[{"index": i, "tokens": 5} for i in range(4)])
    assert main(["report", str(run), "--out", str(tmp_path / "rep")]) == 0


@pytest.mark.parametrize(
    "case",
    ["stats not a list", "stats invalid json", "preds a list", "preds invalid json"],
)
def test_report_refuses_invalid_output_files(case, tmp_path, capsys):
    stats = {"stats not a list": {"index": 0}}.get(case)
    preds = {"preds a list": "[1, 2]", "preds invalid json": '{"0": '}.get(case)
    run = _oc_run(tmp_path / "oc", stats=stats, preds_text=preds)
    if case == "stats invalid json":
        (
            run / "predictions" / "edge0-student" / "GPQA_diamond.engine_stats.json"
        ).write_text("[{")
    assert main(["report", str(run), "--out", str(tmp_path / "rep")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "GPQA_diamond" in err


@pytest.mark.parametrize(
    "arms",
    [
        "teacher=qwen-teacher,student=qwen-teacher",
        "teacher=qwen-teacher,student=edge0-student,int4_exact=edge0-student",
    ],
)
def test_report_refuses_one_model_twice(arms, tmp_path, capsys):
    run = _oc_run(tmp_path / "oc")
    assert (
        main(["report", str(run), "--out", str(tmp_path / "rep"), "--arms", arms]) == 2
    )
    assert "--arms" in capsys.readouterr().err


def test_report_missing_results_exit_nonzero(tmp_path):
    run = _oc_run(tmp_path / "oc")
    shutil.rmtree(run / "results" / "edge0-student")
    assert main(["report", str(run), "--out", str(tmp_path / "rep")]) == 1


# -- data files ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    from edge0_eval.evaluation.data.fixtures import write_fixtures

    root = tmp_path_factory.mktemp("data")
    write_fixtures(root)
    return root


def _data_case(root: Path, case: str) -> str:
    from edge0_eval.evaluation.data.checks import verify
    from edge0_eval.evaluation.data_paths import PATHS

    new = root.parent / f"{root.name}-{case.replace(' ', '_')}"
    shutil.copytree(root, new)
    bench = {
        "jsonl list": "aime2026",
        "aime null": "aime2026",
        "aime duplicates": "aime2026",
        "mmlu Z": "mmlu_pro",
        "mmlu null category": "mmlu_pro",
        "gpqa 5 columns": "gpqa",
    }[case]
    path = new / PATHS[bench]
    if bench == "aime2026":
        rows = [json.loads(l) for l in path.read_text().splitlines() if l.strip()]
        if case == "jsonl list":
            text = "\n".join(
                [json.dumps(rows[0]), "[1, 2]"] + [json.dumps(r) for r in rows[1:]]
            )
        elif case == "aime null":
            rows[0]["answer"] = None
            text = "\n".join(json.dumps(r) for r in rows)
        else:
            text = "\n".join(json.dumps(rows[0]) for _ in range(30))
        path.write_text(text + "\n")
    elif bench == "gpqa":
        lines = path.read_text().splitlines()
        lines.append("a,b,c,d,e")
        path.write_text("\n".join(lines) + "\n")
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        test_file = next(p for p in sorted(path.rglob("*.parquet")) if "test" in p.name)
        table = pq.read_table(test_file)
        col = "answer" if case == "mmlu Z" else "category"
        values = table.column(col).to_pylist()
        values[0] = "Z" if case == "mmlu Z" else None
        table = table.set_column(
            table.column_names.index(col),
            col,
            pa.array(values, type=table.schema.field(col).type),
        )
        pq.write_table(table, test_file)
    checks = verify(new, [bench], full=False)
    assert len(checks) == 1 and not checks[0].ok, (
        f"{case}: accepted: {checks[0].message}"
    )
    return checks[0].message


@pytest.mark.parametrize(
    "case",
    [
        "jsonl list",
        "aime null",
        "aime duplicates",
        "mmlu Z",
        "mmlu null category",
        "gpqa 5 columns",
    ],
)
def test_data_files_refused(case, data_root):
    message = _data_case(data_root, case)
    assert str(data_root.parent) in message


# -- seeded fuzz ----------------------------------------------------------------------------


def _tally(results: list[tuple[str, str, str]]):
    bad = [r for r in results if r[1] != "error"]
    assert not bad, (
        f"{len(bad)} of {len(results)} mutations not refused cleanly: {bad[:8]}"
    )


def _fuzz_index(model: Path, rng, n: int) -> list[tuple[str, str, str]]:
    """n seeded mutations of the model's index, each run through the full check; the index is
    restored afterwards."""
    original = (model / INDEX_NAME).read_text()
    results = []
    for _ in range(n):
        data = json.loads(original)
        what = mutate_index(rng, data)
        (model / INDEX_NAME).write_text(json.dumps(data))
        kind, message = outcome(_full_check(model))
        if (
            kind == "error"
            and INDEX_NAME not in message
            and EXPERTS_NAME not in message
            and RESIDENT_NAME not in message
        ):
            kind = "unnamed"
        results.append((what, kind, message[:160]))
    (model / INDEX_NAME).write_text(original)
    return results


def test_fuzz_index(edge0_qwen, tmp_path):
    model = copy_model(edge0_qwen, tmp_path / "m")
    results = _fuzz_index(model, random.Random(FUZZ_SEED), 150)
    _full_check(model)()  # the untouched copy passes the same oracle
    _tally(results)


def _fuzz_headers(rng, path: Path, load, n: int, names) -> list:
    original = path.read_bytes()
    results = []
    for _ in range(n):
        path.write_bytes(original)
        header, body = read_header(path)
        header, raw, body, what = mutate_header(rng, header, body)
        write_mutated(rng, path, header, raw, body, what)
        kind, message = outcome(load)
        if kind == "error" and not any(str(x) in message for x in names):
            kind = "unnamed"
        results.append((what, kind, message[:160]))
    path.write_bytes(original)
    load()  # the restored file loads
    return results


def test_fuzz_resident_header(edge0_qwen, tmp_path):
    from edge0_eval.formats.model_dir import check_resident

    rng = random.Random(FUZZ_SEED + 1)
    model = copy_model(edge0_qwen, tmp_path / "m")
    index = ExpertIndex.load(model)
    path = model / RESIDENT_NAME

    def load():
        check_resident(path, index)
        # A header the format accepts must still match the model: the engine's own load.
        Engine.load(model).close()

    _tally(_fuzz_headers(rng, path, load, 60, [path]))


def test_fuzz_lora_and_heads_headers(engine, tmp_path):
    rng = random.Random(FUZZ_SEED + 2)
    lora = _lora_file(engine, tmp_path / "lora.safetensors")
    heads = _heads_file(engine, tmp_path / "heads.safetensors")

    def load_lora():
        load_adapter(engine.model, lora, experts_per_token=engine.experts_per_token)

    results = _fuzz_headers(rng, lora, load_lora, 60, [lora])
    from edge0_eval.engine.lora import remove_lora

    remove_lora(engine.model)
    results += _fuzz_headers(rng, heads, _load_heads(engine, heads), 60, [heads])
    _tally(results)


def test_fuzz_oracle_sees_an_injected_fault(edge0_qwen, tmp_path, monkeypatch):
    """With the index's consistency checks disabled, the same fuzz finds accepted corruptions
    or tracebacks: the suite can fail."""
    monkeypatch.setattr(ExpertIndex, "validate", lambda self, directory=None: None)
    monkeypatch.setattr(
        "edge0_eval.formats.model_dir.check_index_model", lambda *a, **k: None
    )
    model = copy_model(edge0_qwen, tmp_path / "m")
    kinds = [kind for _, kind, _ in _fuzz_index(model, random.Random(FUZZ_SEED), 40)]
    assert set(kinds) - {"error"}, kinds


@pytest.mark.parametrize(
    "kw",
    [{"io_workers": 0}, {"io_throttle_mbps": float("nan")}, {"io_throttle_mbps": -1.0}],
)
def test_store_options_refused(kw, edge0_qwen):
    expect_clear_error(lambda: ExpertStore(edge0_qwen, **kw), next(iter(kw)))


@pytest.mark.parametrize(
    "field,value",
    [
        ("expert_budget_mib", float("nan")),
        ("io_throttle_mbps", float("inf")),
        ("io_workers", 0),
        ("seed", -1),
        ("experts_per_token", 2.5),
        ("slots_per_layer", True),
        ("clip_hidden", float("nan")),
        ("prefill_chunk", 0),
    ],
)
def test_engine_options_from_a_config_refuse_bad_values(field, value):
    """A model config reaches EngineOptions without the CLI's parse-time checks."""
    with pytest.raises(ConfigError, match=field):
        EngineOptions(**{field: value}).validate()
