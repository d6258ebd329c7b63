"""`edge0-eval report` on hand-built OpenCompass trees; every expected number worked by hand."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
from oc_tree import OCRun, infer_cfg, prompt_version
from scipy import stats

from edge0_eval.cli import main
from edge0_eval.evaluation.outputs.details import item_correctness

REPO = Path(__file__).resolve().parents[1]
T, S = "qwen-teacher-fp16", "edge0-student"
Q, P = "edge0-int4-exact", "edge0-prerouted-nolora"
ARMS_2 = f"teacher={T},student={S}"
ARMS_4 = f"teacher={T},student={S},int4_exact={Q},prerouted_nolora={P}"

# Per-item correctness. Hand-worked results (points, delta = student - teacher):
#   AIME 2026    T 75  S 50   diffs 0,-100,0,0       mean -25  sd 50          se 25
#   HumanEval    T 80  S 60   diffs 0,0,0,-100,0     mean -20  sd sqrt(2000)  se 20
#   GPQA-Diamond T 50  S 50   diffs 0,0,-100,100     mean 0    var 20000/3    se^2 20000/12
#   MMLU-Pro     T 75  S 50   pooled over math (3) + law (1); same diffs as AIME
#                category means: T (200/3 + 100)/2, S (100/3 + 100)/2
#   IFBench      strict T 50 S 25 (diffs as AIME), loose T 75 S 50
#   average      T 330/5 = 66, S 235/5 = 47, delta -19
TEACHER = {
    "aime2026": [1, 1, 1, 0],
    "openai_humaneval": [1, 1, 1, 1, 0],
    "GPQA_diamond": [1, 0, 1, 0],
    "mmlu_pro_math": [1, 1, 0],
    "mmlu_pro_law": [1],
    "IFBench": [1, 1, 0, 0],
}
STUDENT = {
    "aime2026": [1, 0, 1, 0],
    "openai_humaneval": [1, 1, 1, 0, 0],
    "GPQA_diamond": [1, 0, 0, 1],
    "mmlu_pro_math": [1, 0, 0],
    "mmlu_pro_law": [1],
    "IFBench": [1, 0, 0, 0],
}
LOOSE = {T: [1, 1, 1, 0], S: [1, 1, 0, 0], Q: [1, 1, 0, 0], P: [1, 0, 0, 0]}
# Ablations, chosen so each term is easy to check:
#   AIME      Q 50 P 25  -> quantization 25, routing 25, recovery 25, total 25
#   HumanEval Q 80 P 40  -> 0, 40, 20, 20
#   GPQA      Q 75 P 25  -> -25, 50, 25, 0
#   MMLU-Pro  Q 50 P 25  -> 25, 25, 25, 25
#   IFBench   Q 50 P 0   -> 0, 50, 25, 25
INT4 = {
    "aime2026": [1, 1, 0, 0],
    "openai_humaneval": [1, 1, 1, 1, 0],
    "GPQA_diamond": [1, 0, 1, 1],
    "mmlu_pro_math": [1, 1, 0],
    "mmlu_pro_law": [0],
    "IFBench": [1, 1, 0, 0],
}
PRE = {
    "aime2026": [1, 0, 0, 0],
    "openai_humaneval": [1, 1, 0, 0, 0],
    "GPQA_diamond": [0, 0, 0, 1],
    "mmlu_pro_math": [0, 0, 0],
    "mmlu_pro_law": [1],
    "IFBench": [0, 0, 0, 0],
}


def t95(items: int) -> float:
    """The interval's quantile: Student's t with items - 1 degrees of freedom."""
    return float(stats.t.ppf(0.975, items - 1))


SE = {  # the paired standard errors, by hand
    "AIME 2026": 25.0,
    "HumanEval": 20.0,
    "GPQA-Diamond": math.sqrt(20000 / 12),
    "MMLU-Pro": 25.0,
    "IFBench": 25.0,
}
ITEMS = {"AIME 2026": 4, "HumanEval": 5, "GPQA-Diamond": 4, "MMLU-Pro": 4, "IFBench": 4}
HW = {name: t95(ITEMS[name]) * se for name, se in SE.items()}
# Items whose outcome rose / fell, student against teacher, by hand from the tables above.
MOVES = {
    "AIME 2026": (0, 1),
    "HumanEval": (0, 1),
    "GPQA-Diamond": (1, 1),
    "MMLU-Pro": (0, 1),
    "IFBench": (0, 1),
}


def exact_ci(name: str) -> list[float]:
    """0/1 items, fewer than 50: the exact interval, each share's Clopper-Pearson bounds at
    97.5% (a union bound), in points."""
    n, (up, down) = ITEMS[name], MOVES[name]

    def bounds(k):
        low = stats.beta.ppf(0.0125, k, n - k + 1) if k else 0.0
        return low, stats.beta.ppf(0.9875, k + 1, n - k) if k < n else 1.0

    (ul, uh), (dl, dh) = bounds(up), bounds(down)
    return [100 * (ul - dh), 100 * (uh - dl)]


EXPECTED = {  # benchmark: (items, teacher, student)
    "AIME 2026": (4, 75.0, 50.0),
    "HumanEval": (5, 80.0, 60.0),
    "GPQA-Diamond": (4, 50.0, 50.0),
    "MMLU-Pro": (4, 75.0, 50.0),
    "IFBench": (4, 50.0, 25.0),
}
ORDER = list(EXPECTED)


def add_model(run: OCRun, model: str, table: dict, skip=(), **per_dataset):
    for ds, correct in table.items():
        if ds in skip:
            continue
        kw = dict(per_dataset.get(ds, {}))
        if ds == "IFBench":
            kw.setdefault("loose", LOOSE[model])
        run.add(model, ds, correct, **kw)


def standard_run(root: Path, ablations: bool = False, **student_kw) -> Path:
    run = OCRun(root / "outputs" / "default")
    add_model(run, T, TEACHER)
    # the student's AIME verdicts come from the LLM judge (CascadeEvaluator's cascade_correct)
    student_kw.setdefault("aime2026", {"judge": True})
    add_model(run, S, STUDENT, **student_kw)
    if ablations:
        add_model(run, Q, INT4)
        add_model(run, P, PRE)
    return run.finish()


def make_report(tmp_path: Path, *outputs, args=(), name="rep") -> dict:
    out = tmp_path / name
    rc = main(["report", *map(str, outputs), "--out", str(out), *args])
    report = json.loads((out / "report.json").read_text())
    # A report with any benchmark not ok (missing, failed, ...) exits 1: it must fail loudly.
    complete = bool(report["benchmarks"]) and all(
        r["status"] == "ok" for r in report["benchmarks"]
    )
    assert rc == (0 if complete else 1)
    return report


def rows(report: dict) -> dict:
    return {r["benchmark"]: r for r in report["benchmarks"]}


def test_teacher_student_numbers(tmp_path):
    run_dir = standard_run(tmp_path)
    # default arms: two models, one named *teacher*; the work_dir stands for its latest run
    rep = make_report(tmp_path, run_dir.parent)
    assert rep["schema"] == "edge0-eval/report/v2"
    assert rep["arms"]["teacher"]["abbr"] == T and rep["arms"]["student"]["abbr"] == S
    assert [r["benchmark"] for r in rep["benchmarks"]] == ORDER
    version = prompt_version(infer_cfg("{question}"))
    for name, (items, t, s) in EXPECTED.items():
        r = rows(rep)[name]
        assert r["status"] == "ok"
        assert r["items"] == items
        assert r["version"] == version
        assert r["teacher"] == pytest.approx(t, abs=1e-12)
        assert r["student"] == pytest.approx(s, abs=1e-12)
        assert r["delta"] == pytest.approx(s - t, abs=1e-12)
        assert r["gap"] == pytest.approx(t - s, abs=1e-12)
        lo, hi = exact_ci(name)
        assert r["delta_ci95"] == pytest.approx([lo, hi], rel=1e-9)
        assert lo < s - t < hi and hi - lo > 2 * HW[name] * 0.5
        assert r["delta_half_width"] == pytest.approx(
            max(s - t - lo, hi - (s - t)), rel=1e-9
        )
        assert r["delta_se"] == pytest.approx(SE[name], rel=1e-12)
        assert r["decomposition"] is None

    mmlu = rows(rep)["MMLU-Pro"]
    assert mmlu["datasets"] == ["mmlu_pro_law", "mmlu_pro_math"]
    assert mmlu["arms"]["teacher"]["category_mean"] == pytest.approx(
        (200 / 3 + 100) / 2
    )
    assert mmlu["arms"]["student"]["category_mean"] == pytest.approx(
        (100 / 3 + 100) / 2
    )
    ifb = rows(rep)["IFBench"]
    assert ifb["metric"] == "Prompt-level-strict-accuracy"
    assert ifb["arms"]["teacher"]["extra"] == {"Prompt-level-loose-accuracy": 75.0}
    assert ifb["arms"]["student"]["extra"] == {"Prompt-level-loose-accuracy": 50.0}

    avg = rep["average"]
    assert avg["complete"] is True and rep["status"] == "ok"
    assert avg["teacher"] == pytest.approx(66.0) and avg["student"] == pytest.approx(
        47.0
    )
    assert avg["delta"] == pytest.approx(-19.0) and avg["gap"] == pytest.approx(19.0)
    var = sum(se**2 for se in SE.values())
    df = var**2 / sum(SE[b] ** 4 / (ITEMS[b] - 1) for b in SE)  # Welch-Satterthwaite
    avg_hw = float(stats.t.ppf(0.975, df)) * math.sqrt(var) / 5
    assert avg["delta_half_width"] == pytest.approx(avg_hw, rel=1e-12)
    assert rep["engine"] == {"teacher": None, "student": None}

    out = tmp_path / "rep"
    with (out / "report.csv").open() as f:
        table = {r["benchmark"]: r for r in csv.DictReader(f)}
    assert list(table) == ORDER + ["average"]
    assert float(table["HumanEval"]["delta"]) == -20.0
    # full precision
    gpqa = rows(rep)["GPQA-Diamond"]
    assert float(table["GPQA-Diamond"]["half_width"]) == gpqa["delta_half_width"]
    assert float(table["average"]["student"]) == 47.0
    md = (out / "report.md").read_text()
    assert f"edge0-eval report {run_dir.parent} --out {out}" in md
    assert rep["created"][:10] in md
    assert (
        "| HumanEval | pass@1, n=1 | 5 | 80.00 | 60.00 | -20.00 | [-76.44, +58.12] | ok |"
        in md
    )
    assert "| teacher | qwen-teacher-fp16 | n/a |" in md
    assert (out / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_ablation_decomposition(tmp_path):
    run_dir = standard_run(tmp_path, ablations=True)
    rep = make_report(tmp_path, run_dir, args=["--arms", ARMS_4])
    expected = {
        "AIME 2026": (50, 25, 25, 25, 25),
        "HumanEval": (80, 40, 0, 40, 20),
        "GPQA-Diamond": (75, 25, -25, 50, 25),
        "MMLU-Pro": (50, 25, 25, 25, 25),
        "IFBench": (50, 0, 0, 50, 25),
    }
    for name, (q, p, quant, routing, recovery) in expected.items():
        d = rows(rep)[name]["decomposition"]
        _, t, s = EXPECTED[name]
        assert d["int4_exact"] == pytest.approx(q) and d[
            "prerouted_nolora"
        ] == pytest.approx(p)
        assert d["quantization_loss"] == pytest.approx(quant)
        assert d["routing_loss"] == pytest.approx(routing)
        assert d["lora_recovery"] == pytest.approx(recovery)
        assert d["total_gap"] == pytest.approx(t - s)
        assert quant + routing - recovery == pytest.approx(t - s)
    avg = rep["average"]["decomposition"]
    assert avg["quantization_loss"] == pytest.approx(5.0)  # (25+0-25+25+0)/5
    assert avg["routing_loss"] == pytest.approx(38.0)  # (25+40+50+25+50)/5
    assert avg["lora_recovery"] == pytest.approx(24.0)  # (25+20+25+25+25)/5
    assert avg["total_gap"] == pytest.approx(19.0)
    # the ablations do not change the teacher-vs-student numbers
    assert rows(rep)["HumanEval"]["delta"] == pytest.approx(-20.0)
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "## Gap decomposition" in md
    assert (
        "| average | 66.00 | 61.00 | 23.00 | 47.00 | +5.00 | +38.00 | +24.00 | +19.00 |"
        in md
    )
    assert (
        "| GPQA-Diamond | 50.00 | 75.00 | 25.00 | 50.00 | -25.00 | +50.00 | +25.00 | +0.00 |"
        in md
    )


def test_failed_task_and_item_mismatch(tmp_path):
    # student's AIME task never wrote results (summary '-'); its IFBench results hold an
    # error; its HumanEval covers 4 of the 5 items
    run_dir = standard_run(
        tmp_path, aime2026={"failed": "missing"}, IFBench={"failed": "error"}
    )
    summary = next((run_dir / "summary").glob("*.csv")).read_text()
    assert "aime2026," in summary and ",75.00,-" in summary
    rep = make_report(tmp_path, run_dir)
    r = rows(rep)
    assert r["AIME 2026"]["status"] == "failed"
    assert r["AIME 2026"]["arms"]["student"]["status"] == "failed"
    assert r["AIME 2026"]["items"] is None and r["AIME 2026"]["delta_ci95"] is None
    assert r["AIME 2026"]["teacher"] == pytest.approx(75.0)
    assert r["AIME 2026"]["student"] is None
    assert r["IFBench"]["status"] == "failed"
    assert any("summary shows '-'" in n for n in rep["notes"])
    assert any("error: preds and refrs" in n for n in rep["notes"])
    assert rep["status"] == "incomplete"
    avg = rep["average"]
    assert avg["complete"] is False
    assert avg["benchmarks"] == ["HumanEval", "GPQA-Diamond", "MMLU-Pro"]
    assert avg["teacher"] == pytest.approx((80 + 50 + 75) / 3)
    assert avg["student"] == pytest.approx((60 + 50 + 50) / 3)

    run2 = OCRun(tmp_path / "o2")
    run2.add(T, "openai_humaneval", [1, 1, 1, 1, 0])
    run2.add(S, "openai_humaneval", [1, 1, 1, 0])
    rep2 = make_report(tmp_path, run2.finish(), name="rep2")
    he = rows(rep2)["HumanEval"]
    assert he["status"] == "items_mismatch"
    assert he["arms"]["teacher"]["items"] == 5 and he["arms"]["student"]["items"] == 4
    assert he["delta_ci95"] is None and he["items"] is None
    assert he["notes"] == ["item ids differ (teacher 5 items, student 4); not paired"]


def test_every_model_failed_on_a_dataset(tmp_path):
    run = OCRun(tmp_path / "o")
    run.add(T, "GPQA_diamond", [1, 0], failed="missing")
    run.add(S, "GPQA_diamond", [1, 0], failed="missing")
    run.add(T, "aime2026", [1, 0])
    run.add(S, "aime2026", [1, 1])
    run_dir = run.finish(config=False)  # the summary row is all '-': still a dataset
    rep = make_report(tmp_path, run_dir)
    assert rows(rep)["GPQA-Diamond"]["status"] == "failed"
    assert rows(rep)["AIME 2026"]["delta"] == pytest.approx(50.0)


def test_mismatched_prompt_versions_refused(tmp_path, capsys):
    # teacher scored in another run, with a different GPQA prompt
    run_t = OCRun(tmp_path / "teacher_out")
    run_s = OCRun(tmp_path / "student_out")
    for ds in ("aime2026", "GPQA_diamond"):
        prompt = "Q: {question}" if ds == "GPQA_diamond" else "{question}"
        run_t.add(T, ds, TEACHER[ds], prompt=prompt)
        run_s.add(S, ds, STUDENT[ds])
    rc = main(
        [
            "report",
            str(run_t.finish()),
            str(run_s.finish()),
            "--out",
            str(tmp_path / "r"),
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2
    assert "GPQA-Diamond" in err and T in err and S in err
    assert prompt_version(infer_cfg("Q: {question}")) in err
    assert prompt_version(infer_cfg("{question}")) in err
    assert "AIME" not in err
    assert not (tmp_path / "r").exists()


def test_teacher_in_another_run_version_from_config(tmp_path):
    # The teacher's run crashed before summarizing: no summary csv, so its prompt versions
    # come from the dumped config through opencompass's own get_prompt_hash.
    run_t = OCRun(tmp_path / "teacher_out", ts="20260201_080000")
    run_s = OCRun(tmp_path / "student_out")
    for ds, correct in TEACHER.items():
        run_t.add(T, ds, correct, **({"loose": LOOSE[T]} if ds == "IFBench" else {}))
    add_model(run_s, S, STUDENT)
    t_dir = run_t.finish(summary=False)
    rep = make_report(tmp_path, t_dir, run_s.finish(), args=["--arms", ARMS_2])
    version = prompt_version(infer_cfg("{question}"))
    for name, (items, t, s) in EXPECTED.items():
        r = rows(rep)[name]
        assert r["status"] == "ok" and r["items"] == items
        assert (
            r["arms"]["teacher"]["version"]
            == version
            == r["arms"]["student"]["version"]
        )
        assert (r["teacher"], r["student"]) == pytest.approx((t, s))
    assert rep["arms"]["teacher"]["run"] == str(t_dir.resolve())


def test_missing_arm_and_unknown_dataset(tmp_path):
    run = OCRun(tmp_path / "o")
    run.add(T, "aime2026", [1, 0])
    run.add(S, "aime2026", [0, 0])
    run.add(T, "IFBench", [1, 0], loose=[1, 1])
    run.add(T, "my_custom_set", [1, 1, 0])
    run.add(S, "my_custom_set", [1, 0, 0])
    run_dir = run.finish(summary=False, config=False)  # results/predictions only
    rep = make_report(tmp_path, run_dir)
    r = rows(rep)
    assert list(r) == ["AIME 2026", "IFBench", "my_custom_set"]
    assert r["IFBench"]["status"] == "failed"  # in the run, no student results
    assert r["my_custom_set"]["status"] == "ok"
    assert r["my_custom_set"]["metric"] == "accuracy"  # picked as the summarizer would
    assert r["my_custom_set"]["delta"] == pytest.approx(-100 / 3)

    # a benchmark the student's run never included is a missing arm
    run_t = OCRun(tmp_path / "t")
    run_t.add(T, "aime2026", [1, 0])
    run_t.add(T, "IFBench", [1, 0], loose=[1, 1])
    run_s = OCRun(tmp_path / "s")
    run_s.add(S, "aime2026", [1, 1])
    rep = make_report(
        tmp_path, run_t.finish(), run_s.finish(), args=["--arms", ARMS_2], name="r2"
    )
    assert rows(rep)["IFBench"]["status"] == "missing_arm"
    assert rows(rep)["IFBench"]["arms"]["student"]["status"] == "missing"


def test_details_must_reproduce_metric(tmp_path):
    run = OCRun(tmp_path / "o")
    run.add(T, "GPQA_diamond", [1, 1, 0, 0])
    run.add(S, "GPQA_diamond", [1, 0, 0, 0], reported=50.0)  # details say 25
    run.add(T, "aime2026", [1, 0])
    run.add(S, "aime2026", [1, 0], details=False)  # --dump-eval-details False
    rep = make_report(tmp_path, run.finish())
    gpqa = rows(rep)["GPQA-Diamond"]
    assert gpqa["status"] == "inconsistent" and gpqa["delta_ci95"] is None
    assert any("does not reproduce accuracy 50.0" in n for n in rep["notes"])
    aime = rows(rep)["AIME 2026"]
    assert aime["status"] == "no_details"
    assert aime["student"] == pytest.approx(50.0)  # the reported metric, unpaired


def test_engine_stats(tmp_path):
    # per-item stats on AIME predictions; a side file for HumanEval; GPQA in 2 shards
    per_item = [
        {
            "decode_tok_s": d,
            "prefill_tok_s": 100.0,
            "peak_memory_gib": m,
            "tokens": 100,
            "cache": c,
        }
        for d, m, c in [
            (10.0, 2.0, "cold"),
            (20.0, 2.5, "warm"),
            (30.0, 2.9, "warm"),
            (40.0, 2.4, "warm"),
        ]
    ]
    # HumanEval ran in batches of 4: each row carries its batch's aggregate rate
    side = [
        {
            "decode_tok_s": 50.0,
            "prefill_tok_s": 200.0,
            "peak_memory_gib": 3.1,
            "tokens": 10,
            "cache": "warm",
            "batch_size": 4,
            "batch_decode_tok_s": b,
        }
        for b in (180.0, 180.0, 180.0, 180.0, 60.0)
    ]
    shard_stats = [
        {"decode_tok_s": 5.0, "peak_memory_gib": 1.0, "tokens": 1, "cache": "cold"}
    ] * 4
    run_dir = standard_run(
        tmp_path,
        aime2026={"engine": per_item},
        openai_humaneval={"engine_file": side},
        GPQA_diamond={"engine": shard_stats, "shards": 2},
    )
    assert (run_dir / "predictions" / S / "GPQA_diamond_1.json").exists()
    rep = make_report(tmp_path, run_dir)
    eng = rep["engine"]["student"]
    assert rep["engine"]["teacher"] is None
    assert eng["samples"] == 13
    assert eng["decode_tok_s"] == pytest.approx((100 + 250 + 20) / 13)
    assert eng["prefill_tok_s"] == pytest.approx((400 + 1000) / 9)  # GPQA has none
    assert eng["peak_memory_gib"] == pytest.approx(3.1)
    assert eng["tokens"] == 400 + 50 + 4
    assert eng["cache"] == {"cold": 5, "warm": 8}
    assert eng["batch_size"] == 4
    assert eng["batch_decode_tok_s"] == pytest.approx((4 * 180 + 60) / 5)
    aime = rows(rep)["AIME 2026"]["arms"]["student"]["engine"]
    assert (
        aime["decode_tok_s"] == pytest.approx(25.0) and aime["peak_memory_gib"] == 2.9
    )
    assert rows(rep)["GPQA-Diamond"]["status"] == "ok"  # shards pair with the details
    md = (tmp_path / "rep" / "report.md").read_text()
    assert (
        "| student | edge0-student | 13 | 28.46 | 4 | 156.00 | 155.56 | 3.10 | 454 | cold 5, warm 8 |"
        in md
    )


def test_reference_columns_only_beside_the_same_definition(tmp_path):
    """The published numbers stand beside a headline only when they measure the same thing
    (metric and samples per item); otherwise the row says why they are left out."""
    ref = REPO / "reports" / "reference" / "edge0_35b.json"
    rep = make_report(tmp_path, standard_run(tmp_path), args=["--reference", str(ref)])
    shown = {"HumanEval": (95.1, 90.9), "GPQA-Diamond": (81.8, 79.8)}
    for name, (t, s) in shown.items():
        assert rows(rep)[name]["reference"] == {
            "teacher": t,
            "student": s,
            "delta": round(s - t, 10),
        }
        assert rows(rep)[name]["reference_omitted"] is None
    why = {
        name: rows(rep)[name]["reference_omitted"]
        for name in ORDER
        if name not in shown
    }
    assert rows(rep)["AIME 2026"]["reference"] is None
    assert "several samples per item, this run 1 per item" in why["AIME 2026"]
    assert "metric is not known" in why["MMLU-Pro"] and "categories" in why["MMLU-Pro"]
    assert "no k/294" in why["IFBench"]
    assert rows(rep)["IFBench"]["definition"]["text"] == (
        "prompt-level strict accuracy; one sample per item"
    )
    assert (
        rows(rep)["MMLU-Pro"]["definition"]["metric"] == "accuracy pooled per question"
    )
    assert rep["average"]["reference"] is None
    assert "AIME 2026" in rep["average"]["reference_omitted"]
    md = (tmp_path / "rep" / "report.md").read_text()
    assert (
        "| HumanEval | pass@1, n=1 | 5 | 80.00 | 60.00 | -20.00 | [-76.44, +58.12] | ok |"
        in md
    )
    assert "| 95.1 | 90.9 | -4.2 |" in md
    assert "AIME 2026: reference left out: the reference averages several samples" in md
    with (tmp_path / "rep" / "report.csv").open() as f:
        table = {r["benchmark"]: r for r in csv.DictReader(f)}
    assert (
        table["GPQA-Diamond"]["ref_delta"] == "-2.0"
        and table["MMLU-Pro"]["ref_delta"] == ""
    )

    # With several samples per problem, AIME's multi-sample reference is of the same kind.
    run = OCRun(tmp_path / "o4")
    run.add(T, "aime2026", [[1, 1, 0, 1], [1, 0, 0, 0]])
    run.add(S, "aime2026", [[1, 0, 0, 1], [0, 0, 0, 0]])
    rep = make_report(
        tmp_path, run.finish(), args=["--reference", str(ref)], name="rep4"
    )
    aime = rows(rep)["AIME 2026"]
    assert aime["definition"]["text"] == (
        "accuracy; avg@4: the mean over 4 samples per item, then over items"
    )
    assert aime["reference"] == {"teacher": 92.7, "student": 86.6, "delta": -6.1}


@pytest.mark.parametrize(
    "name,table",
    [
        (
            "edge0_35b.json",
            {
                "teacher": [92.7, 95.1, 81.8, 84.6, 61.7, 83.2],
                "student": [86.6, 90.9, 79.8, 81.0, 57.9, 79.2],
            },
        ),
        (
            "edge0_8b.json",
            {
                "teacher": [73.3, 92.7, 71.2, 65.8, 60.6, 72.7],
                "student": [63.3, 91.5, 70.7, 70.1, 53.9, 69.9],
            },
        ),
    ],
)
def test_shipped_reference_files(name, table):
    ref = json.loads((REPO / "reports" / "reference" / name).read_text())
    for arm, numbers in table.items():
        assert [ref["arms"][arm][b] for b in ORDER] + [ref["average"][arm]] == numbers
        # the published average is the unweighted mean of the five, to one decimal
        assert abs(sum(numbers[:5]) / 5 - numbers[5]) <= 0.05 + 1e-9


def test_arms_errors(tmp_path, capsys):
    run_dir = standard_run(tmp_path, ablations=True)
    assert main(["report", str(run_dir), "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert all(m in err for m in (T, S, Q, P)) and "--arms" in err
    assert (
        main(
            [
                "report",
                str(run_dir),
                "--out",
                str(tmp_path / "r"),
                "--arms",
                f"teacher={T},student=nope",
            ]
        )
        == 2
    )
    assert "'nope'" in capsys.readouterr().err
    assert (
        main(
            [
                "report",
                str(run_dir),
                "--out",
                str(tmp_path / "r"),
                "--arms",
                f"teacher={T}",
            ]
        )
        == 2
    )
    assert "student" in capsys.readouterr().err


def test_item_correctness_shapes():
    # OpenCompass 0.5.4 regrouped details: values per replica
    assert item_correctness({"example_abbr": "a_0", "correct": [True]}) == 1.0
    assert (
        item_correctness({"example_abbr": "a_0", "correct": [True, False, True, True]})
        == 0.75
    )
    assert item_correctness({"example_abbr": "h_0", "is_correct": [False]}) == 0.0
    # CascadeEvaluator: the judge's verdict wins over the rule's; without a judge, the rule's
    assert (
        item_correctness(
            {"rule_evaluation": [{"correct": False}], "cascade_correct": [True]}
        )
        == 1.0
    )
    assert item_correctness({"rule_evaluation": [{"correct": True}]}) == 1.0
    # AccEvaluator via format_details
    assert item_correctness({"predictions": "A", "references": "A"}) == 1.0
    assert item_correctness({"predictions": "", "references": "A"}) == 0.0
    # IFBench: the benchmark's own key
    d = {
        "is_strict_correct": [False],
        "is_loose_correct": [True],
        "is_correct": [False],
    }
    assert item_correctness(d, "is_loose_correct") == 1.0
    assert item_correctness({"pred": "x"}) is None


def test_replicas_average(tmp_path):
    # n = 2 replicas: metric "accuracy (2 runs average)", per-item correctness in [0, 1]
    run = OCRun(tmp_path / "o")
    run.add(T, "GPQA_diamond", [[1, 1], [1, 0], [0, 0]])
    run.add(S, "GPQA_diamond", [[1, 0], [0, 0], [0, 1]])
    rep = make_report(tmp_path, run.finish())
    r = rows(rep)["GPQA-Diamond"]
    assert r["status"] == "ok" and r["items"] == 3
    assert r["teacher"] == pytest.approx(50.0) and r["student"] == pytest.approx(
        100 / 3
    )
    # diffs -50, -50, +50: mean -50/3, deviations -100/3, -100/3, +200/3
    var = ((100 / 3) ** 2 * 2 + (200 / 3) ** 2) / 2
    assert r["delta_half_width"] == pytest.approx(t95(3) * math.sqrt(var / 3))


REAL_CFG = """
from opencompass.openicl.icl_prompt_template import PromptTemplate
from opencompass.openicl.icl_retriever import ZeroRetriever
from opencompass.openicl.icl_inferencer import GenInferencer
from opencompass.openicl.icl_evaluator import AccEvaluator, AccwithDetailsEvaluator
from opencompass.datasets import CustomDataset, GPQAEvaluator
_infer = dict(prompt_template=dict(type=PromptTemplate, template=dict(round=[
    dict(role="HUMAN", prompt="{question}")])), retriever=dict(type=ZeroRetriever),
    inferencer=dict(type=GenInferencer))
datasets = [dict(abbr=abbr, type=CustomDataset, path="toy.jsonl",
                 reader_cfg=dict(input_columns=["question"], output_column="answer"),
                 infer_cfg=_infer, eval_cfg=dict(evaluator=dict(type=ev)))
            for abbr, ev in [("mmlu_pro_math", AccEvaluator),
                             ("mmlu_pro_law", AccwithDetailsEvaluator),
                             ("GPQA_diamond", GPQAEvaluator)]]
models = [dict(abbr="m-teacher", type="x", path="x"), dict(abbr="m-student", type="x", path="x")]
work_dir = "outputs/20260301_000000"
"""

REAL_RUN = """
import json, os, os.path as osp
from mmengine.config import Config
from opencompass.tasks.openicl_eval import OpenICLEvalTask
from opencompass.summarizers import DefaultSummarizer

gold, preds = "ABCDAB", {"m-teacher": "ABCDAA", "m-student": "ABCCBA"}
with open("toy.jsonl", "w") as f:
    f.writelines(json.dumps({"question": f"q{i}", "answer": a}) + "\\n" for i, a in enumerate(gold))
cfg = Config.fromfile("cfg.py", format_python_code=False)
work = cfg.work_dir
os.makedirs(osp.join(work, "configs"))
dumped = osp.join(work, "configs", "20260301_000000_1.py")
cfg.dump(dumped)   # dumped and reloaded, as `opencompass` does
cfg = Config.fromfile(dumped, format_python_code=False)
for m in cfg.models:
    for d in cfg.datasets:
        p = osp.join(work, "predictions", m.abbr)
        os.makedirs(p, exist_ok=True)
        with open(osp.join(p, d.abbr + ".json"), "w") as f:
            json.dump({str(i): {"origin_prompt": f"q{i}", "prediction": preds[m.abbr][i],
                                "gold": gold[i]} for i in range(6)}, f)
        if m.abbr == "m-student" and d.abbr == "GPQA_diamond":
            continue   # never scored: OpenCompass would show '-'
        OpenICLEvalTask(Config(dict(models=[m], datasets=[[d]], work_dir=work, eval=dict(
            runner=dict(task=dict(dump_details=True)))))).run()
DefaultSummarizer(cfg).summarize(time_str="20260301_000000")
"""


def test_real_opencompass_outputs(tmp_path):
    """OpenCompass's own evaluators and summarizer write the tree; the report must agree."""
    pytest.importorskip("opencompass")
    import subprocess
    import sys

    (tmp_path / "cfg.py").write_text(REAL_CFG)
    (tmp_path / "run.py").write_text(REAL_RUN)
    proc = subprocess.run(
        [sys.executable, "run.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    rep = make_report(tmp_path, tmp_path / "outputs")
    # teacher ABCDAA, student ABCCBA, gold ABCDAB: teacher 5/6, student 3/6 on each set
    # AccEvaluator (format_details) + AccwithDetails, pooled
    mmlu = rows(rep)["MMLU-Pro"]
    assert mmlu["status"] == "ok" and mmlu["items"] == 12
    assert mmlu["teacher"] == pytest.approx(500 / 6) and mmlu[
        "student"
    ] == pytest.approx(50.0)
    assert mmlu["version"] == prompt_version(infer_cfg("{question}"))
    # teacher 111110, student 111000 per set: diffs 0,0,0,-100,-100,0 (twice), mean -100/3,
    # deviations +100/3 (8 items) and -200/3 (4 items)
    var = (8 * (100 / 3) ** 2 + 4 * (200 / 3) ** 2) / 11
    assert mmlu["delta_se"] == pytest.approx(math.sqrt(var / 12))
    # 12 items of 0/1 outcomes, 4 fell: the exact interval, by hand
    fell = stats.beta.ppf([0.0125, 0.9875], [4, 5], [9, 8])
    rose_high = stats.beta.ppf(0.9875, 1, 12)
    assert mmlu["delta_ci95"] == pytest.approx(
        [-100 * fell[1], 100 * (rose_high - fell[0])]
    )
    assert rows(rep)["GPQA-Diamond"]["status"] == "failed"


def test_failed_ablation_is_left_out_of_the_decomposition(tmp_path):
    run = OCRun(tmp_path / "o")
    add_model(run, T, TEACHER)
    add_model(run, S, STUDENT)
    add_model(run, Q, INT4, IFBench={"failed": "error"})
    add_model(run, P, PRE)
    rep = make_report(tmp_path, run.finish(), args=["--arms", ARMS_4])
    d = rows(rep)["IFBench"]["decomposition"]
    assert d["quantization_loss"] is None and d["routing_loss"] is None
    assert d["lora_recovery"] == pytest.approx(25.0) and d[
        "total_gap"
    ] == pytest.approx(25.0)
    assert rows(rep)["IFBench"]["status"] == "ok"  # teacher vs student is unaffected
    assert any(
        "int4_exact edge0-int4-exact left out" in n
        for n in rows(rep)["IFBench"]["notes"]
    )
    avg = rep["average"]["decomposition"]
    assert avg["quantization_loss"] is None and avg["lora_recovery"] == pytest.approx(
        24.0
    )


@pytest.mark.parametrize("config", [True, False])
def test_summary_with_groups_and_no_category_rows(tmp_path, config):
    # configs/edge0_35b.py's summarizer lists only aime2026, openai_humaneval, GPQA_diamond,
    # the groups mmlu_pro_per_question and mmlu_pro, and IFBench: no category rows, so the
    # categories come from the dumped config (versions hashed by opencompass) or, without one,
    # from the results files; group rows are never datasets, even when they show only '-'.
    run = OCRun(tmp_path / "o")
    add_model(run, T, TEACHER, skip=("aime2026",))
    add_model(run, S, STUDENT, skip=("aime2026",))
    run.add(T, "mmlu_pro_physics", [1, 0], failed="missing")
    run.add(S, "mmlu_pro_physics", [1, 0], failed="missing")
    cats = ["mmlu_pro_math", "mmlu_pro_law", "mmlu_pro_physics"]
    run_dir = run.finish(
        config=config,
        groups={"mmlu_pro_per_question": cats, "mmlu_pro": cats},
        dataset_abbrs=[
            "openai_humaneval",
            "GPQA_diamond",
            "mmlu_pro_per_question",
            "mmlu_pro",
            "IFBench",
        ],
    )
    summary = next((run_dir / "summary").glob("*.csv")).read_text()
    assert (
        "mmlu_pro_per_question,-,-,-,-,-" in summary and "mmlu_pro_math" not in summary
    )
    rep = make_report(tmp_path, run_dir)
    assert [r["benchmark"] for r in rep["benchmarks"]] == [
        "HumanEval",
        "GPQA-Diamond",
        "MMLU-Pro",
        "IFBench",
    ]
    mmlu = rows(rep)["MMLU-Pro"]
    # physics was meant to be scored (config, or its predictions file) and has no results:
    # the pooled number would be wrong, so the benchmark fails
    assert mmlu["status"] == "failed"
    assert mmlu["datasets"] == sorted(cats)
    assert mmlu["arms"]["teacher"]["score"] is None
    if config:
        assert mmlu["arms"]["teacher"]["version"] == prompt_version(
            infer_cfg("{question}")
        )
    else:
        assert mmlu["arms"]["teacher"]["version"] is None
        assert any("MMLU-Pro: prompt version of teacher" in n for n in rep["notes"])
    assert rows(rep)["HumanEval"]["status"] == "ok"


def test_truncation_is_counted_per_arm(tmp_path):
    """Outputs cut at max_out_len, and those cut inside their thinking block, per arm and
    benchmark; an arm without finish reasons shows none rather than zero."""
    run = OCRun(tmp_path / "o")
    run.add(T, "aime2026", [1, 0, 1, 0])
    stats = [
        {"finish_reason": f, "tokens": 8} for f in ("stop", "length", "length", "stop")
    ]
    run.add(
        S,
        "aime2026",
        [1, 0, 1, 0],
        engine=stats,
        outputs=[
            "12",
            "<think> so the answer: D maybe, but wait",
            "<think>x</think> 7",
            "3",
        ],
    )
    rep = make_report(tmp_path, run.finish())
    arms = rows(rep)["AIME 2026"]["arms"]
    assert arms["student"]["truncation"] == {
        "outputs": 4,
        "length": 2,
        "open_thinking": 1,
    }
    assert arms["teacher"]["truncation"] is None
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "| AIME 2026 | student | 4 | 2 (50.0%) | 1 |" in md


GENERATION = {
    "max_out_len": 8192,
    "generation_kwargs": {"temperature": 0.6, "top_p": 0.95},
}


def _arm_run(root, model, *, evaluator=None, **generation):
    run = OCRun(root)
    run.add(model, "aime2026", [1, 0, 1, 0])
    run.model_settings[model] = {**GENERATION, **generation}
    if evaluator:
        run.evaluator = evaluator
    return run.finish()


@pytest.mark.parametrize(
    "change,field",
    [
        ({"max_out_len": 4096}, "max_out_len 4096, teacher 8192"),
        (
            {"generation_kwargs": {"temperature": 1.0, "top_p": 0.95}},
            "generation_kwargs",
        ),
        ({"evaluator": "opencompass.evaluator.CascadeEvaluator"}, "aime2026 eval_cfg"),
    ],
)
def test_arms_with_other_settings_are_not_paired(change, field, tmp_path, capsys):
    teacher = _arm_run(tmp_path / "t", T)
    student = _arm_run(tmp_path / "s", S, **change)
    assert (
        main(
            [
                "report",
                str(teacher),
                str(student),
                "--arms",
                f"teacher={T},student={S}",
                "--out",
                str(tmp_path / "rep"),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "refusing to pair arms run with different settings" in err and field in err
    assert not (tmp_path / "rep" / "report.json").exists()


def test_same_settings_from_another_directory_pair_and_the_gate_checks_them(
    tmp_path, capsys
):
    teacher = _arm_run(tmp_path / "t", T)
    student = _arm_run(tmp_path / "s", S)
    rep = make_report(
        tmp_path, teacher, student, args=["--arms", f"teacher={T},student={S}"]
    )
    assert rep["arms"]["student"]["settings"]["generation"]["max_out_len"] == 8192
    assert rows(rep)["AIME 2026"]["status"] == "ok"
    # A baseline made at another max_out_len is refused by the gate, naming the field.
    other = _arm_run(tmp_path / "s2", S, max_out_len=4096)
    teacher2 = _arm_run(tmp_path / "t2", T, max_out_len=4096)
    make_report(
        tmp_path,
        teacher2,
        other,
        args=["--arms", f"teacher={T},student={S}"],
        name="base",
    )
    assert (
        main(
            [
                "gate",
                str(tmp_path / "rep" / "report.json"),
                "--baseline",
                str(tmp_path / "base" / "report.json"),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert (
        "cannot be verified as made with the settings of" in err
        and "teacher max_out_len 8192, baseline 4096" in err
    )
