"""report.json v2: per-sample records, repeats (avg@n, pass@k, intervals clustered by item),
the truncation flag, data digests and model identity; every number worked by hand."""

from __future__ import annotations

import json
import math

import pytest
from oc_tree import OCRun
from scipy import stats
from test_report import make_report, rows

from edge0_eval.cli import main

T, S = "qwen-teacher-fp16", "edge0-student"
T95_3 = float(stats.t.ppf(0.975, 2))  # the intervals' quantile at 3 items


def _stats(reasons, tokens=None, identity=None):
    return [
        {
            "finish_reason": r,
            "tokens": t,
            **({"model_identity": identity} if identity else {}),
        }
        for r, t in zip(reasons, tokens or [8] * len(reasons))
    ]


def test_every_sample_has_its_record(tmp_path):
    run = OCRun(tmp_path / "o")
    run.add(
        T,
        "aime2026",
        [1, 0, 1, 0],
        engine=_stats(["eos", "length", "eos", "length"], [5, 24, 7, 24]),
        outputs=[
            "12",
            "<think>\nso ANSWER: 3 maybe",
            "<think>a</think> 7",
            "hmm</think> 4",
        ],
    )
    run.add(S, "aime2026", [1, 0, 1, 1])
    rep = make_report(tmp_path, run.finish())
    teacher = rows(rep)["AIME 2026"]["arms"]["teacher"]
    assert teacher["samples_per_item"] == 1 and teacher["per_item"]["1"] == 0.0
    assert teacher["samples"]["1"] == [
        {
            "score": 0.0,
            "finish_reason": "length",
            "thinking_closed": False,
            "output_tokens": 24,
        }
    ]
    assert [s[0]["thinking_closed"] for s in teacher["samples"].values()] == [
        None,
        False,
        True,
        True,
    ]
    assert teacher["truncation"] == {"outputs": 4, "length": 2, "open_thinking": 1}
    # an arm without engine stats still records its scores; what it cannot know is None
    student = rows(rep)["AIME 2026"]["arms"]["student"]
    assert student["samples"]["3"] == [
        {
            "score": 1.0,
            "finish_reason": None,
            "thinking_closed": None,
            "output_tokens": None,
        }
    ]
    assert student["truncation"] is None
    # this tree's datasets have no edge0_answer_text: OpenCompass's pass-through, said so
    assert rep["open_thinking"]["rule"] == "pass"
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "- open thinking (an output cut inside `<think>`): pass: OpenCompass's" in md


TEACHER_N4 = [[1, 1, 0, 1], [1, 0, 0, 0], [0, 0, 0, 0]]
STUDENT_N4 = [[1, 0, 0, 1], [0, 0, 0, 0], [0, 1, 0, 0]]


def test_repeats_avg_at_n_clustered_by_item(tmp_path):
    """n = 4 samples per item: the item (its mean over samples) is the unit.
    Item means (points): teacher 75, 25, 0; student 50, 0, 25.
    delta per item -25, -25, +25: mean -25/3, sd sqrt(2500/3), se sqrt(2500/9) = 50/3.
    Teacher: mean 100/3, sd sqrt(((125/3)^2 + (25/3)^2 + (100/3)^2) / 2)."""
    run = OCRun(tmp_path / "o")
    reasons = ["eos"] * 12
    reasons[2 * 3 + 1] = "length"  # sample 2 of item 1: prediction r * items + k
    run.add(T, "aime2026", TEACHER_N4, engine=_stats(reasons))
    run.add(S, "aime2026", STUDENT_N4)
    run.add(T, "openai_humaneval", TEACHER_N4)
    run.add(S, "openai_humaneval", STUDENT_N4)
    rep = make_report(tmp_path, run.finish())
    aime = rows(rep)["AIME 2026"]
    assert aime["items"] == 3 and aime["definition"]["samples"] == 4
    assert aime["teacher"] == pytest.approx(100 / 3) and aime[
        "student"
    ] == pytest.approx(25.0)
    assert aime["delta"] == pytest.approx(-25 / 3)
    assert aime["delta_half_width"] == pytest.approx(T95_3 * 50 / 3)
    t = aime["arms"]["teacher"]
    sd = math.sqrt(((125 / 3) ** 2 + (25 / 3) ** 2 + (100 / 3) ** 2) / 2)
    assert t["score_half_width"] == pytest.approx(T95_3 * sd / math.sqrt(3))
    assert [s["finish_reason"] for s in t["samples"]["1"]] == [
        "eos",
        "eos",
        "length",
        "eos",
    ]
    assert [s["score"] for s in t["samples"]["0"]] == [1.0, 1.0, 0.0, 1.0]
    assert t["pass_at_k"] is None  # AIME defines no pass@k
    # HumanEval's pass@k: per item 1 - C(4 - c, k) / C(4, k), c = 3, 1, 0 correct.
    he = rows(rep)["HumanEval"]["arms"]["teacher"]["pass_at_k"]
    assert he["pass@1"]["score"] == pytest.approx(100 / 3)
    assert he["pass@2"]["score"] == pytest.approx((100 + 50 + 0) / 3)
    assert he["pass@4"]["score"] == pytest.approx(200 / 3)
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "| AIME 2026 | accuracy, avg@4 | 3 |" in md and "## Samples per item" in md
    assert "pass@2 50.00" in md


def test_truncation_that_differs_beyond_its_noise_is_flagged(tmp_path):
    run = OCRun(tmp_path / "o")
    # Six items, every one cut for the student only: a paired test rejects equal rates.
    run.add(T, "aime2026", [1, 0, 1, 0, 1, 0], engine=_stats(["eos"] * 6))
    run.add(S, "aime2026", [1, 0, 1, 0, 1, 0], engine=_stats(["length"] * 6))
    # Four items cut for the student only: a 1-in-16 coin, not evidence (its normal interval
    # has width 0 all the same: the test decides, not the interval).
    run.add(T, "GPQA_diamond", [1, 0, 1, 0], engine=_stats(["eos"] * 4))
    run.add(S, "GPQA_diamond", [1, 0, 1, 0], engine=_stats(["length"] * 4))
    # One item each way: difference 0.
    run.add(
        T,
        "openai_humaneval",
        [1, 0, 1, 0],
        engine=_stats(["eos", "length", "eos", "eos"]),
    )
    run.add(
        S,
        "openai_humaneval",
        [1, 0, 1, 0],
        engine=_stats(["eos", "eos", "length", "eos"]),
    )
    rep = make_report(tmp_path, run.finish())
    aime, gpqa, he = (
        rows(rep)["AIME 2026"],
        rows(rep)["GPQA-Diamond"],
        rows(rep)["HumanEval"],
    )
    diff = aime["arms"]["student"]["truncation_vs_teacher"]
    # two-sided mid-p of 6 of 6 one way: 2 x (1/2 x 1/64)
    assert diff == {
        "difference": 100.0,
        "half_width": 0.0,
        "flag": True,
        "arm": 100.0,
        "teacher": 0.0,
        "p_value": pytest.approx(1 / 64, abs=0.004),
    }
    assert (
        len(aime["truncation_flags"]) == 1 and "student" in aime["truncation_flags"][0]
    )
    four = gpqa["arms"]["student"]["truncation_vs_teacher"]
    assert four["half_width"] == 0.0 and four["flag"] is False
    assert four["p_value"] == pytest.approx(1 / 16, abs=0.01)
    assert gpqa["truncation_flags"] == []
    assert he["arms"]["student"]["truncation_vs_teacher"]["flag"] is False
    md = (tmp_path / "rep" / "report.md").read_text()
    assert (
        # six 0/1 items that all agree: the exact interval, 1 - 0.0125^(1/6) each way
        "| AIME 2026 | accuracy, n=1 | 6 | 50.00 | 50.00 | +0.00 | [-51.83, +51.83] | "
        "ok (truncation differs: student) |" in md
    )
    assert (
        "| AIME 2026 | student | 6 | 6 (100.0%) | 0 | +100.0 ±0.0 (p 0.016) FLAG |"
        in md
    )
    assert (
        "| GPQA-Diamond | accuracy, n=1 | 4 | 50.00 | 50.00 | +0.00 | [-66.56, +66.56] | ok |"
        in md
    )


def test_a_different_data_file_refuses_to_pair(tmp_path, capsys):
    teacher, student = OCRun(tmp_path / "t"), OCRun(tmp_path / "s")
    teacher.add(T, "aime2026", [1, 0, 1, 0])
    # the same questions, other answers
    student.add(S, "aime2026", [1, 0, 1, 0], gold="B")
    assert (
        main(
            [
                "report",
                str(teacher.finish()),
                str(student.finish()),
                "--arms",
                f"teacher={T},student={S}",
                "--out",
                str(tmp_path / "rep"),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert (
        "refusing to pair" in err
        and "student aime2026 data" in err
        and "teacher" in err
    )


IDENTITY_T = {"weights": "aaaa"}
IDENTITY_S = {"weights": "bbbb", "lora": "cccc", "prerouter": "dddd", "hedge": None}


def _identity_run(root, lora: str, mixed: bool = False):
    run = OCRun(root)
    run.add(
        T, "aime2026", [1, 0, 1, 0], engine=_stats(["eos"] * 4, identity=IDENTITY_T)
    )
    stats = _stats(["eos"] * 4, identity={**IDENTITY_S, "lora": lora})
    if mixed:
        stats[3]["model_identity"] = IDENTITY_S
    run.add(S, "aime2026", [1, 0, 1, 0], engine=stats)
    run.model_settings[S] = {
        "mode": "prerouted",
        "slots_per_layer": 8,
        "lora_path": f"/models/{root.name}/lora.safetensors",
    }
    return run.finish()


def test_model_identity_is_recorded_and_a_changed_model_is_named_by_the_gate(
    tmp_path, capsys
):
    base = make_report(tmp_path, _identity_run(tmp_path / "a", "cccc"), name="base")
    model = base["arms"]["student"]["settings"]["model"]
    assert model["identity"] == IDENTITY_S and model["mode"] == "prerouted"
    assert "lora_path" not in model  # a path: the identity stands for it
    assert base["arms"]["teacher"]["settings"]["model"]["identity"] == IDENTITY_T
    make_report(tmp_path, _identity_run(tmp_path / "b", "eeee"), name="now")
    capsys.readouterr()
    assert (
        main(
            [
                "gate",
                str(tmp_path / "now" / "report.json"),
                "--baseline",
                str(tmp_path / "base" / "report.json"),
                "--accept-blind",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "model changed since the baseline" in out and "'lora': 'eeee'" in out
    # samples of one dataset from two models (a resume after the model changed): inconsistent
    rep = make_report(
        tmp_path, _identity_run(tmp_path / "c", "eeee", mixed=True), name="mix"
    )
    assert rows(rep)["AIME 2026"]["arms"]["student"]["status"] == "inconsistent"
    assert any("2 different models" in n for n in rep["notes"])


def test_a_v1_baseline_still_gates_with_a_note(tmp_path, capsys):
    run = OCRun(tmp_path / "o")
    run.add(T, "aime2026", [1, 0, 1, 0])
    run.add(S, "aime2026", [1, 0, 1, 0])
    rep = make_report(tmp_path, run.finish())
    old = json.loads(json.dumps(rep))
    old["schema"] = "edge0-eval/report/v1"
    for arm in old["arms"].values():
        arm["settings"].pop("model")
    for r in old["benchmarks"]:
        for a in r["arms"].values():
            a.pop("samples")
    (tmp_path / "v1.json").write_text(json.dumps(old))
    capsys.readouterr()
    assert (
        main(
            [
                "gate",
                str(tmp_path / "rep" / "report.json"),
                "--baseline",
                str(tmp_path / "v1.json"),
                "--accept-blind",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "is a edge0-eval/report/v1 report" in out and "regenerate it" in out
    assert "1 paired with the baseline" in out


def test_the_gate_pairs_repeats_item_by_item(tmp_path, capsys):
    """n = 4: the gate tests the items' means (a sign-flip test on 12 items), never the 48
    samples as if independent; the same samples pass, a drop on every item fails."""

    def report(name, student):
        run = OCRun(tmp_path / name)
        run.add(T, "aime2026", [[1, 1, 1, 0]] * 12)
        run.add(S, "aime2026", student)
        return make_report(tmp_path, run.finish(), name=name)

    report("base", [[1, 1, 1, 1]] * 12)
    report("same", [[1, 1, 1, 1]] * 12)
    report("worse", [[1, 1, 0, 0]] * 12)
    gate = [
        "gate",
        "--baseline",
        str(tmp_path / "base" / "report.json"),
        "--accept-blind",
    ]
    capsys.readouterr()
    assert main([*gate, str(tmp_path / "same" / "report.json")]) == 0
    assert main([*gate, str(tmp_path / "worse" / "report.json")]) == 1
    out = capsys.readouterr().out
    assert "student dropped 50.00 (paired on 12 items, sign-flip-midp" in out


def test_intervals_cover_at_their_level_at_fourteen_items():
    """A gate sample's 14 items: the t interval covers the mean 95% of the time; the normal
    quantile it replaced covered ~92% (the control)."""
    import numpy as np

    from edge0_eval.evaluation.outputs.samples import mean_half_width

    rng = np.random.default_rng(71)
    draws = rng.normal(0.0, 1.0, (8000, 14))
    covered = np.mean([abs(m) <= h for m, h in map(mean_half_width, draws.tolist())])
    assert 0.94 <= covered <= 0.96, covered
    normal = np.abs(draws.mean(1)) <= 1.96 * draws.std(1, ddof=1) / math.sqrt(14)
    assert normal.mean() < 0.93, normal.mean()
