"""A NaivePartitioner that checks data, checkpoints and adapters before any task starts.

OpenCompass calls the partitioner in the launching process, after parsing the config and
before it starts a single task, so this is the last point where a missing data file, an
unconverted student or an absent adapter can stop the run with one message instead of failed
tasks (whose failure OpenCompass reports with exit code 0). Configs are parsed in mmengine's
lazy-import mode, where project code cannot run at parse time; hence the check lives here.
"""

from __future__ import annotations

import copy
import os
from typing import Dict, Iterable, List

from opencompass.partitioners import NaivePartitioner, NumWorkerPartitioner
from opencompass.registry import PARTITIONERS
from opencompass.utils import build_dataset_from_cfg

from edge0_eval.engine.families import check_model_dir
from edge0_eval.errors import Edge0Error
from edge0_eval.evaluation.benchmarks import benchmark_for
from edge0_eval.evaluation.data.checks import verify
from edge0_eval.evaluation.data_paths import data_root
from edge0_eval.evaluation.plan.progress import shard_specs, task_specs
from edge0_eval.evaluation.plan.run_config import test_range_slice
from edge0_eval.formats.safetensors import read_safetensors_header

from ..datasets.fidelity_dataset import preflight_problems as fidelity_preflight
from ..models.edge0_api_model import api_problems
from ..models.edge0_model import engine_fields, resolve_engine_options


def benchmark_of(dataset_abbr: str) -> str | None:
    """The staged benchmark a dataset config reads (None for datasets this project does not stage)."""
    return benchmark_for(dataset_abbr).key


def _type_name(cfg: dict) -> str:
    kind = cfg.get("type")
    return getattr(kind, "__name__", str(kind)).rsplit(".", 1)[-1]


def model_problems(models: Iterable[dict]) -> List[str]:
    problems = []
    for model in models:
        name = model.get("abbr") or model.get("path")
        path = model.get("path")
        if not path:
            problems.append(f"{name}: no model path (is its environment variable set?)")
            continue
        batch = model.get("batch_size", 1)
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            problems.append(
                f"{name}: batch_size {batch!r} must be a whole number >= 1 "
                f"(the prompts each generate call decodes at once)"
            )
        if _type_name(model) == "Edge0Model":
            try:
                opts = resolve_engine_options(
                    path, **{k: model[k] for k in engine_fields() if k in model}
                )
                resolved = opts.resolve(path, require_lora=True)
                # The files themselves, as Engine.load reads them: a corrupt or foreign student
                # stops the run here, not as failed tasks after the teacher's.
                check_model_dir(path, verify_crc=opts.verify_crc)
                for file, what in (
                    (resolved.lora_path, "LoRA adapter"),
                    (resolved.prerouter_path, "prerouter heads"),
                    (resolved.hedge_path, "prerouter hedge"),
                ):
                    if file is not None:
                        read_safetensors_header(file, what, "train or copy it again")
            except Edge0Error as exc:  # the student's index/config are read too
                problems.append(f"{name}: {exc}")
        elif _type_name(model) == "Edge0APIModel":
            problems += api_problems(name, model)
        elif _type_name(model) == "MLXLMModel":
            if not os.path.isfile(os.path.join(path, "config.json")):
                problems.append(
                    f"{name}: {path} has no config.json (not an mlx-lm checkpoint)"
                )
    return problems


def preflight(
    models: Iterable[dict],
    datasets: Iterable[dict],
    full_data: bool = True,
    check_models: bool = True,
) -> None:
    """Exit with every problem listed, one per line, if the run cannot succeed."""
    benchmarks, ifbench_items = [], None
    datasets, models = list(datasets), list(models)
    for d in datasets:
        b = benchmark_of(d.get("abbr", ""))
        if b and b not in benchmarks:
            benchmarks.append(b)
        if b == "ifbench":
            ifbench_items = test_range_slice(d)
    problems = [
        c.message
        for c in verify(None, benchmarks, full=full_data, ifbench_items=ifbench_items)
        if not c.ok
    ]
    arms = [
        (
            m.get("abbr") or m["path"],
            m["path"],
            _type_name(m) == "MLXLMModel",
            m.get("compute_dtype", "auto"),
        )
        for m in models
        if m.get("path")
    ]
    problems += fidelity_preflight(datasets, arms)
    if check_models:
        problems += model_problems(models)
    if problems:
        raise SystemExit(
            "edge0-eval: cannot start the evaluation (data root "
            f"{data_root()}, from COMPASS_DATA_CACHE or the working directory):\n"
            "  - " + "\n  - ".join(problems)
        )


def repeat_layout(dataset: dict, sizes: Dict[str, int]) -> dict:
    """Where a dataset's test rows sit among its `n` copies, for Edge0GenInferencer's sample
    indices: dict(copies=n, items=N, test_range=the task's slice). N is read by building the
    dataset unsliced (only when n > 1); `sizes` caches it across a dataset's slices."""
    copies = dataset.get("n", 1)
    if copies == 1:
        return dict(copies=1)
    whole = copy.deepcopy(dataset)
    for key in ("abbr", "infer_cfg", "eval_cfg"):
        whole.pop(key, None)
    whole["reader_cfg"].pop("test_range", None)
    key = repr(whole)
    if key not in sizes:
        sizes[key] = len(build_dataset_from_cfg(whole).test)
    if sizes[key] % copies:
        raise SystemExit(
            f"edge0-eval: {dataset.get('abbr')}: {sizes[key]} test rows are not "
            f"{copies} (n) equal copies"
        )
    return dict(
        copies=copies,
        items=sizes[key] // copies,
        test_range=dataset["reader_cfg"].get("test_range"),
    )


def add_progress(tasks: List[dict]) -> List[dict]:
    """Give every Edge0GenInferencer and FidelityInferencer of every infer task its arm's
    progress spec (items and expected tokens of the task's datasets;
    edge0_eval/evaluation/plan/progress.py). An arm split into several tasks (NumWorker chunks)
    gets one progress file per task and the arm's totals in each (progress.shard_specs)."""
    by_arm: Dict[str, list] = {}
    placed = []
    for task in tasks:
        # The tasks share the config's dataset dicts; each arm's spec goes into its own copy.
        task["datasets"] = [[copy.deepcopy(d) for d in ds] for ds in task["datasets"]]
        for model, datasets in zip(task["models"], task["datasets"]):
            specs = task_specs(model, datasets, task["work_dir"])
            if specs:
                by_arm.setdefault(specs[0]["file"], []).append(specs)
            placed += zip(datasets, specs)
    for groups in by_arm.values():
        if len(groups) > 1:
            shard_specs(groups)
    # Assigned last: a ConfigDict copies what it is given, so the specs must be complete.
    for dataset, spec in placed:
        inferencer = dataset["infer_cfg"]["inferencer"]
        if _type_name(inferencer) in ("Edge0GenInferencer", "FidelityInferencer"):
            inferencer["progress"] = spec
    return tasks


def add_repeat_layouts(tasks: List[dict]) -> List[dict]:
    """Give every Edge0GenInferencer of every task its dataset's `repeat_layout`."""
    sizes: Dict[str, int] = {}
    for task in tasks:
        for datasets in task["datasets"]:
            for dataset in datasets:
                inferencer = dataset["infer_cfg"]["inferencer"]
                if _type_name(inferencer) == "Edge0GenInferencer":
                    inferencer["repeats"] = repeat_layout(dataset, sizes)
    return tasks


class _Checked:
    """What this project's partitioners add to OpenCompass's, whichever they extend:
    `preflight` before any task starts, each task's `add_repeat_layouts`, and at the infer
    stage `add_progress`.

    Args:
        full_data: require the full benchmarks' item counts (False for fixtures/smoke runs).
        check_models: also check model paths and student adapters (off for eval-only runs).
    """

    def __init__(
        self, out_dir: str, full_data: bool = True, check_models: bool = True, **kwargs
    ):
        super().__init__(out_dir=out_dir, **kwargs)
        self.full_data = full_data
        self.check_models = check_models

    def __call__(self, cfg):
        preflight(cfg["models"], cfg["datasets"], self.full_data, self.check_models)
        tasks = add_repeat_layouts(super().__call__(cfg))
        return add_progress(tasks) if _infers(self.out_dir) else tasks


def _infers(out_dir: str) -> bool:
    """Whether a partitioner serves OpenCompass's infer stage (its outputs: predictions/)."""
    return os.path.basename(os.path.normpath(out_dir)) == "predictions"


@PARTITIONERS.register_module()
class Edge0Partitioner(_Checked, NaivePartitioner):
    """NaivePartitioner, checked (`_Checked`: full_data, check_models).

    Args:
        n: model-dataset pairs per task; the default puts all of an arm's datasets in one task,
            so each model loads once.
    """

    def __init__(self, out_dir: str, n: int = 10000, **kwargs):
        super().__init__(out_dir=out_dir, n=n, **kwargs)


@PARTITIONERS.register_module()
class Edge0NumWorkerPartitioner(_Checked, NumWorkerPartitioner):
    """NumWorkerPartitioner, checked (`_Checked`; a chunk's inferencer learns where its rows sit
    among the copies): splits each dataset into item chunks across `num_worker` tasks per arm
    (several student workers on one node share the page cache).

    It sizes datasets by loading them once and caches the sizes in `dataset_size_path`
    (default `.cache/dataset_size.json` under the working directory), as OpenCompass does.
    """
