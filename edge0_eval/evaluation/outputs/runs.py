"""Read OpenCompass 0.5.4 output trees: per-item correctness, prompt versions, engine stats.

A run folder (`outputs/<name>/<timestamp>/`) holds
  results/<model>/<dataset>.json        metrics + per-item `details`
  predictions/<model>/<dataset>.json    or shards <dataset>_0.json, _1.json, ...
  summary/summary_<ts>.csv              dataset,version,metric,mode,<model>...  ('-' = failed)
  configs/<ts>_<pid>.py                 the dumped config (dataset prompt configs)

The datasets a run was meant to score come from the dumped config (else the summary rows and
the files present); every model is checked on each, because OpenCompass exits 0 even when tasks
fail: a missing or erroring results file is a failed task, never a skip. Prompt versions come
from the summary's `version` column, else from the config via OpenCompass's get_prompt_hash.
Engine stats: an "engine_stats" dict on each prediction, else predictions/<model>/<dataset>
[_<shard>].engine_stats.json (a list of such dicts).
"""

from __future__ import annotations

import copy
import csv
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from edge0_eval.errors import Edge0Error
from edge0_eval.evaluation.benchmarks import BENCHMARKS, Benchmark
from edge0_eval.evaluation.outputs.details import detail_items, replica_scores
from edge0_eval.evaluation.outputs.predictions import (
    engine_samples,
    engine_stats_problem,
    load_predictions,
    strict_loads,
)
from edge0_eval.evaluation.outputs.samples import record
from edge0_eval.evaluation.outputs.settings import data_digest, item_digests
from edge0_eval.evaluation.outputs.thinking import thinking_closed

# What the report reads from a dataset's predictions (and the engine stats beside them): without
# them these are not computed, and the dataset's status says so (no_predictions).
NEEDS_PREDICTIONS = (
    "truncation",
    "finish reasons",
    "thinking closure",
    "output tokens",
    "engine figures",
    "the check of the scores against what was generated",
)

# Per-item scores are in [0, 1]; reported metrics are percentages. Their mean must reproduce
# the reported metric to this many points, else the details are not what the metric counted.
METRIC_TOLERANCE = 1e-6


BENCHMARK_ORDER = [b.name for b in BENCHMARKS]
# Summary group rows of configs/datasets/edge0_bundle.py: averages, not datasets.
SUMMARY_GROUPS = {"mmlu_pro", "mmlu_pro_per_question"}

# The summarizer's metric preference (opencompass.summarizers.default.METRIC_WHITELIST).
_METRIC_PREFERENCE = [
    "score",
    "auc_score",
    "accuracy",
    "humaneval_pass@1",
    "rouge1",
    "avg_toxicity_score",
    "bleurt_diff",
    "matthews_correlation",
    "truth",
    "f1",
    "exact_match",
    "extract_rate",
]
_METRIC_IGNORED = {"bp", "sys_len", "ref_len", "type"}


# --------------------------------------------------------------------------- run folders


@dataclass
class Run:
    path: Path
    models: list[str]
    datasets: list[str]
    versions: dict[str, str]  # dataset -> prompt version (6 hex chars)
    summary_failed: set[tuple[str, str]]  # (model, dataset) cells shown as '-'
    notes: list[str] = field(default_factory=list)
    # From the config dump (None without one): what must match for two arms to pair.
    settings: dict[str, dict] | None = None  # model abbr -> {generation, model}
    scoring: dict[str, dict] | None = None  # dataset abbr -> SCORING_FIELDS


# A model's generation settings and a dataset's scoring settings: arms that differ in any of
# these did not answer the same questions the same way. The rest of a model's config (its
# class and engine options) says which model was served: arms differ in it by design, so it is
# recorded, not compared; paths and batch size are left out (the model's identity, from its
# files, stands for the paths; predictions are the same at any batch size).
GENERATION_FIELDS = (
    "max_out_len",
    "max_seq_len",
    "generation_kwargs",
    "chat_template_kwargs",
    "stop_words",
    "meta_template",
    "pred_postprocessor",
)
SCORING_FIELDS = ("eval_cfg", "reader_cfg", "path", "name", "n", "k")
MODEL_IGNORED = (
    "abbr",
    "path",
    "batch_size",
    "run_cfg",
    "stats_jsonl",
    "lora_path",
    "prerouter_path",
    "hedge_path",
)


def _model_settings(cfg) -> dict:
    return {
        "generation": {f: _plain(cfg.get(f)) for f in GENERATION_FIELDS},
        "model": {
            k: _plain(v)
            for k, v in sorted(cfg.items())
            if k not in GENERATION_FIELDS and k not in MODEL_IGNORED
        },
    }


def _plain(value):
    """A config value as plain JSON data (types as their dotted names), for comparing."""
    return json.loads(json.dumps(value, sort_keys=True, default=str))


def _is_run_dir(path: Path) -> bool:
    return any(
        (path / sub).is_dir()
        for sub in ("results", "predictions", "summary", "configs")
    )


def expand_outputs(paths: list[str]) -> list[Path]:
    """Run folders for the given paths; a work_dir stands for its latest run (as `-r` does)."""
    runs = []
    for raw in paths:
        path = Path(raw)
        if not path.is_dir():
            raise Edge0Error(
                f"{path}: not a directory (pass an OpenCompass output folder)"
            )
        if _is_run_dir(path):
            runs.append(path)
            continue
        children = sorted(c for c in path.iterdir() if c.is_dir() and _is_run_dir(c))
        if not children:
            raise Edge0Error(
                f"{path}: no OpenCompass output here (expected results/ and "
                f"summary/, or timestamped folders holding them)"
            )
        runs.append(children[-1])
    return runs


def _latest(folder: Path, pattern: str) -> Path | None:
    # OpenCompass names these by timestamp (YYYYmmdd_HHMMSS), so name order is time order.
    files = sorted(folder.glob(pattern)) if folder.is_dir() else []
    return files[-1] if files else None


def _dataset_from_filename(name: str, siblings: set[str]) -> str | None:
    """Dataset abbr for a results/predictions file name, or None for files that are not one."""
    if not name.endswith(".json") or name.startswith("tmp_") or "_llm_judge" in name:
        return None
    stem = name[: -len(".json")]
    if stem.endswith(".engine_stats"):
        stem = stem[: -len(".engine_stats")]
    shard = re.fullmatch(r"(.+)_(\d+)", stem)
    # `X_3.json` is a shard of X only when X is sharded (X_0.json exists, X.json does not);
    # otherwise `_3` is part of the abbr (e.g. GPQA_diamond_repeat_4).
    if (
        shard
        and f"{shard[1]}_0.json" in siblings
        and f"{shard[1]}.json" not in siblings
    ):
        return shard[1]
    return stem


def _read_summary(
    path: Path,
) -> tuple[list[str], dict[str, str], set[tuple[str, str]], list[str]]:
    """(models, dataset -> version, failed cells, datasets) from a summary csv."""
    with path.open(newline="", encoding="utf-8") as f:
        rows = list(csv.reader(f))
    if not rows or rows[0][:4] != ["dataset", "version", "metric", "mode"]:
        raise Edge0Error(
            f"{path}: not an OpenCompass summary (header must start with "
            f"dataset,version,metric,mode)"
        )
    models = rows[0][4:]
    versions, failed, datasets = {}, set(), []
    for row in rows[1:]:
        if len(row) < 4:
            continue
        dataset, version, metric = row[0], row[1], row[2]
        # Group rows (e.g. `mmlu_pro` averages) have a metric but no version; a dataset whose
        # every task failed has neither. Only the latter is a dataset of this run.
        if version == "-" and metric != "-":
            continue
        if dataset not in datasets:
            datasets.append(dataset)
        if version != "-":
            versions[dataset] = version
        for model, cell in zip(models, row[4:]):
            if cell.strip() == "-":
                failed.add((model, dataset))
    return models, versions, failed, datasets


def _read_config(path: Path) -> tuple[list[str], list]:
    """(model abbrs, dataset configs) from the dumped config."""
    # optional (mmengine comes with the [eval] extra); without it load_run notes why and goes on
    from mmengine.config import Config

    cfg = Config.fromfile(str(path), format_python_code=False)
    return list(cfg.get("models", [])), list(cfg.get("datasets", []))


def _dataset_abbr(cfg) -> str:  # opencompass.utils.abbr.dataset_abbr_from_cfg
    if "abbr" in cfg:
        return cfg["abbr"]
    return (cfg["path"] + ("_" + cfg["name"] if "name" in cfg else "")).replace(
        "/", "_"
    )


def _prompt_versions(dataset_cfgs: list) -> dict[str, str]:
    """The summary's `version` column, computed with OpenCompass's own get_prompt_hash."""
    # optional ([eval] extra) and a slow import (-X importtime): only for runs without versions
    from opencompass.utils.prompt import get_prompt_hash

    # get_prompt_hash edits its argument; the summary shows the first 6 hex digits.
    return {
        _dataset_abbr(d): get_prompt_hash(copy.deepcopy(d))[:6] for d in dataset_cfgs
    }


def load_run(path: Path) -> Run:
    models: list[str] = []
    versions: dict[str, str] = {}
    failed: set[tuple[str, str]] = set()
    notes: list[str] = []
    summary_datasets: list[str] = []
    config_datasets: list | None = None
    settings = scoring = None

    def add(seq, items):
        seq.extend(i for i in items if i not in seq)

    summary = _latest(path / "summary", "summary_*.csv")
    if summary:
        s_models, versions, failed, summary_datasets = _read_summary(summary)
        add(models, s_models)

    # The dumped config says which datasets the run was meant to score (the summary may list
    # only some, e.g. with summarizer dataset_abbrs) and hashes prompts the summary lacks.
    config = _latest(path / "configs", "*.py")
    if config:
        try:
            model_cfgs, config_datasets = _read_config(config)
            add(models, [m["abbr"] for m in model_cfgs if "abbr" in m])
            settings = {
                m["abbr"]: _model_settings(m) for m in model_cfgs if "abbr" in m
            }
            scoring = {
                _dataset_abbr(d): {f: _plain(d.get(f)) for f in SCORING_FIELDS}
                for d in config_datasets
            }
            unversioned = [
                d for d in config_datasets if _dataset_abbr(d) not in versions
            ]
            if unversioned:
                versions.update(_prompt_versions(unversioned))
        except (
            ImportError
        ) as exc:  # without the [eval] extra: say why, go on with what there is
            notes.append(
                f"{config}: cannot read datasets or prompt versions "
                f"({type(exc).__name__}: {exc})"
            )
        except Exception as exc:  # noqa: BLE001 - mmengine executes the dump; any error is its
            raise Edge0Error(
                f"{config}: the run's config dump cannot be read ({type(exc).__name__}: {exc}); "
                f"it records which datasets the run was meant to score and their prompts: "
                f"restore it from the run, or move the configs folder away to report from the "
                f"summary and result files alone"
            ) from None

    file_datasets: list[str] = []
    for sub in ("results", "predictions"):
        if not (path / sub).is_dir():
            continue
        for mdir in sorted(p for p in (path / sub).iterdir() if p.is_dir()):
            add(models, [mdir.name])
            names = {f.name for f in mdir.iterdir()}
            found = (_dataset_from_filename(n, names) for n in sorted(names))
            add(file_datasets, [d for d in found if d])
    if config_datasets is not None:
        datasets = [_dataset_abbr(d) for d in config_datasets]
    else:
        # Without the config: the summary's dataset rows (a row of only '-' is a dataset whose
        # every task failed, unless it is one of our summary groups) plus any result files.
        datasets = [d for d in summary_datasets if d not in SUMMARY_GROUPS]
        add(datasets, file_datasets)
    if not models:
        raise Edge0Error(
            f"{path}: no models found (no summary csv, config or results folders)"
        )
    return Run(path, models, datasets, versions, failed, notes, settings, scoring)


# --------------------------------------------------------------------------- per-item scores


@dataclass
class DatasetResult:
    """One model on one dataset."""

    model: str
    dataset: str
    status: str  # ok | failed | no_details | inconsistent | no_predictions
    metric: str | None = None
    reported: float | None = None  # metric from the results file, full precision
    # item id -> [0, 1], avg over samples
    scores: dict[str, float] = field(default_factory=dict)
    # item id -> samples.record
    samples: dict[str, list[dict]] = field(default_factory=dict)
    # metric -> item -> [0,1]
    extra: dict[str, dict[str, float]] = field(default_factory=dict)
    version: str | None = None
    engine: list[dict] = field(default_factory=list)
    data: dict | None = None  # settings.data_digest of the predictions (+ item_digests)
    identity: dict | None = None  # the model_identity every engine stats sample carries
    notes: list[str] = field(default_factory=list)


def _pick_metric(result: dict, wanted: str | None) -> str | None:
    numeric = [
        k
        for k, v in result.items()
        if k not in _METRIC_IGNORED
        and isinstance(v, (int, float))
        and not isinstance(v, bool)
    ]
    if wanted is not None:
        # n > 1 replicas rename the metric to "<metric> (n runs average)".
        for k in numeric:
            if k == wanted or k.startswith(wanted + " ("):
                return k
        return None
    base = lambda k: k.split(" (")[0]  # noqa: E731
    numeric.sort(
        key=lambda k: (
            _METRIC_PREFERENCE.index(base(k))
            if base(k) in _METRIC_PREFERENCE
            else len(_METRIC_PREFERENCE)
        )
    )
    return numeric[0] if numeric else None


def load_dataset_result(
    run: Run, model: str, bench: Benchmark, dataset: str
) -> DatasetResult:
    res = DatasetResult(model, dataset, "failed", version=run.versions.get(dataset))
    pred_dir = run.path / "predictions" / model
    preds = load_predictions(pred_dir, dataset) if pred_dir.is_dir() else None
    res.engine = engine_samples(pred_dir, dataset, preds) if pred_dir.is_dir() else []
    res.data = data_digest(preds)
    mixed_models = _take_identity(res, pred_dir, dataset)
    path = run.path / "results" / model / f"{dataset}.json"
    if (model, dataset) in run.summary_failed:
        res.notes.append("summary shows '-'")
    details = _read_details(res, path, bench)
    if details is None:
        return res
    n_config = ((run.scoring or {}).get(dataset) or {}).get("n") or 1
    items = detail_items(details, n_config if isinstance(n_config, int) else 1)
    replicas = _score_items(res, items, preds, bench, path)
    if replicas is None:
        return res
    if res.data is not None and len(preds) == len(items) * replicas:
        res.data["items"] = item_digests(preds, [item_id for item_id, _ in items])
    res.status = "ok"
    _check_consistency(res, run, path, pred_dir, preds, replicas)
    if mixed_models:
        res.status = "inconsistent"
    return res


def _take_identity(res: DatasetResult, pred_dir: Path, dataset: str) -> bool:
    """Set the samples' model identity; True (with a note) when they mix models."""
    identities = sorted(
        {json.dumps(e.get("model_identity"), sort_keys=True) for e in res.engine}
    )
    if len(identities) > 1:
        res.notes.append(
            f"{pred_dir}: its {dataset} samples come from {len(identities)} "
            f"different models (model_identity in the engine stats; a run resumed "
            f"after the model changed?): re-run the dataset without -r"
        )
    res.identity = json.loads(identities[0]) if len(identities) == 1 else None
    return len(identities) > 1


def _read_details(res: DatasetResult, path: Path, bench: Benchmark):
    """The results file's per-item details, with its metric set on `res`; None (and a
    note saying why) when the file gives no usable score."""
    if not path.exists():
        res.notes.append(f"no results file {path}")
        return None
    try:
        result = strict_loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:
        res.notes.append(f"{path}: unreadable ({exc})")
        return None
    if not isinstance(result, dict):
        res.notes.append(
            f"{path}: a JSON {type(result).__name__}, not a results object"
        )
        return None
    if "error" in result:
        res.notes.append(f"{path}: error: {result['error']}")
        return None
    res.metric = _pick_metric(result, bench.metric)
    if res.metric is None:
        res.notes.append(f"{path}: no metric {bench.metric or '(numeric)'}")
        return None
    res.reported = float(result[res.metric])
    if not math.isfinite(res.reported):
        res.notes.append(f"{path}: {res.metric} is {res.reported}")
        return None
    details = result.get("details")
    if not details:
        res.status = "no_details"
        res.notes.append(
            f"{path}: no per-item details (run OpenCompass with "
            f"--dump-eval-details, its default)"
        )
        return None
    if (
        not isinstance(details, (dict, list))
        or isinstance(details, list)
        and not all(isinstance(d, dict) for d in details)
    ):
        raise Edge0Error(
            f"{path}: details must be a list or object of per-item objects (as "
            f"OpenCompass writes them); the file is corrupt, re-run that task "
            f"(delete the file first)"
        )
    return details


def _score_items(res: DatasetResult, items, preds, bench: Benchmark, path: Path):
    """Each item's mean score, samples and extra metrics into `res`; the replicas per
    item, or None when an item has no correctness field."""
    replicas = 1
    for k, (item_id, entries) in enumerate(items):
        per_entry = [replica_scores(d, bench.item_key) for d in entries]
        if any(v is None for v in per_entry):
            res.status = "no_details"
            res.notes.append(f"{path}: item {item_id} has no correctness field")
            return None
        if item_id in res.scores:
            raise Edge0Error(
                f"{path}: item {item_id} appears twice in the details; the file "
                f"is corrupt, re-run that task (delete the file first)"
            )
        scores = [v for vs in per_entry for v in vs]
        replicas = max(replicas, len(scores))
        res.scores[item_id] = sum(scores) / len(scores)
        res.samples[item_id] = [
            record(
                score,
                *_sample_files(
                    preds, res.engine, r * len(items) + k, len(items) * len(scores)
                ),
                thinking_closed,
            )
            for r, score in enumerate(scores)
        ]
        for metric, key in bench.extra:
            extra = [replica_scores(d, key) for d in entries]
            if all(v is not None for v in extra):
                flat = [v for vs in extra for v in vs]
                res.extra.setdefault(metric, {})[item_id] = sum(flat) / len(flat)
    return replicas


def _check_consistency(res, run: Run, path, pred_dir, preds, replicas: int) -> None:
    """Mark `res` inconsistent (with notes) when its items, predictions and engine
    stats do not reproduce the reported metric or each other."""
    mean = 100.0 * sum(res.scores.values()) / len(res.scores)
    if abs(mean - res.reported) > METRIC_TOLERANCE:
        res.status = "inconsistent"
        res.notes.append(
            f"{path}: per-item mean {mean!r} does not reproduce "
            f"{res.metric} {res.reported!r}"
        )
    stats_problem = engine_stats_problem(
        res.engine, len(preds) if preds is not None else None
    )
    if stats_problem:
        res.status = "inconsistent"
        res.notes.append(f"{pred_dir}: {stats_problem}")
    if preds is None:
        if res.status == "ok":
            res.status = "no_predictions"
        gone = (
            "the run has no predictions folder"
            if not (run.path / "predictions").is_dir()
            else f"no predictions file for {res.dataset} in {pred_dir} (deleted?)"
        )
        res.notes.append(
            f"{res.dataset}: {gone}, so its {', '.join(NEEDS_PREDICTIONS)} are not "
            f"computed; restore the run's predictions or re-run the task"
        )
    elif len(preds) != len(res.scores) * replicas:
        res.status = "inconsistent"
        res.notes.append(
            f"{path}: {len(res.scores)} scored items x {replicas} replicas but "
            f"{len(preds)} predictions"
        )


def _sample_files(
    preds: list[dict] | None, engine: list[dict], index: int, total: int
) -> tuple[dict | None, dict | None]:
    """The prediction and engine stats of one sample, when the files hold one per sample."""
    pred = preds[index] if preds is not None and len(preds) == total else None
    stats = engine[index] if pred is not None and len(engine) == total else None
    return pred, stats
