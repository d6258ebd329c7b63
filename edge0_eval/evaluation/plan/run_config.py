"""An OpenCompass run config as this project reads it: the config itself (as `opencompass`
parses it), its arms' and datasets' abbreviations, the items of each dataset (built as
OpenCompass builds them when the data is staged, else the published size), a dataset's
test_range, the population a gate samples from, the fidelity set's cost, and the generated
tokens a sample is expected to cost. Read by the planner (planner.py), the progress lines
(progress.py), gate-run and the partitioners (model_wrappers/).
"""

from __future__ import annotations

import copy
import math
import re
from pathlib import Path

from edge0_eval.errors import ConfigError
from edge0_eval.evaluation.agreement import DATASET_ABBR as AGREEMENT_ABBR
from edge0_eval.evaluation.agreement import SET_PATH as AGREEMENT_PATH
from edge0_eval.evaluation.agreement import prompts as agreement_prompts
from edge0_eval.evaluation.benchmarks import benchmark_for
from edge0_eval.evaluation.data_paths import data_root
from edge0_eval.evaluation.fidelity.sets import SET_PATH, read_set
from edge0_eval.evaluation.gate.rounds import sample_size

# Typical generated tokens per answer with thinking on (Qwen3.6-class models; shared notes of
# 2026-12-02): the prior when no earlier run measured them. Keys: Benchmark.name.
PRIOR_TOKENS = {
    "AIME 2026": 20_000,
    "HumanEval": 3_000,
    "GPQA-Diamond": 8_000,
    "MMLU-Pro": 2_500,
    "IFBench": 3_000,
}
# Published sizes, used only when a dataset's data is not staged where the config looks.
PUBLISHED_ITEMS = {
    "aime2026": 30,
    "openai_humaneval": 164,
    "GPQA_diamond": 198,
    "IFBench": 294,
    "mmlu_pro_biology": 717,
    "mmlu_pro_business": 789,
    "mmlu_pro_chemistry": 1132,
    "mmlu_pro_computer_science": 410,
    "mmlu_pro_economics": 844,
    "mmlu_pro_engineering": 969,
    "mmlu_pro_health": 818,
    "mmlu_pro_history": 381,
    "mmlu_pro_law": 1101,
    "mmlu_pro_math": 1351,
    "mmlu_pro_other": 924,
    "mmlu_pro_philosophy": 499,
    "mmlu_pro_physics": 1299,
    "mmlu_pro_psychology": 798,
}


def load_config(path: Path):
    """The config as `opencompass` reads it; a config that stops (a missing variable) or fails
    to parse is one error naming the file."""
    from mmengine.config import Config  # the [eval] extra: imported only when read

    if not path.is_file():
        raise ConfigError(
            f"{path}: config not found; give an OpenCompass config such as "
            f"configs/edge0_35b.py"
        )
    try:
        return Config.fromfile(str(path))
    except SystemExit as exc:  # the tier configs stop on a missing EDGE0_* variable
        raise ConfigError(
            f"{path}: {exc} (the planner reads the config as opencompass does; "
            f"any existing path will do for planning)"
        ) from None
    except Exception as exc:
        raise ConfigError(
            f"{path}: cannot read the config ({type(exc).__name__}: {exc})"
        ) from None


def dataset_abbr(cfg) -> str:
    from opencompass.utils import dataset_abbr_from_cfg

    return dataset_abbr_from_cfg(cfg)


def count_items(cfg) -> tuple[int, str]:
    """(items, where the count came from): built as OpenCompass builds it when its data is
    staged, else the published size (a gate sample: its int test_range of that). A benchmark
    whose data file is missing is never built: OpenCompass would try to download it."""
    from opencompass.utils import build_dataset_from_cfg

    abbr = dataset_abbr(cfg)
    bench = benchmark_for(abbr)
    if abbr == AGREEMENT_ABBR and not (data_root() / AGREEMENT_PATH).is_file():
        return _sampled(cfg, len(agreement_prompts())), "prompts"
    staged = bench.data_path is None or (data_root() / bench.data_path).exists()
    if not staged and abbr in PUBLISHED_ITEMS:
        return _sampled(cfg, PUBLISHED_ITEMS[abbr]), "published"
    if not staged:
        raise ConfigError(
            f"dataset {abbr}: {data_root() / bench.data_path} not found; stage "
            f"it (`edge0-eval data stage`) and point COMPASS_DATA_CACHE at it"
        )
    try:
        return len(build_dataset_from_cfg(cfg).test) // int(cfg.get("n", 1)), "data"
    except Exception as exc:
        raise ConfigError(
            f"dataset {abbr}: its data could not be read ({type(exc).__name__}: "
            f"{str(exc)[:200]}); check the files under {data_root()}"
        ) from None


def _sampled(cfg, items: int) -> int:
    """What OpenCompass's int test_range K leaves of `items` (load_partial_dataset: K when
    0 < K < items, else all)."""
    size = sample_size(cfg)
    return size if size is not None and 0 < size < items else items


def test_range_slice(dataset: dict) -> slice | None:
    """A dataset's `reader_cfg.test_range` ('[a:b]', as OpenCompass slices it; NumWorker
    chunks are such ranges) as a slice."""
    text = (dataset.get("reader_cfg") or {}).get("test_range")
    if not text:
        return None
    match = re.fullmatch(r"\[\s*(-?\d*)\s*:\s*(-?\d*)\s*\]", str(text))
    if not match:
        return None  # another form: check every item, as without a range
    start, stop = (int(v) if v else None for v in match.groups())
    return slice(start, stop)


def population(cfg) -> tuple[int, str]:
    """count_items of the dataset without its test_range: the items a gate samples from."""
    whole = copy.deepcopy(cfg)
    whole["reader_cfg"] = {
        k: v for k, v in whole["reader_cfg"].items() if k != "test_range"
    }
    return count_items(whole)


def fidelity_counts(part: slice | None = None) -> tuple[int, int, int] | None:
    """(items, prompt tokens, teacher-forced positions) of the staged fidelity set, or of its
    items `part` (a chunk's test_range); None when none is staged."""
    path = data_root() / SET_PATH
    if not path.is_file():
        return None
    items = read_set(path)["items"][part or slice(None)]
    return (
        len(items),
        sum(len(item["prompt_ids"]) for item in items),
        sum(len(item["tokens"]) for item in items),
    )


def fidelity_tokens(part: slice | None = None) -> tuple[int, int] | None:
    """(items, tokens the scorer runs: prompts + teacher-forced positions) of the staged fidelity
    set, or of its items `part`; None when none is staged. Prompts count: a set of short
    continuations after long prompts costs mostly its prefills."""
    counts = fidelity_counts(part)
    return None if counts is None else (counts[0], counts[1] + counts[2])


def thinking_on(model_cfg) -> bool:
    kwargs = model_cfg.get("chat_template_kwargs") or {}
    return bool(kwargs.get("enable_thinking", False))


def arm_abbr(model_cfg) -> str:
    return model_cfg.get("abbr") or Path(model_cfg["path"]).name


def tokens_per_sample(
    model_cfg,
    abbr: str,
    measured: dict[tuple[str, str], float] | None = None,
    positions: int | None = None,
    items: int = 1,
) -> tuple[float, str]:
    """Expected generated tokens per sample of dataset `abbr` on this model, and their source:
    a fidelity set's positions; measured by an earlier run (`measured`: (arm, dataset) -> mean
    tokens per sample, the planner's Measured.tokens); the thinking-on prior capped at
    max_out_len; else max_out_len itself (an upper bound)."""
    arm, limit = arm_abbr(model_cfg), int(model_cfg.get("max_out_len") or 0)
    bench = benchmark_for(abbr).name
    if positions is not None:
        return positions / max(items, 1), "prompt + positions"
    if measured and (arm, abbr) in measured:
        return min(measured[(arm, abbr)], limit or math.inf), "measured"
    if thinking_on(model_cfg) and bench in PRIOR_TOKENS:
        return min(PRIOR_TOKENS[bench], limit or math.inf), "prior"
    return float(limit), "limit"
