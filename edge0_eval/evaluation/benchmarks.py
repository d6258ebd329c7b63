"""The benchmarks this project stages, scores and reports: one entry each, read by every
consumer (data staging and checks, the OpenCompass output reader, the partitioner's
preflight), so a benchmark's names, data path and result pattern are written once.

The lowest layer of the evaluation package: it imports none of it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Benchmark:
    name: str  # the report's headline name
    prefixes: tuple[str, ...]  # dataset abbr prefixes (case-insensitive)
    metric: str | None  # results-file metric; None: pick like the summarizer
    # detail key holding per-item correctness; None: generic
    item_key: str | None = None
    pooled: bool = False  # several datasets (categories) pooled per question
    extra: tuple[tuple[str, str], ...] = ()  # (metric, detail key) reported alongside
    key: str | None = None  # staged name (`data stage --benchmarks`); None: none
    # relative to the data root, where OpenCompass 0.5.4 looks
    data_path: str | None = None
    # what the headline measures per sample (report, refs)
    definition: str | None = None
    pass_at_k: bool = False  # the benchmark defines pass@k (reported for n > 1)


# The five paper benchmarks. IFBench's headline is prompt-level strict accuracy (what its
# `is_correct` holds); loose is reported too. MMLU-Pro is 14 category datasets, pooled per
# question (the official figure), not the summarizer's mean of categories.
BENCHMARKS: tuple[Benchmark, ...] = (
    Benchmark(
        "AIME 2026",
        ("aime2026",),
        "accuracy",
        key="aime2026",
        data_path="data/aime2026/aime2026.jsonl",
        definition="accuracy",
    ),
    Benchmark(
        "HumanEval",
        ("openai_humaneval", "humaneval"),
        "humaneval_pass@1",
        key="humaneval",
        data_path="data/humaneval/human-eval-v2-20210705.jsonl",
        definition="pass@1",
        pass_at_k=True,
    ),
    Benchmark(
        "GPQA-Diamond",
        ("gpqa_diamond",),
        "accuracy",
        key="gpqa",
        data_path="data/gpqa/gpqa_diamond.csv",
        definition="accuracy",
    ),
    Benchmark(
        "MMLU-Pro",
        ("mmlu_pro_",),
        "accuracy",
        pooled=True,
        key="mmlu_pro",
        data_path="data/mmlu_pro",
        definition="accuracy pooled per question",
    ),
    Benchmark(
        "IFBench",
        ("ifbench",),
        "Prompt-level-strict-accuracy",
        "is_strict_correct",
        extra=(("Prompt-level-loose-accuracy", "is_loose_correct"),),
        key="ifbench",
        data_path="data/IFBench/IFBench_test.jsonl",
        definition="prompt-level strict accuracy",
    ),
)
BY_KEY = {b.key: b for b in BENCHMARKS}


def benchmark_for(dataset: str) -> Benchmark:
    """The benchmark a dataset abbr belongs to; an unknown dataset is its own benchmark."""
    low = dataset.lower()
    for bench in BENCHMARKS:
        if any(low.startswith(p) for p in bench.prefixes):
            return bench
    return Benchmark(dataset, (dataset,), None)
