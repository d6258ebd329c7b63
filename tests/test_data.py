"""`edge0-eval data`: offline staging, verification, NLTK data, and scorers on staged data."""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from edge0_eval.errors import Edge0Error
from edge0_eval.evaluation import data_paths
from edge0_eval.evaluation.data import checks as data_checks
from edge0_eval.evaluation.data import nltk_data
from edge0_eval.evaluation.data import staging as data_staging
from edge0_eval.evaluation.data.fixtures import (
    MMLU_PRO_FIXTURE_CATEGORIES,
    write_fixtures,
)

REPO = Path(__file__).resolve().parent.parent


def _script(name: str) -> str:
    path = Path(sys.executable).parent / name
    return str(path) if path.exists() else shutil.which(name)


@pytest.fixture(scope="module")
def staged(tmp_path_factory):
    """HumanEval and IFBench (with NLTK data) staged from the installed PyPI packages."""
    root = tmp_path_factory.mktemp("staged")
    actions, checks = data_staging.stage(root, ("humaneval", "ifbench"))
    return root, {c.benchmark: c for c in checks}


def _in_fresh_python(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **env},
    )


# --- staging and verification ----------------------------------------------------------------
def test_stage_writes_humaneval_and_ifbench_from_pypi_packages(staged):
    root, checks = staged
    assert checks["humaneval"].ok and checks["humaneval"].count == 164
    lines = (
        (root / "data/humaneval/human-eval-v2-20210705.jsonl").read_text().splitlines()
    )
    assert json.loads(lines[0])["task_id"] == "HumanEval/0" and len(lines) == 164
    assert checks["ifbench"].count == 294
    if not checks["ifbench"].ok:
        # No PyPI package ships NLTK's POS tagger: without a user copy, stage must say so.
        assert "averaged_perceptron_tagger_eng" in checks["ifbench"].message
        assert "words:start_verb" in checks["ifbench"].message
        assert "punkt" not in checks["ifbench"].message.split("missing")[-1]


def test_staging_ifbench_never_imports_its_code(tmp_path):
    proc = _in_fresh_python(f"""
        import sys
        from edge0_eval.evaluation.data.staging import stage_ifbench
        stage_ifbench(__import__("pathlib").Path({str(tmp_path)!r}))
        assert "ifbench" not in sys.modules and "spacy" not in sys.modules, "imported"
    """)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_staged_nltk_data_loads_in_a_fresh_process(staged):
    root, _ = staged
    proc = _in_fresh_python(f"""
        import nltk
        nltk.data.path[:] = [{str(root / "nltk_data")!r}]
        assert nltk.sent_tokenize("Dr. Smith went to Washington. He slept.") == [
            "Dr. Smith went to Washington.", "He slept."]
        assert nltk.word_tokenize("Don't stop.") == ["Do", "n't", "stop", "."]
        words = nltk.corpus.stopwords.words("english")
        assert len(words) == 198 and "the" in words
    """)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_stage_cli_says_what_is_missing_and_where_it_goes(tmp_path):
    proc = subprocess.run(
        [_script("edge0-eval"), "data", "stage", "--root", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stderr
    out = proc.stdout
    for rel, flag in (
        ("data/aime2026/aime2026.jsonl", "--aime2026 FILE"),
        ("data/gpqa/gpqa_diamond.csv", "--gpqa FILE"),
        ("data/mmlu_pro", "--mmlu-pro"),
    ):
        line = next(l for l in out.splitlines() if rel in l)
        assert "[MISSING]" in line and flag in line and str(tmp_path) in line
    assert "[ok] humaneval" in out
    assert "not ready: aime2026, gpqa, mmlu_pro" in proc.stderr


def test_fixtures_pass_subset_checks_but_not_full_ones(tmp_path):
    write_fixtures(tmp_path)
    assert all(c.ok for c in data_checks.verify(tmp_path, full=False))
    full = {c.benchmark: c for c in data_checks.verify(tmp_path, full=True)}
    assert not any(c.ok for c in full.values())
    assert "has 2 items, the full benchmark has 30" in full["aime2026"].message
    assert "has 3 items, the full benchmark has 12032" in full["mmlu_pro"].message


def _mmlu_rows(n_per_category, categories=data_checks.MMLU_PRO_CATEGORIES):
    rows = []
    for cat in categories:
        for i in range(n_per_category):
            rows.append(
                dict(
                    question_id=len(rows),
                    question=f"q{i}",
                    options=["a", "b"],
                    answer="A",
                    answer_index=0,
                    cot_content="",
                    category=cat,
                    src="x",
                )
            )
    return rows


def _write_parquet(path: Path, rows, drop=()):
    import pyarrow as pa
    import pyarrow.parquet as pq

    cols = {
        k: [r[k] for r in rows] for k in data_checks.MMLU_PRO_COLUMNS if k not in drop
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(cols), path)


def test_user_supplied_files_are_checked_and_placed(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    aime = src / "aime.jsonl"
    aime.write_text(
        "".join(
            json.dumps({"problem": f"p{i}", "answer": str(i)}) + "\n" for i in range(30)
        )
    )
    gpqa = src / "gpqa_diamond.csv"
    header = (
        ",".join(f"c{i}" for i in range(7)) + ",Question,Correct Answer,"
        "Incorrect Answer 1,Incorrect Answer 2,Incorrect Answer 3\n"
    )
    gpqa.write_text(
        header + "".join(",,,,,,,Q{0},R,W1,W2,W3\n".format(i) for i in range(198))
    )
    _write_parquet(src / "mmlu" / "test-00000-of-00001.parquet", _mmlu_rows(1))
    _write_parquet(src / "mmlu" / "validation-00000-of-00001.parquet", _mmlu_rows(5))
    root = tmp_path / "root"
    _, checks = data_staging.stage(
        root,
        ("aime2026", "gpqa", "mmlu_pro"),
        aime2026=str(aime),
        gpqa=str(gpqa),
        mmlu_pro=[str(src / "mmlu")],
    )
    checks = {c.benchmark: c for c in checks}
    assert (root / "data/aime2026/aime2026.jsonl").read_text() == aime.read_text()
    assert checks["aime2026"].ok and checks["gpqa"].ok and checks["gpqa"].count == 198
    # 14 test rows instead of 12032: placed, but refused as incomplete.
    assert not checks["mmlu_pro"].ok and "has 14 items" in checks["mmlu_pro"].message
    assert checks["mmlu_pro"].count == 14
    assert all(
        c.ok
        for c in data_checks.verify(root, ("aime2026", "gpqa", "mmlu_pro"), full=False)
    )


@pytest.mark.parametrize(
    "benchmark, content, message",
    [
        ("aime2026", '{"problem": "x"}\n', 'lack "problem" or "answer"'),
        ("aime2026", "not json\n", "cannot be read"),
        ("gpqa", "Question,Correct Answer\nq,a\n", "column 7 = 'Question'"),
    ],
)
def test_malformed_user_files_are_refused(tmp_path, benchmark, content, message):
    path = tmp_path / data_paths.PATHS[benchmark]
    path.parent.mkdir(parents=True)
    path.write_text(content)
    (check,) = data_checks.verify(tmp_path, (benchmark,), full=False)
    assert not check.ok and message in check.message


def test_mmlu_pro_parquet_columns_and_splits_are_checked(tmp_path):
    base = tmp_path / data_paths.PATHS["mmlu_pro"] / "data"
    _write_parquet(
        base / "test-00000-of-00001.parquet", _mmlu_rows(1), drop=("cot_content",)
    )
    (check,) = data_checks.verify(tmp_path, ("mmlu_pro",), full=False)
    assert not check.ok and "no validation parquet" in check.message
    _write_parquet(base / "validation-00000-of-00001.parquet", _mmlu_rows(1))
    (check,) = data_checks.verify(tmp_path, ("mmlu_pro",), full=False)
    assert not check.ok and "missing columns ['cot_content']" in check.message


def test_fixture_categories_match_the_tiny_config():
    tree = ast.parse((REPO / "configs" / "edge0_tiny.py").read_text())
    (value,) = [
        node.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        and ast.unparse(node.targets[0]) == "tiny_mmlu_pro"
    ]
    listed = [f"mmlu_pro_{c.replace(' ', '_')}" for c in MMLU_PRO_FIXTURE_CATEGORIES]
    assert ast.literal_eval(value) == listed


# --- scorers on staged real data ---------------------------------------------------------------
def _bundle_dataset(abbr: str):
    from mmengine.config import Config

    cfg = Config.fromfile(str(REPO / "configs" / "datasets" / "edge0_bundle.py"))
    return next(d for d in cfg["edge0_datasets"] if d["abbr"] == abbr)


def _build_scorer(dataset_cfg):
    from opencompass.registry import ICL_EVALUATORS, TEXT_POSTPROCESSORS

    evaluator = ICL_EVALUATORS.build(dict(dataset_cfg["eval_cfg"]["evaluator"]))
    post = dataset_cfg["eval_cfg"].get("pred_postprocessor")
    if post:
        post = dict(post)
        fn = post.pop("type")
        fn = TEXT_POSTPROCESSORS.get(fn) if isinstance(fn, str) else fn
        return evaluator, lambda text: fn(text, **post)
    return evaluator, lambda text: text


def test_humaneval_known_good_scores_full_and_known_bad_zero(staged, monkeypatch):
    root, _ = staged
    monkeypatch.setenv("COMPASS_DATA_CACHE", str(root))
    from opencompass.datasets import HumanevalDataset

    cfg = _bundle_dataset("openai_humaneval")
    rows = HumanevalDataset.load(cfg["path"]).to_list()
    assert len(rows) == 164
    evaluator, post = _build_scorer(cfg)
    refs = [r["task_id"] for r in rows]

    def answer(r, body):  # what a chat model writes: one fenced block with the function
        return post(f"Here it is:\n```python\n{r['prompt']}{body}```\n")

    good = evaluator.score(
        [answer(r, r["canonical_solution"]) for r in rows], refs, rows
    )
    assert good["humaneval_pass@1"] == pytest.approx(100.0)
    bad = evaluator.score(
        [answer(r, "    raise NotImplementedError\n") for r in rows], refs, rows
    )
    assert bad["humaneval_pass@1"] == 0.0
    assert all(not d["passed"] for d in bad["details"].values())


# Real IFBench prompts (by key) and responses that follow / break their one instruction. The
# first three need NLTK data (stopwords, punkt_tab) or the emoji package.
IFBENCH_GOOD = {
    "172": "Use os.path.basename(filepath) or pathlib.Path(filepath).name.",  # ratio:stop_words
    "14": "A vibrant city glows under a sky, vibrant .",  # words:words_position
    "288": "The Buckeye Republic Rules Columbus. Lake Erie Raiders Patrol Toledo.",  # title_case
    "65": "Bonds endure 🤝. Affection remains ❤️.",  # format:emoji
    "42": " ".join(f"word{i}" for i in range(59)),  # word_count_range
    "17": "Yes: 2 hard winters and 3 droughts built resilience.",  # count:numbers
    "296": "Notallsetsareclasses;everysetisaclass.",  # no_whitespace
}


def test_ifbench_known_good_scores_full_and_known_bad_zero(staged):
    root, _ = staged
    rows = {
        r["key"]: r
        for r in map(json.loads, (root / data_paths.PATHS["ifbench"]).open())
    }
    refs = [rows[k] for k in IFBENCH_GOOD]
    prompts = [r["prompt"] for r in refs]
    evaluator, _ = _build_scorer(_bundle_dataset("IFBench"))
    evaluator.nltk_data = str(root / "nltk_data")
    metrics = (
        "Prompt-level-strict-accuracy",
        "Inst-level-strict-accuracy",
        "Prompt-level-loose-accuracy",
        "Inst-level-loose-accuracy",
    )
    good = evaluator.score(list(IFBENCH_GOOD.values()), refs, prompts)
    assert [good[m] for m in metrics] == [100.0] * 4
    bad = evaluator.score(
        ["I cannot help with that request, sorry."] * len(refs), refs, prompts
    )
    assert [bad[m] for m in metrics] == [0.0] * 4


def test_ifbench_scorer_refuses_when_nltk_data_is_missing(staged, tmp_path):
    root, _ = staged
    empty = tmp_path / "nltk_empty"
    empty.mkdir()
    proc = _in_fresh_python(
        f"""
        import json, nltk
        nltk.data.path[:] = []
        from model_wrappers.evaluators.benchmark_evaluators import CheckedIFBenchEvaluator, ScorerUnavailable
        rows = {{}}
        for line in open({str(root / data_paths.PATHS["ifbench"])!r}):
            r = json.loads(line); rows[r['key']] = r
        refs = [rows['172'], rows['14']]
        try:
            CheckedIFBenchEvaluator(nltk_data={str(empty)!r}).score(['a b', 'c d'], refs, ['', ''])
        except ScorerUnavailable as exc:
            print(exc)
        else:
            raise SystemExit('scored without NLTK data')
    """,
        COMPASS_DATA_CACHE=str(tmp_path),
    )
    assert proc.returncode == 0, proc.stderr[-2000:] + proc.stdout
    assert "corpora/stopwords" in proc.stdout and "punkt_tab" in proc.stdout
    assert "words:words_position" in proc.stdout and "ratio:stop_words" in proc.stdout


def test_user_supplied_pos_tagger_is_copied_and_then_ifbench_is_complete(
    staged, tmp_path
):
    # A stand-in for NLTK's real averaged_perceptron_tagger_eng, in its file format
    # (weights, tagdict, classes as JSON).
    src = tmp_path / "nltk_data" / "taggers" / "averaged_perceptron_tagger_eng"
    src.mkdir(parents=True)
    weights, tagdict, classes = (
        {"bias": {"VB": 1.0}},
        {"Write": "VB", "it": "PRP"},
        ["VB", "PRP"],
    )
    for name, value in zip(nltk_data.TAGGER_FILES, (weights, tagdict, classes)):
        (src / name).write_text(json.dumps(value))

    root, _ = staged
    copy = tmp_path / "root"
    shutil.copytree(root / "data", copy / "data")
    notes = nltk_data.stage_nltk(copy / "nltk_data", str(tmp_path / "nltk_data"))
    assert any("copied" in n for n in notes)
    proc = _in_fresh_python(f"""
        from edge0_eval.evaluation.data.checks import verify
        (check,) = verify({str(copy)!r}, ("ifbench",), full=True)
        assert check.ok, check.message
    """)
    assert proc.returncode == 0, proc.stderr[-2000:]
    with pytest.raises(Edge0Error, match="no averaged_perceptron_tagger_eng"):
        nltk_data.stage_nltk(copy / "nltk_data", str(tmp_path))


def test_a_slice_of_ifbench_needs_only_its_own_checks(staged):
    """A run scoring IFBench[0:12] must not be refused for the POS tagger that only prompts
    257-262 (words:start_verb) need; a slice holding them still is."""
    root, _ = staged
    proc = _in_fresh_python(f"""
        import nltk
        nltk.data.path[:] = []
        from edge0_eval.evaluation.data.checks import verify
        (head,) = verify({str(root)!r}, ("ifbench",), full=True, ifbench_items=slice(0, 12))
        (tail,) = verify({str(root)!r}, ("ifbench",), full=True, ifbench_items=slice(250, 270))
        assert head.ok, head.message
        assert not tail.ok and "words:start_verb" in tail.message, tail.message
        assert "(20 scored)" in tail.message
    """)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_partitioner_reads_test_range_as_a_slice():
    from model_wrappers.partitioners.partitioner import test_range_slice

    assert test_range_slice({"reader_cfg": {"test_range": "[0:12]"}}) == slice(0, 12)
    assert test_range_slice({"reader_cfg": {"test_range": "[ 5 : ]"}}) == slice(5, None)
    assert test_range_slice({"reader_cfg": {}}) is None
    # check all
    assert test_range_slice({"reader_cfg": {"test_range": "[0:10:2]"}}) is None
