"""A gate sample, and the rounds a sequential gate run scores it in.

A gate config samples each benchmark dataset with OpenCompass's own `reader_cfg.test_range` as
an int K: `load_partial_dataset` (opencompass/openicl/icl_dataset_reader.py) shuffles the row
positions with `random.Random(K)` and keeps the first K, in that shuffled order. The draw
depends only on K and the dataset's size, so every arm, run and machine with the same data file
gets the same items in the same order; it is not nested (K and K + 1 draw unrelated samples),
and with a dataset `n` > 1 it would draw copies, not items (refused here).

A sequential run scores that order in rounds of growing prefixes. Round r of rounds
[f_1, ..., 1.0] (cumulative shares) infers positions [ceil(f_{r-1} K), ceil(f_r K)) of the
draw as chunk `<abbr>_<c>` (c counts the rounds that added items), which OpenCompass's
OpenICLEvalTask reads back in order (`<abbr>_0.json`, `_1`, ... as for NumWorkerPartitioner's
chunks), and evaluates the whole prefix [0, ceil(f_r K)) as `<abbr>`: every round's scores
are a complete evaluation of a complete prefix, never a partial file scored as whole. Both
are OpenCompass test ranges over the row positions: "[:0] + [p, q, ...]" (its test_range
strings are Python index expressions applied to the position list).

The order the rounds take the sample in is drawn afresh for every gate run: `gate-run
--sequential` draws an order seed before round 1, records it and passes it to every round
(EDGE0_GATE_SEED) and to the gate, and the rounds take the draw in the order run_order gives
for that seed. So which items a round holds, and the order the sequential tests see them in,
is a uniform random permutation per run, whatever items a change harms: a fixed order would
make the tests' guarantee hold only on average over orders (a change that harms the items
early in a fixed order fails every run). Reports name items by their row in the dataset
(OpenCompass numbers rows before it selects the test range), so a round's items pair with the
baseline's whatever the order.
"""

from __future__ import annotations

import copy
import math
import random
from pathlib import Path

from edge0_eval.errors import ConfigError


def sample_size(dataset: dict) -> int | None:
    """The K of a dataset sampled by an int test_range; None when it is not."""
    size = (dataset.get("reader_cfg") or {}).get("test_range")
    if isinstance(size, bool) or not isinstance(size, int):
        return None
    return size


def check_rounds(rounds) -> list[float]:
    shares = list(rounds or [])
    if (
        not shares
        or any(isinstance(f, bool) or not isinstance(f, (int, float)) for f in shares)
        or any(not 0 < f <= 1 for f in shares)
        or shares != sorted(set(shares))
        or shares[-1] != 1
    ):
        raise ConfigError(
            f"gate rounds {rounds!r}: give increasing cumulative shares in (0, 1] "
            f"ending at 1.0, e.g. [0.125, 0.25, 0.5, 1.0]"
        )
    return [float(f) for f in shares]


def bounds(
    size: int, rounds: list[float], round_no: int
) -> tuple[int, int, int | None]:
    """(first, end, chunk) of round `round_no` (1-based) on a sample of `size`: the positions
    of the draw it infers are [first, end); chunk is its file number (None: adds no items)."""
    ends = [math.ceil(f * size) for f in rounds]
    first = ends[round_no - 2] if round_no > 1 else 0
    end = ends[round_no - 1]
    earlier = [0] + ends[: round_no - 1]
    chunk = sum(1 for a, b in zip(earlier, ends[:round_no]) if b > a) - 1
    return first, end, chunk if end > first else None


def run_order(size: int, seed: str, abbr: str) -> list[int]:
    """The positions of a dataset's sample of `size` in the order a gate run with this order
    seed takes it (seed "": the draw's own order, as a whole-sample run)."""
    positions = list(range(size))
    if seed:
        random.Random(f"{seed}/{abbr}").shuffle(positions)
    return positions


def index_expression(positions: list[int]) -> str:
    """An OpenCompass test_range selecting exactly these row positions, in this order."""
    return "[:0] + [" + ", ".join(str(p) for p in positions) + "]"


def draw(dataset: dict) -> list[int]:
    """The row positions the dataset's int test_range selects, in OpenCompass's order."""
    from datasets import Dataset
    from opencompass.openicl.icl_dataset_reader import load_partial_dataset
    from opencompass.utils import build_dataset_from_cfg

    if int(dataset.get("n", 1)) != 1:
        raise ConfigError(
            f"dataset {dataset.get('abbr')}: an int test_range with n > 1 draws "
            f"copies, not items; sample items with n = 1"
        )
    whole = copy.deepcopy(dataset)
    for key in ("abbr", "infer_cfg", "eval_cfg"):
        whole.pop(key, None)
    whole["reader_cfg"].pop("test_range", None)
    rows = len(build_dataset_from_cfg(whole).test)
    positions = Dataset.from_dict({"position": list(range(rows))})
    return list(
        load_partial_dataset(positions, size=dataset["reader_cfg"]["test_range"])[
            "position"
        ]
    )


def round_datasets(
    datasets: list[dict],
    rounds: list[float],
    round_no: int,
    stage: str,
    predictions: Path | None = None,
    seed: str = "",
) -> list[dict]:
    """The datasets of round `round_no` for OpenCompass's infer or eval stage, the sample taken
    in the order of the run's order seed (run_order). Datasets that are not sampled (fidelity)
    pass unchanged: the first round scores them whole and later rounds find their outputs
    done."""
    if not 1 <= round_no <= len(rounds):
        raise ConfigError(
            f"gate round {round_no}: the config has rounds 1..{len(rounds)}"
        )
    out = []
    for dataset in datasets:
        size = sample_size(dataset)
        if size is None:
            out.append(dataset)
            continue
        drawn = draw(dataset)
        order = [drawn[j] for j in run_order(len(drawn), seed, dataset["abbr"])]
        first, end, chunk = bounds(len(order), rounds, round_no)
        cfg = copy.deepcopy(dataset)
        if stage == "infer":
            if chunk is None:
                continue
            cfg["abbr"] = f"{dataset['abbr']}_{chunk}"
            cfg["reader_cfg"]["test_range"] = index_expression(order[first:end])
        else:
            # Round 1 always adds items (ceil), so every round has read chunk 0 at least.
            chunks = 1 + max(
                c
                for r in range(1, round_no + 1)
                if (c := bounds(len(order), rounds, r)[2]) is not None
            )
            if predictions is not None:
                stale_chunks(predictions, dataset["abbr"], chunks)
            cfg["reader_cfg"]["test_range"] = index_expression(order[:end])
        out.append(cfg)
    return out


def stale_chunks(predictions: Path, abbr: str, chunks: int) -> None:
    """Refuse prediction files the eval task would read beyond this round's chunks (or a whole
    file it would read instead of them): they come from another run in the same folder."""
    for model in (
        sorted(p for p in predictions.iterdir() if p.is_dir())
        if predictions.is_dir()
        else []
    ):
        extra = [model / f"{abbr}.json", model / f"{abbr}_{chunks}.json"]
        found = [p for p in extra if p.exists()]
        if found:
            raise ConfigError(
                f"{found[0]}: not a chunk of this gate run's {chunks} round(s); "
                f"start the gate run in a fresh work folder"
            )
