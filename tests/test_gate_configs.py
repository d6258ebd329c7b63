"""The gate configs and what they rest on: OpenCompass's seeded draw (stable, identical across
arms, not nested), the rounds' test ranges (chunks that add up to the whole sample, prefixes
in the draw's order), the sizes in the configs (those of `plan --size-gate`), progress specs."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from datasets import Dataset
from fidelity_sets import fidelity_set
from opencompass.openicl.icl_dataset_reader import load_partial_dataset

from edge0_eval.errors import ConfigError
from edge0_eval.evaluation.gate import rounds
from edge0_eval.evaluation.plan.planner import (
    PlanOptions,
    make_plan,
    render_gate_size,
    size_gate,
)
from edge0_eval.evaluation.plan.progress import Progress, line, task_specs
from edge0_eval.evaluation.plan.run_config import load_config

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs"
AIME_ITEMS = 60
TIER_ENV = {
    "EDGE0_35B_TEACHER": "/t",
    "EDGE0_35B_STUDENT": "/s",
    "EDGE0_8B_TEACHER": "/t",
    "EDGE0_8B_STUDENT": "/s",
    "EDGE0_TINY_TEACHER": "/t",
    "EDGE0_TINY_STUDENT": "/s",
}


@pytest.fixture
def aime_root(tmp_path, monkeypatch):
    """An AIME-shaped data file of 60 problems under an otherwise empty data root."""
    root = tmp_path / "root"
    path = root / "data" / "aime2026" / "aime2026.jsonl"
    path.parent.mkdir(parents=True)
    path.write_text(
        "".join(
            json.dumps({"question": f"q{i}", "answer": str(i)}) + "\n"
            for i in range(AIME_ITEMS)
        )
    )
    monkeypatch.setenv("COMPASS_DATA_CACHE", str(root))
    for key, value in TIER_ENV.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("EDGE0_ARMS", raising=False)
    monkeypatch.delenv("EDGE0_GATE_ROUND", raising=False)
    return root


def _aime(size) -> dict:
    """The tier's AIME dataset sampled with test_range `size`."""
    aime = next(
        d
        for d in load_config(CONFIGS / "edge0_35b.py")["datasets"]
        if d["abbr"] == "aime2026"
    )
    return dict(aime, reader_cfg=dict(aime["reader_cfg"], test_range=size))


def test_opencompass_draw_is_seeded_by_its_size_and_not_nested(aime_root):
    from opencompass.utils import build_dataset_from_cfg

    ten = _aime(10)
    drawn = rounds.draw(ten)
    # What OpenCompass's own loader selects, in its order, every time.
    rows = build_dataset_from_cfg(ten).test
    assert [int(r["question"][1:]) for r in rows] == drawn == rounds.draw(ten)
    expected = list(range(AIME_ITEMS))
    random.Random(10).shuffle(expected)
    assert drawn == expected[:10] and drawn != sorted(drawn)
    # Another size is another draw: K and K + 1 share no prefix (resizing redraws the sample).
    assert rounds.draw(_aime(11))[:10] != drawn
    # n > 1 would draw copies, not items.
    with pytest.raises(ConfigError, match="n > 1 draws copies"):
        rounds.draw(dict(ten, n=4))


def test_rounds_chunk_the_draw_into_growing_prefixes(aime_root):
    sample = _aime(20)
    order = rounds.draw(sample)
    shares = [0.125, 0.25, 0.5, 1.0]
    seen = []
    for r in range(1, 5):
        (infer,) = rounds.round_datasets([sample], shares, r, "infer")
        (evaluate,) = rounds.round_datasets([sample], shares, r, "eval")
        assert infer["abbr"] == f"aime2026_{r - 1}" and evaluate["abbr"] == "aime2026"
        whole = Dataset.from_dict({"p": list(range(AIME_ITEMS))})
        seen += load_partial_dataset(whole, size=infer["reader_cfg"]["test_range"])["p"]
        prefix = load_partial_dataset(whole, size=evaluate["reader_cfg"]["test_range"])[
            "p"
        ]
        assert prefix == seen == order[: len(seen)]  # chunks 0..r-1 read back in order
    assert seen == order
    assert [rounds.bounds(20, shares, r)[:2] for r in range(1, 5)] == [
        (0, 3),
        (3, 5),
        (5, 10),
        (10, 20),
    ]
    # A round that adds nothing to a small sample has no chunk; later chunks stay numbered.
    assert [rounds.bounds(3, shares, r)[2] for r in range(1, 5)] == [0, None, 1, 2]
    # Datasets that are not sampled pass unchanged (fidelity: scored whole in round 1).
    fid = {"abbr": "edge0_fidelity", "reader_cfg": {}}
    assert rounds.round_datasets([fid], shares, 2, "infer") == [fid]
    with pytest.raises(ConfigError, match="ending at 1.0"):
        rounds.check_rounds([0.5, 0.9])


def test_eval_refuses_chunks_of_another_run(aime_root, tmp_path):
    sample = _aime(20)
    model = tmp_path / "predictions" / "edge0-35b-student"
    model.mkdir(parents=True)
    (model / "aime2026_0.json").write_text("{}")
    rounds.round_datasets([sample], [0.5, 1.0], 1, "eval", tmp_path / "predictions")
    (model / "aime2026_1.json").write_text("{}")  # left by another run of this folder
    with pytest.raises(
        ConfigError, match="aime2026_1.json: not a chunk of this gate run"
    ):
        rounds.round_datasets([sample], [0.5, 1.0], 1, "eval", tmp_path / "predictions")


@pytest.mark.parametrize(
    "name", ["edge0_35b_gate.py", "edge0_8b_gate.py", "edge0_tiny_gate.py"]
)
def test_config_sizes_are_the_sizing_commands(name, aime_root):
    """`samples` and `drops` are data; they must be what `plan --size-gate` prints."""
    cfg = load_config(CONFIGS / name)
    gate = cfg["edge0_gate"]
    size = size_gate(CONFIGS / name)
    assert gate["samples"] == size.samples and gate["drops"] == size.drops
    # The config samples exactly those datasets, each with its K as OpenCompass's test_range.
    sampled = {
        d["abbr"]: d["reader_cfg"]["test_range"]
        for d in cfg["datasets"]
        if rounds.sample_size(d) is not None
    }
    assert sampled == {k: v for k, v in gate["samples"].items() if v}
    # Every arm generates alike; the tier gates run thinking off (the config says why).
    for key in ("max_out_len", "chat_template_kwargs", "generation_kwargs"):
        assert len({json.dumps(m.get(key), sort_keys=True) for m in cfg["models"]}) == 1
    if name != "edge0_tiny_gate.py":
        assert cfg["models"][0]["chat_template_kwargs"] == {"enable_thinking": False}
        assert cfg["models"][0]["max_out_len"] == 1024
        assert "AIME 2026" not in size.drops
        # The sample fits the budget: fidelity, overhead and benchmarks within the hour.
        s = size.seconds
        assert s["overhead"] + s["fidelity"] + s["benchmarks"] <= s["budget"]
        # What each mode catches for a collapse to 0 on the hour's 14 items: 8 lost items all
        # one way (p = 2^-8 < 0.05 / 8) for the fixed test, 10 (the last round's test at a
        # fifth of that) for the sequential mode, so a 71% student (10 of 14) collapsing fails.
        table = render_gate_size(size, "plan")
        assert (
            "| HumanEval | 14 of 164 |" in table
            and "| 74.1 | 91.2 | 57.1 | 71.4 |" in table
        )


def test_sizing_stratifies_mmlu_pro_by_category(aime_root):
    size = size_gate(CONFIGS / "edge0_35b_gate.py")
    categories = {k: v for k, v in size.samples.items() if k.startswith("mmlu_pro_")}
    assert len(categories) == 14 and sum(categories.values()) == 14
    # In proportion to the categories' sizes: the two largest get the extra items.
    assert categories["mmlu_pro_math"] == categories["mmlu_pro_physics"] == 2
    assert categories["mmlu_pro_history"] == 0
    # A tenfold budget (by rate) buys about ten times the items, proportional again.
    big = size_gate(CONFIGS / "edge0_35b_gate.py", tok_s=200.0)
    assert big.samples["mmlu_pro_math"] > 5 * categories["mmlu_pro_math"]
    assert big.drops["MMLU-Pro"] < size.drops["MMLU-Pro"]


def test_sizing_follows_the_churn_a_baseline_of_runs_measured(aime_root, tmp_path):
    """`--churn-from BASELINE`: the thresholds at the churn the baseline's runs measured, not
    the config's declared 10% (the tiny gate: one benchmark of 234 items)."""
    from edge0_eval.evaluation.report.gap import SCHEMA

    config = CONFIGS / "edge0_tiny_gate.py"
    declared = load_config(config)["edge0_gate"]["drops"]["edge0_agreement"]
    path = tmp_path / "baseline.json"

    def baseline(spread: dict) -> Path:
        arms = {"teacher": {"status": "ok"}, "student": {"status": "ok"}}
        row = dict(
            benchmark="edge0_agreement",
            status="ok",
            items=234,
            gap=0.0,
            student=50.0,
            arms=arms,
            baseline_runs=spread,
        )
        report = {"schema": SCHEMA, "benchmarks": [row], "baseline": {"runs": 2}}
        path.write_text(json.dumps(report))
        return path

    more = size_gate(config, churn_from=baseline({"runs": 2, "churn": 0.3}))
    less = size_gate(config, churn_from=baseline({"runs": 2, "churn": 0.0}))
    assert less.drops["edge0_agreement"] < declared < more.drops["edge0_agreement"]
    with pytest.raises(ConfigError, match="no measured churn for edge0_agreement"):
        size_gate(config, churn_from=baseline({}))


def test_plan_of_a_gate_config_states_both_detectable_drops(aime_root):
    plan = make_plan(
        PlanOptions(
            config=CONFIGS / "edge0_35b_gate.py", tok_s=20.0, fidelity_tok_s=200.0
        )
    )
    mmlu = plan.power["MMLU-Pro"]
    assert mmlu["items"] == 14 and mmlu["sequential_drop"] > mmlu["detectable_drop"]
    student = plan.arms["edge0-35b-student"]
    # The sample's generation fits what the sizing gave it, and with no set staged here the
    # fidelity part is the config's declared 102,400 positions at the declared 200/s.
    fidelity = {(l.arm, l.dataset): l for l in plan.lines}[
        ("edge0-35b-student", "edge0_fidelity")
    ]
    assert fidelity.tokens == 102400 and fidelity.items_source == "gate config"
    assert fidelity.hours * 3600 == pytest.approx(512.0)
    assert student["hours"] * 3600 <= 2867 + 512 + 1


def test_cli_sizes_and_refuses_a_config_without_a_gate(aime_root):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "edge0_eval",
            "plan",
            str(CONFIGS / "edge0_35b_gate.py"),
            "--size-gate",
        ],
        capture_output=True,
        text=True,
        env=dict(os.environ),
    )
    assert proc.returncode == 0, proc.stderr
    assert "samples={'openai_humaneval': 14" in proc.stdout
    assert "| MMLU-Pro | 14 of 12032 |" in proc.stdout
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "edge0_eval",
            "plan",
            str(CONFIGS / "edge0_35b.py"),
            "--size-gate",
        ],
        capture_output=True,
        text=True,
        env=dict(os.environ),
    )
    assert proc.returncode == 2 and "not a gate config" in proc.stderr


def test_progress_weighs_items_by_their_expected_length(aime_root, tmp_path):
    cfg = load_config(CONFIGS / "edge0_35b_gate.py")
    student = cfg["models"][-1]
    datasets = [_aime(10)] + [d for d in cfg["datasets"] if d["abbr"] == "GPQA_diamond"]
    specs = task_specs(
        dict(student, chat_template_kwargs={"enable_thinking": True}),
        datasets,
        str(tmp_path),
    )
    assert [s["datasets"][s["index"]]["items"] for s in specs] == [10, 14]
    weights = [r["weight"] for r in specs[0]["datasets"]]
    assert weights == [
        1024,
        1024,
    ]  # thinking-on priors, capped at the gate's max_out_len
    first = Progress(specs[0])
    state = first.add(5)
    assert (state["items"], state["total"]) == (5, 24)
    assert state["eta_s"] == pytest.approx(state["elapsed_s"] * 19 / 5)
    second = Progress(specs[1])
    assert second.started == first.started  # the task's start, from the file
    state = second.add(14)
    assert state["items"] == 24 and state["eta_s"] == 0.0
    assert (
        "progress edge0-35b-student: 24/24 items (100.0%), GPQA_diamond 14/14"
        in line(state)
    )


def test_chunked_arm_progress_sums_its_tasks(tmp_path, monkeypatch):
    """NumWorker chunks of one arm run side by side: each task writes its own file with its own
    slice of the fidelity set, and the arm's line sums them (before: every chunk counted the
    whole set and they overwrote one file)."""
    from mmengine.config import Config

    from edge0_eval.evaluation.data.fixtures import write_fixtures
    from edge0_eval.evaluation.fidelity.sets import SET_PATH
    from edge0_eval.evaluation.plan.progress import read_lines
    from model_wrappers.partitioners.partitioner import Edge0NumWorkerPartitioner

    data = tmp_path / "data"
    write_fixtures(data)
    items = [
        {
            "id": f"t/{n}",
            "source": "text",
            "prompt": "p",
            "prompt_ids": [1, 2, 3],
            "tokens": [4, 5],
            "topk_ids": [[4, 6], [5, 7]],
            "topk_logprobs": [[-0.1, -2.5], [-0.2, -3.0]],
            "rest": [0.05, 0.1],
            "end": "stop",
        }
        for n in range(10)
    ]
    (data / SET_PATH).parent.mkdir(parents=True, exist_ok=True)
    (data / SET_PATH).write_text(json.dumps(fidelity_set(items, dtype=None)))
    for key, value in dict(
        COMPASS_DATA_CACHE=str(data), EDGE0_ARMS="teacher", EDGE0_TINY_TEACHER="unused"
    ).items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(tmp_path)
    cfg = Config.fromfile(str(CONFIGS / "edge0_tiny.py"))
    datasets = [d for d in cfg["datasets"] if d["abbr"] == "edge0_fidelity"]
    part = Edge0NumWorkerPartitioner(
        out_dir=str(tmp_path / "w" / "predictions"),
        num_worker=3,
        min_task_size=1,
        full_data=False,
        check_models=False,
        dataset_size_path=str(tmp_path / "sizes.json"),
    )
    tasks = part(
        Config(
            dict(models=cfg["models"], datasets=datasets, work_dir=str(tmp_path / "w"))
        )
    )
    specs = [t["datasets"][0][0]["infer_cfg"]["inferencer"]["progress"] for t in tasks]
    assert len(specs) == 3 and len({s["file"] for s in specs}) == 3
    sizes = [s["datasets"][0]["items"] for s in specs]
    assert sum(sizes) == 10 and all(s["arm_items"] == 10 for s in specs)
    first, second = Progress(specs[0]), Progress(specs[1])
    first.add(sizes[0])
    second.add(1)
    (text,) = read_lines(tmp_path / "w")
    assert text.startswith(
        f"progress edge0-tiny-teacher: {sizes[0] + 1}/10 items "
        f"({10 * (sizes[0] + 1):.1f}%), chunks done 1/3"
    ), text


def test_chunk_progress_of_an_arm_whose_name_has_a_dot(tmp_path):
    """`qwen3.6-35b` has a suffix to pathlib: its chunk folder must still be read."""
    from edge0_eval.evaluation.plan.progress import read_lines, shard_specs

    rows = [dict(dataset="d", items=4, weight=1.0)]
    groups = [
        [
            dict(
                arm="qwen3.6-35b",
                file=str(tmp_path / "progress" / "qwen3.6-35b.json"),
                index=0,
                datasets=rows,
            )
        ]
        for _ in range(2)
    ]
    shard_specs(groups)
    Progress(groups[0][0]).add(4)
    (text,) = read_lines(tmp_path)
    assert text.startswith(
        "progress qwen3.6-35b: 4/8 items (50.0%), chunks done 1/2"
    ), text


def test_gate_sizing_takes_a_measured_fidelity_rate(aime_root, tmp_path):
    """--size-gate --fidelity-rate: the fidelity part costs the config's positions at the
    measured rate (and says so); without it, the config's rate is stated as assumed."""
    import json

    from edge0_eval.evaluation.plan.planner import (
        FIDELITY_BENCH_FORMAT,
        read_fidelity_rate,
    )

    bench = tmp_path / "bench.json"
    bench.write_text(
        json.dumps(
            {
                "format": FIDELITY_BENCH_FORMAT,
                "rates": {
                    "layer-major": {
                        "prompt_tokens_per_s": 80.0,
                        "positions_per_s": 64.0,
                    }
                },
            }
        )
    )
    declared = size_gate(CONFIGS / "edge0_35b_gate.py")
    assert declared.fidelity_source.startswith("ASSUMED 200 positions/s")
    measured = size_gate(
        CONFIGS / "edge0_35b_gate.py", fidelity_rate=read_fidelity_rate(bench)
    )
    assert measured.seconds["fidelity"] == pytest.approx(102400 / 64.0)
    assert measured.fidelity_source.startswith("measured, 64 positions/s")
    # Slower fidelity leaves less of the hour to the benchmarks.
    assert measured.seconds["benchmarks"] < declared.seconds["benchmarks"]
