"""A corrupt fidelity section or a baseline without benchmarks is one clear error."""

from __future__ import annotations

import json
import random
import shutil

import pytest
from bad_inputs import expect_clear_error, outcome

from edge0_eval.cli import main
from edge0_eval.evaluation.gate.inputs import load_report
from edge0_eval.evaluation.report.gap import SCHEMA


def _arm(**kw):
    arm = {
        "abbr": "m",
        "status": "ok",
        "dataset": "edge0_fidelity",
        "items": 4,
        "kl": 0.01,
        "agreement": 95.0,
    }
    arm.update(kw)
    return arm


def _write(path, fidelity, benchmarks=()):
    path.write_text(
        json.dumps(
            {"schema": SCHEMA, "benchmarks": list(benchmarks), "fidelity": fidelity}
        )
    )
    return path


def _fid(**arm):
    return {"status": "ok", "items": 4, "arms": {"student": _arm(**arm)}}


FIDELITY_CASES = {
    "negative kl": _fid(kl=-0.5),
    "agreement 150": _fid(agreement=150.0),
    "null kl": _fid(kl=None),
    "string agreement": _fid(agreement="95"),
    "string section": "ok",
    "list section": [1, 2],
    "arm a string": {"status": "ok", "items": 4, "arms": {"student": "ok"}},
    "negative half-width": _fid(kl_half_width=-0.1),
    "string half-width": _fid(agreement_half_width="1"),
    "negative nll": _fid(nll=-1.0),
    "items a float": _fid(items=3.5),
    "section items negative": {**_fid(), "items": -1},
    "per_item agreement 1.5": {**_fid(), "per_item": {"student": {"0": [0.1, 1.5]}}},
    "per_item negative kl": {**_fid(), "per_item": {"student": {"0": [-0.1, 0.5]}}},
    "per_item not a pair": {**_fid(), "per_item": {"student": {"0": 0.1}}},
    "per_item a list": {**_fid(), "per_item": [1]},
    "decomposition string delta": {
        **_fid(),
        "decomposition": {"lora": {"kl": {"delta": "0.1", "half_width": 0.01}}},
    },
    "decomposition negative width": {
        **_fid(),
        "decomposition": {"lora": {"kl": {"delta": 0.1, "half_width": -0.01}}},
    },
    "teacher_sanity a string": {**_fid(), "teacher_sanity": "ok"},
    "teacher_sanity ok not bool": {**_fid(), "teacher_sanity": {"ok": "yes"}},
}


@pytest.mark.parametrize("case", FIDELITY_CASES)
def test_gate_refuses_bad_fidelity(case, tmp_path):
    bad = _write(tmp_path / "bad.json", FIDELITY_CASES[case])
    expect_clear_error(lambda: load_report(str(bad)), bad)


def test_gate_accepts_good_fidelity(tmp_path):
    good = _write(
        tmp_path / "good.json",
        {
            **_fid(
                kl_half_width=0.002, agreement_half_width=None, nll=1.2, greedy_match=7
            ),
            "per_item": {"student": {"0": [0.0, 1.0], "1": [0.3, 0.5]}},
            "decomposition": {"lora": {"kl": {"delta": -0.01, "half_width": None}}},
            "teacher_sanity": {"kl": 0.0, "agreement": 100.0, "ok": True},
        },
    )
    assert load_report(str(good))["fidelity"]["arms"]["student"]["kl"] == 0.01


def test_gate_refuses_baseline_without_benchmarks(tmp_path, capsys):
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
    report = _write(tmp_path / "report.json", _fid(), [row])
    baseline = _write(tmp_path / "baseline.json", _fid())
    # Before: every benchmark showed as "new" and the gate passed.
    assert main(["gate", str(report), "--baseline", str(baseline)]) == 2
    err = capsys.readouterr().err
    assert str(baseline) in err and "regenerate" in err and "Traceback" not in err


@pytest.mark.parametrize("kl,agreement", [(-0.5, 0.9), (0.1, 1.5), (float("inf"), 0.9)])
def test_report_refuses_out_of_range_fidelity_details(kl, agreement, tmp_path):
    from edge0_eval.evaluation.fidelity.report import load_arm
    from edge0_eval.evaluation.outputs.runs import Run

    path = tmp_path / "results" / "m" / "edge0_fidelity.json"
    path.parent.mkdir(parents=True)
    path.write_text(
        json.dumps(
            {
                "details": [
                    {
                        "id": "0",
                        "kl": kl,
                        "agreement": agreement,
                        "nll": 1.0,
                        "greedy_match": 3,
                        "source": "s",
                    }
                ]
            }
        )
    )
    run = Run(tmp_path, ["m"], ["edge0_fidelity"], {}, set())
    expect_clear_error(lambda: load_arm("m", run), path)


@pytest.mark.parametrize("details", ["abc", [1, 2]])
def test_report_refuses_details_not_objects(details, tmp_path):
    from edge0_eval.evaluation.benchmarks import benchmark_for
    from edge0_eval.evaluation.outputs.runs import Run, load_dataset_result

    path = tmp_path / "results" / "m" / "gpqa_diamond.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"accuracy": 50.0, "details": details}))
    run = Run(tmp_path, ["m"], ["gpqa_diamond"], {}, set())
    expect_clear_error(
        lambda: load_dataset_result(
            run, "m", benchmark_for("gpqa_diamond"), "gpqa_diamond"
        ),
        path,
    )


def _two_arm_run(tmp_path):
    from oc_tree import OCRun

    run = OCRun(tmp_path / "o")
    for model in ("edge0-tiny-teacher", "edge0-tiny-student"):
        run.add(model, "GPQA_diamond", [1, 0, 1, 0])
        run.add(model, "aime2026", [1, 0])
    return run.finish()


def _report(tmp_path, outputs):
    from test_report import make_report, rows

    return rows(make_report(tmp_path, outputs)), outputs


def test_report_flags_a_deleted_predictions_file(tmp_path):
    outputs = _two_arm_run(tmp_path)
    (outputs / "predictions" / "edge0-tiny-student" / "GPQA_diamond.json").unlink()
    r, _ = _report(tmp_path, outputs)
    assert r["GPQA-Diamond"]["status"] == "no_predictions"
    assert list(r["GPQA-Diamond"]["not_computed"]) == ["student"]
    assert r["AIME 2026"]["status"] == "ok"  # the control


def test_report_without_predictions_says_what_it_could_not_compute(tmp_path, capsys):
    """With the run's whole predictions/ folder deleted, every benchmark was "ok"
    and truncation, finish reasons and thinking closure were silently absent."""
    outputs = _two_arm_run(tmp_path)
    good = tmp_path / "good"
    assert main(["report", str(outputs), "--out", str(good)]) == 0
    shutil.rmtree(outputs / "predictions")
    capsys.readouterr()
    bad = tmp_path / "bad"
    assert main(["report", str(outputs), "--out", str(bad)]) == 1
    out = capsys.readouterr().out
    assert "GPQA-Diamond: no_predictions" in out and "AIME 2026: no_predictions" in out
    report = json.loads((bad / "report.json").read_text())
    assert report["status"] == "incomplete"
    for row in report["benchmarks"]:
        assert row["status"] == "no_predictions"
        assert set(row["not_computed"]) == {"teacher", "student"}
        assert "truncation" in row["not_computed"]["student"]
        assert row["student"] is not None  # the scores, from results/, are still shown
    assert "the run has no predictions folder" in "\n".join(report["notes"])
    assert "no_predictions" in (bad / "report.md").read_text()
    # The gate compares none of it, as the current run or as the baseline.
    for current, baseline in ((bad, good), (good, bad)):
        code = main(
            [
                "gate",
                str(current / "report.json"),
                "--baseline",
                str(baseline / "report.json"),
            ]
        )
        out = capsys.readouterr().out
        assert code == 1 and out.count("no_predictions") >= 2, out


def test_report_refuses_an_item_twice_in_the_details(tmp_path, capsys):
    outputs = _two_arm_run(tmp_path)
    path = outputs / "results" / "edge0-tiny-student" / "aime2026.json"
    result = json.loads(path.read_text())
    result["details"].append(result["details"][0])
    path.write_text(json.dumps(result))
    _refused(["report", str(outputs), "--out", str(tmp_path / "rep")], path, capsys)
    assert not (tmp_path / "rep" / "report.json").exists()


def test_a_repeated_key_in_a_results_file_is_not_scored(tmp_path):
    """json keeps the last of two equal keys without a word: an item given twice in the
    object form of the details would be scored once, silently."""
    from edge0_eval.evaluation.benchmarks import benchmark_for
    from edge0_eval.evaluation.outputs.runs import Run, load_dataset_result

    path = tmp_path / "results" / "m" / "gpqa_diamond.json"
    path.parent.mkdir(parents=True)
    preds = tmp_path / "predictions" / "m" / "gpqa_diamond.json"
    preds.parent.mkdir(parents=True)
    preds.write_text(json.dumps({"0": {"prediction": "ANSWER: A"}}))
    item = '{"predictions": "A", "references": "A"}'
    path.write_text(
        f'{{"accuracy": 100.0, "details": {{"type": "GEN", "0": {item}, "0": {item}}}}}'
    )
    run = Run(tmp_path, ["m"], ["gpqa_diamond"], {}, set())
    res = load_dataset_result(run, "m", benchmark_for("gpqa_diamond"), "gpqa_diamond")
    assert res.status == "failed" and any("'0' appears twice" in n for n in res.notes)
    path.write_text(f'{{"accuracy": 100.0, "details": {{"type": "GEN", "0": {item}}}}}')
    res = load_dataset_result(run, "m", benchmark_for("gpqa_diamond"), "gpqa_diamond")
    assert res.status == "ok"  # the control


def _refused(argv, path, capsys) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert str(path) in err and "Traceback" not in err


def test_report_refuses_a_garbage_config_dump(tmp_path, capsys):
    outputs = _two_arm_run(tmp_path)
    dump = next((outputs / "configs").glob("*.py"))
    dump.write_text("datasets = [\n  {'abbr': \x00 garbage")
    _refused(["report", str(outputs), "--out", str(tmp_path / "rep")], dump, capsys)
    assert not (tmp_path / "rep" / "report.json").exists()


# -- a seeded fuzz of report fidelity sections --------------------------------------------------

FUZZ_SEED, FUZZ_N = 30, 240


def _full_section() -> dict:
    return {
        **_fid(
            kl_half_width=0.002, agreement_half_width=0.5, nll=1.2, greedy_match=7.0
        ),
        "per_item": {"student": {"0": [0.0, 1.0], "1": [0.3, 0.5]}},
        "decomposition": {
            "lora": {
                "kl": {"delta": -0.01, "half_width": 0.003},
                "agreement": {"delta": 1.5, "half_width": 0.2},
            }
        },
        "teacher_sanity": {"kl": 0.0, "agreement": 100.0, "ok": True},
    }


def _sites(node, path=()):
    """(path, value) of every number and every container the gate reads, below the section."""
    if isinstance(node, dict):
        for key, value in node.items():
            if isinstance(value, (dict, list)) or _is_num(value):
                yield path + (key,), value
                yield from _sites(value, path + (key,))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            if _is_num(value):
                yield path + (i,), value


def _is_num(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _mutate(rng, section: dict) -> tuple[dict, str]:
    """One change that no report can hold: a wrong type anywhere, or an impossible value."""
    section = json.loads(json.dumps(section))
    path, value = rng.choice(
        # teacher_sanity's numbers too: the gate recomputes `ok` from them.
        list(_sites(section))
    )
    if _is_num(value):
        choices = ["a string", [1], {"a": 1}, True]
        if path[-1] != "delta":  # a decomposition delta can be negative
            choices.append(-1.0 - abs(value))
        new = rng.choice(choices)
    else:
        new = rng.choice(["a string", 5])
    parent = section
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = new
    return section, f"{'.'.join(map(str, path))} = {new!r}"


def test_fuzzed_fidelity_sections_are_each_one_clear_error(tmp_path):
    rng = random.Random(FUZZ_SEED)
    good = _write(tmp_path / "good.json", _full_section())
    load_report(str(good))
    missed = []
    for _ in range(FUZZ_N):
        section, what = _mutate(rng, _full_section())
        bad = _write(tmp_path / "bad.json", section)
        kind, message = outcome(lambda: load_report(str(bad)))
        if kind != "error" or str(bad) not in message:
            missed.append((what, kind, message[:100]))
    assert not missed, f"{len(missed)} of {FUZZ_N} not refused cleanly: {missed[:6]}"


def test_fidelity_fuzz_control_sees_a_weakened_check(tmp_path, monkeypatch):
    """The fuzz can fail: with only the arms' status, KL and agreement checked (the check
    before this one), most of its corrupt sections get through."""
    from edge0_eval.evaluation.gate import inputs as gate

    def arms_only(path, fid):
        for entry in fid["arms"].values():
            if not isinstance(entry, dict) or not gate._number(entry.get("kl", 0.0)):
                raise gate.Edge0Error(f"{path}: bad")

    monkeypatch.setattr(gate, "_check_fidelity", arms_only)
    rng = random.Random(FUZZ_SEED)
    accepted = 0
    for _ in range(FUZZ_N):
        section, _ = _mutate(rng, _full_section())
        bad = _write(tmp_path / "bad.json", section)
        accepted += outcome(lambda: load_report(str(bad)))[0] == "accepted"
    assert accepted > FUZZ_N // 2


@pytest.mark.parametrize("per_item", [{"0": "1"}, {"0": 1.5}, ["0"], {"0": None}])
def test_gate_refuses_corrupt_per_item_outcomes(per_item, tmp_path):
    """The paired tests read every per-item score: a corrupt one is one error naming the file,
    not a TypeError inside the test."""
    row = {
        "benchmark": "GPQA-Diamond",
        "status": "ok",
        "items": 1,
        "version": "abc",
        "teacher": 100.0,
        "student": 100.0,
        "gap": 0.0,
        "delta_half_width": None,
        "arms": {
            "teacher": {"status": "ok", "per_item": {"0": 1.0}},
            "student": {"status": "ok", "per_item": per_item},
        },
    }
    bad = _write(tmp_path / "r.json", None, [row])
    expect_clear_error(lambda: load_report(str(bad)), bad)
    row["arms"]["student"]["per_item"] = {"0": 1.0}  # the control
    assert load_report(str(_write(tmp_path / "ok.json", None, [row])))


# -- the teacher's sanity, from its numbers -------------------------------------------------


def _with_teacher(kl=0.0, agreement=100.0, ok=True, sanity_kl=None, items=None):
    section = _full_section()
    section["arms"]["teacher"] = _arm(kl=kl, agreement=agreement)
    section["teacher_sanity"] = {
        "kl": kl if sanity_kl is None else sanity_kl,
        "agreement": agreement,
        "ok": ok,
    }
    section["per_item"]["teacher"] = items or {"0": [kl, agreement / 100.0]}
    return section


SANITY_LIES = {
    "kl 0.5 flagged ok": _with_teacher(kl=0.5),
    "agreement 90 flagged ok": _with_teacher(agreement=90.0),
    "flag's kl not the teacher's": _with_teacher(kl=0.5, sanity_kl=0.0, ok=True),
    "an item not sane": _with_teacher(items={"0": [0.0, 1.0], "1": [0.4, 0.5]}),
    "kl 0 flagged not ok": _with_teacher(ok=False),
}


@pytest.mark.parametrize("case", SANITY_LIES)
def test_gate_recomputes_the_teacher_sanity(case, tmp_path):
    """A report whose teacher KL was 0.5 while its flag said ok passed the gate."""
    bad = _write(tmp_path / "bad.json", SANITY_LIES[case])
    message = expect_clear_error(lambda: load_report(str(bad)), bad)
    assert "teacher_sanity" in message


def _judged(path):
    """The report with settings for every arm the gate judges (it refuses arms without)."""
    report = json.loads(path.read_text())
    settings = {"generation": {"max_out_len": 1}, "scoring": {}, "model": {}}
    report["arms"] = {a: {"settings": settings} for a in report["fidelity"]["arms"]}
    path.write_text(json.dumps(report))
    return path


def test_gate_fails_an_insane_teacher_it_is_told_about(tmp_path, capsys):
    """The control: the same numbers with the flag saying so load, and fail the teacher."""
    baseline = _judged(_write(tmp_path / "base.json", _with_teacher()))
    load_report(str(baseline))
    honest = _judged(_write(tmp_path / "now.json", _with_teacher(kl=0.5, ok=False)))
    assert main(["gate", str(honest), "--baseline", str(baseline)]) == 1
    assert "not the set's teacher" in capsys.readouterr().out
    lying = _judged(_write(tmp_path / "lie.json", _with_teacher(kl=0.5)))
    assert main(["gate", str(lying), "--baseline", str(baseline)]) == 2
    err = capsys.readouterr().err
    assert str(lying) in err and "Traceback" not in err


@pytest.mark.parametrize("value", ["abc", "0.5", None, True, {}, ["abc"]])
def test_report_refuses_a_detail_that_is_not_a_number(value, tmp_path, capsys):
    """A student detail KL of "abc" ended in `ValueError: could not convert string to float`
    (inside gate-run, which builds the report it gates)."""
    from edge0_eval.evaluation.fidelity.report import load_arm
    from edge0_eval.evaluation.outputs.runs import Run

    path = tmp_path / "results" / "student" / "edge0_fidelity.json"
    path.parent.mkdir(parents=True)
    detail = {"id": "0", "kl": value, "agreement": 0.9, "nll": 1.0, "greedy_match": 3}
    path.write_text(json.dumps({"details": [{**detail, "source": "s"}]}))
    run = Run(tmp_path, ["student"], ["edge0_fidelity"], {}, set())
    message = expect_clear_error(lambda: load_arm("student", run), path)
    assert "kl" in message and "re-run that task" in message
