"""`edge0-eval plan`: item counts, token priors, measured lengths and rates, power, errors."""

import json
import os
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest

from edge0_eval.errors import Edge0Error
from edge0_eval.evaluation.data.fixtures import write_fixtures
from edge0_eval.evaluation.fidelity.sets import SET_PATH
from edge0_eval.evaluation.plan.planner import PlanOptions, make_plan, render
from edge0_eval.evaluation.plan.run_config import PRIOR_TOKENS, PUBLISHED_ITEMS
from edge0_eval.evaluation.significance.paired import detectable_drop

ROOT = Path(__file__).resolve().parent.parent
TIER = ROOT / "configs" / "edge0_35b.py"
TINY = ROOT / "configs" / "edge0_tiny.py"
TINY_ARMS = "teacher,student"


@pytest.fixture
def tier_env(tmp_path, monkeypatch):
    """The 35B tier with its data not staged (an empty data root)."""
    root = tmp_path / "data-root"
    root.mkdir()
    monkeypatch.setenv("COMPASS_DATA_CACHE", str(root))
    monkeypatch.setenv("EDGE0_35B_TEACHER", str(tmp_path / "teacher"))
    monkeypatch.setenv("EDGE0_35B_STUDENT", str(tmp_path / "student"))
    monkeypatch.delenv("EDGE0_ARMS", raising=False)
    return root


@pytest.fixture(scope="module")
def fixture_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("fixture-data")
    write_fixtures(root)
    return root


@pytest.fixture
def tiny_env(fixture_root, tmp_path, monkeypatch):
    monkeypatch.setenv("COMPASS_DATA_CACHE", str(fixture_root))
    monkeypatch.setenv("EDGE0_TINY_TEACHER", str(tmp_path / "teacher"))
    monkeypatch.setenv("EDGE0_TINY_STUDENT", str(tmp_path / "student"))
    monkeypatch.setenv("EDGE0_ARMS", TINY_ARMS)
    return fixture_root


def test_tier_prior_without_data(tier_env):
    plan = make_plan(
        PlanOptions(config=TIER, tok_s=20.0, arm_tok_s={"edge0-35b-teacher": 60.0})
    )
    # Thinking on: every benchmark at its prior length, on the published sizes.
    expected = sum(
        PUBLISHED_ITEMS[l.dataset] * PRIOR_TOKENS[l.benchmark]
        for l in plan.lines
        if l.arm == "edge0-35b-student"
    )
    assert {l.tokens_source for l in plan.lines} == {"prior"}
    assert {l.items_source for l in plan.lines} == {"published"}
    assert plan.arms["edge0-35b-student"]["tokens"] == expected == 33_638_000
    assert plan.arms["edge0-35b-student"]["hours"] == pytest.approx(
        expected / 20 / 3600
    )
    assert plan.arms["edge0-35b-teacher"]["hours"] == pytest.approx(
        expected / 60 / 3600
    )
    # Power per benchmark, pooled over MMLU-Pro's categories.
    assert plan.power["MMLU-Pro"]["items"] == 12_032
    # At the gate's level for each test: alpha over 2 tests of each of the 5 benchmarks.
    assert plan.power["AIME 2026"]["detectable_drop"] == detectable_drop(
        30, 0.10, 0.05 / 10
    )
    assert (
        plan.power["MMLU-Pro"]["detectable_drop"]
        < plan.power["HumanEval"]["detectable_drop"]
    )
    # Nothing was fetched: OpenCompass would have created data/ while trying to download.
    assert list(tier_env.iterdir()) == []
    text = render(plan)
    assert "MMLU-Pro" in text and "19.5 days" in text


def test_tiny_counts_staged_data(tiny_env):
    plan = make_plan(PlanOptions(config=TINY, tok_s=10.0))
    aime = [
        json.loads(line)
        for line in (tiny_env / "data/aime2026/aime2026.jsonl").read_text().splitlines()
        if line.strip()
    ]
    lines = {(l.arm, l.dataset): l for l in plan.lines}
    line = lines[("edge0-tiny-student", "aime2026")]
    assert (line.items, line.items_source) == (len(aime), "data")
    # Thinking off: no prior applies, so max_out_len (24) is the per-sample bound.
    assert (line.tokens_per_sample, line.tokens_source) == (24, "limit")
    assert any("upper bound" in note for note in plan.notes)


def _stats_run(tmp_path: Path, rows_by_dataset: dict, wall: float) -> Path:
    run = tmp_path / "outputs" / "20261203_100000"
    for dataset, rows in rows_by_dataset.items():
        folder = run / "predictions" / "edge0-tiny-student"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{dataset}.engine_stats.json").write_text(json.dumps(rows))
    summary = run / "summary" / "summary_20261203_100000.csv"
    summary.parent.mkdir(parents=True)
    summary.write_text("dataset\n")
    start = datetime.strptime(run.name, "%Y%m%d_%H%M%S").timestamp()
    os.utime(summary, (start + wall, start + wall))
    return run


def test_previous_run_gives_lengths_rates_and_overhead(tiny_env, tmp_path):
    # Two calls of 2 rows (batch wall 4 s and 2 s) and one solo row (1 s): 7 s, 36 tokens.
    rows = [
        dict(tokens=10, batch_size=2, batch_wall_s=4.0, wall_s=3.9),
        dict(tokens=14, batch_size=2, batch_wall_s=4.0, wall_s=4.0),
        dict(tokens=4, batch_size=2, batch_wall_s=2.0, wall_s=1.0),
        dict(tokens=6, batch_size=2, batch_wall_s=2.0, wall_s=2.0),
        dict(tokens=2, batch_size=1, wall_s=1.0),
    ]
    run = _stats_run(tmp_path, {"aime2026": rows}, wall=107.0)
    plan = make_plan(PlanOptions(config=TINY, tok_s=1000.0, previous=run))
    lines = {(l.arm, l.dataset): l for l in plan.lines}
    line = lines[("edge0-tiny-student", "aime2026")]
    assert (line.tokens_per_sample, line.tokens_source) == (36 / 5, "measured")
    assert (line.tok_s, line.tok_s_source) == (36 / 7.0, "measured")
    # Another dataset of the same arm: no measured length, but the arm's measured rate.
    other = lines[("edge0-tiny-student", "openai_humaneval")]
    assert other.tokens_source == "limit" and other.tok_s_source == "measured (arm)"
    # The teacher had no stats: the declared rate.
    assert lines[("edge0-tiny-teacher", "aime2026")].tok_s == 1000.0
    # Overhead: the run's wall time (107 s) less the generation it measured (7 s), per arm.
    assert plan.arms["edge0-tiny-student"]["overhead_s"] == pytest.approx(100.0)


def test_fidelity_counts_prompts_at_the_rate_measured_with_them(
    tiny_env, tmp_path, monkeypatch
):
    # Measured on a long-form set: 100 prompt + 500 forced tokens per item in 60 s: 10 tokens/s
    # of scoring (8.3 positions/s). Planned: 4 items of 150 prompt + 50 forced tokens, which
    # cost mostly their prefills: 800 tokens, 80 s (counting positions alone: 24 s, as the
    # testbed's planner check found, 32% short).
    rows = [dict(prompt_tokens=100, tokens=500, wall_s=60.0) for _ in range(3)]
    run = _stats_run(tmp_path, {"edge0_fidelity": rows}, wall=200.0)
    root = tmp_path / "set-root"
    (root / SET_PATH).parent.mkdir(parents=True)
    (root / SET_PATH).write_text("{}")
    short = {"items": [dict(prompt_ids=[1] * 150, tokens=[2] * 50) for _ in range(4)]}
    monkeypatch.setattr("edge0_eval.evaluation.plan.run_config.data_root", lambda: root)
    monkeypatch.setattr(
        "edge0_eval.evaluation.plan.run_config.read_set", lambda path: short
    )
    plan = make_plan(PlanOptions(config=TINY, tok_s=1000.0, previous=run))
    line = {(l.arm, l.dataset): l for l in plan.lines}[
        ("edge0-tiny-student", "edge0_fidelity")
    ]
    assert (line.tok_s, line.tok_s_source) == (pytest.approx(10.0), "measured")
    assert line.tokens == 800 and line.tokens_source == "prompt + positions"
    assert line.hours * 3600 == pytest.approx(80.0)


def test_corrupt_previous_stats_is_one_error(tiny_env, tmp_path):
    run = _stats_run(tmp_path, {"aime2026": [dict(tokens=3, batch_size=0)]}, wall=10.0)
    with pytest.raises(
        Edge0Error, match="aime2026.engine_stats.json: row 0 has batch_size 0"
    ):
        make_plan(PlanOptions(config=TINY, tok_s=1.0, previous=run))
    bad = run / "predictions" / "edge0-tiny-student" / "aime2026.engine_stats.json"
    bad.write_text('{"tokens": NaN}')
    with pytest.raises(Edge0Error, match="aime2026.engine_stats.json"):
        make_plan(PlanOptions(config=TINY, tok_s=1.0, previous=run))


def test_config_that_stops_names_it(tmp_path, monkeypatch):
    monkeypatch.delenv("EDGE0_35B_TEACHER", raising=False)
    monkeypatch.delenv("EDGE0_35B_STUDENT", raising=False)
    with pytest.raises(
        Edge0Error, match=r"edge0_35b.py: .*EDGE0_35B_TEACHER is not set"
    ):
        make_plan(PlanOptions(config=TIER, tok_s=20.0))
    with pytest.raises(Edge0Error, match="config not found"):
        make_plan(PlanOptions(config=tmp_path / "nope.py", tok_s=20.0))


def test_cli(tiny_env, tmp_path):
    out = tmp_path / "plan.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "edge0_eval",
            "plan",
            str(TINY),
            "--tok-s",
            "50",
            "--arm-tok-s",
            "edge0-tiny-teacher=200",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        env=dict(os.environ),
    )
    assert proc.returncode == 0, proc.stderr
    assert "| edge0-tiny-teacher | AIME 2026 |" in proc.stdout
    data = json.loads(out.read_text())
    assert {l["tok_s"] for l in data["lines"] if l["arm"] == "edge0-tiny-teacher"} == {
        200.0
    }
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "edge0_eval",
            "plan",
            str(TINY),
            "--arm-tok-s",
            "teacher",
        ],
        capture_output=True,
        text=True,
        env=dict(os.environ),
    )
    assert proc.returncode == 2 and "'teacher' is not ABBR=VALUE" in proc.stderr
    assert "Traceback" not in proc.stderr


def _bench_file(tmp_path, **rates) -> Path:
    """A `fidelity bench --json` file with the layer-major scorer's rates."""
    from edge0_eval.evaluation.plan.planner import FIDELITY_BENCH_FORMAT

    path = tmp_path / "bench.json"
    path.write_text(
        json.dumps(
            {
                "format": FIDELITY_BENCH_FORMAT,
                "model": "S",
                "device": "Device(cpu, 0)",
                "dtype": "float32",
                "rates": {"layer-major": rates},
            }
        )
    )
    return path


def test_fidelity_rate_prices_prompts_and_positions_apart(
    tiny_env, tmp_path, monkeypatch
):
    """--fidelity-rate FILE: 4 items of 150 prompt + 50 forced tokens at 100 prompt tokens/s
    and 10 positions/s cost 600/100 + 200/10 = 26 s; without it the plan says it assumed the
    decode rate."""
    from edge0_eval.evaluation.plan.planner import read_fidelity_rate

    root = tmp_path / "set-root"
    (root / SET_PATH).parent.mkdir(parents=True)
    (root / SET_PATH).write_text("{}")
    short = {"items": [dict(prompt_ids=[1] * 150, tokens=[2] * 50) for _ in range(4)]}
    monkeypatch.setattr("edge0_eval.evaluation.plan.run_config.data_root", lambda: root)
    monkeypatch.setattr(
        "edge0_eval.evaluation.plan.run_config.read_set", lambda path: short
    )
    rate = read_fidelity_rate(
        _bench_file(tmp_path, prompt_tokens_per_s=100.0, positions_per_s=10.0)
    )
    plan = make_plan(PlanOptions(config=TINY, tok_s=1000.0, fidelity_rate=rate))
    line = {(l.arm, l.dataset): l for l in plan.lines}[
        ("edge0-tiny-student", "edge0_fidelity")
    ]
    assert line.hours * 3600 == pytest.approx(26.0)
    assert line.tok_s_source.startswith("measured, fidelity bench (bench.json")
    assert not any("ASSUMED" in n for n in plan.notes)
    assumed = make_plan(PlanOptions(config=TINY, tok_s=1000.0))
    line = {(l.arm, l.dataset): l for l in assumed.lines}[
        ("edge0-tiny-student", "edge0_fidelity")
    ]
    assert line.tok_s_source == "assumed: decode rate" and line.tok_s == 1000.0
    assert any("ASSUMED rate" in n and "--fidelity-rate" in n for n in assumed.notes)


@pytest.mark.parametrize(
    "content,message",
    [
        ('{"format": "other"}', "not a edge0-eval/fidelity-bench/v2 file"),
        (None, "no layer-major rates"),
        ("[1", "fidelity bench file is not valid JSON"),
        ("[]", "must be a JSON object"),
        ("missing", "fidelity bench file not found; make one with"),
    ],
)
def test_a_bad_fidelity_rate_file_is_one_error(tmp_path, content, message):
    from edge0_eval.evaluation.plan.planner import read_fidelity_rate

    path = _bench_file(tmp_path, prompt_tokens_per_s=1.0)  # no positions_per_s
    if content == "missing":
        path.unlink()
    elif content is not None:
        path.write_text(content)
    with pytest.raises(Edge0Error, match=message) as err:
        read_fidelity_rate(path)
    assert str(path) in str(err.value) or "bench.json" in str(err.value)
    assert isinstance(err.value, Edge0Error)
