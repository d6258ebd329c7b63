"""Progress with an ETA per arm while OpenCompass runs, from the inferencer.

OpenCompass runs each arm as one task (all its datasets, one after another in one process) and
logs per task. The project's partitioners give every Edge0GenInferencer of a task a spec
(`task_specs`): the arm, the task's datasets with their items and the planner's expected
tokens per item (run_config.tokens_per_sample: the thinking-on prior, max_out_len, or a fidelity
set's positions), and where the arm's progress file goes. After every batch the inferencer
adds its items (`Progress.add`), rewrites `<run>/progress/<arm>.json` and, at most every
LOG_EVERY_S seconds, logs a line:

    progress edge0-35b-student: 212/1,408 items (15.1%), MMLU-Pro 40/120, 0.41 h, ETA 2.3 h

ETA = elapsed x (expected tokens left / expected tokens done): items are weighted by their
expected length, so an AIME item counts as 8 MMLU-Pro items, and the arm's own pace so far
(prefill, batching, the machine) sets the rate. Datasets other inferencers score (fidelity)
count as done when the next dataset starts.

An arm split into several tasks (NumWorkerPartitioner's item chunks, run side by side) writes
one file per task, `<run>/progress/<arm>/<k>.json`, each carrying the arm's totals; its line
sums them (`arm_state`): items done over all chunks, ETA from the elapsed time since the first
chunk started and the cost done by all of them.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from edge0_eval.evaluation.fidelity.sets import DATASET_ABBR as FIDELITY_ABBR
from edge0_eval.evaluation.plan.run_config import (
    arm_abbr,
    count_items,
    dataset_abbr,
    fidelity_tokens,
    test_range_slice,
    tokens_per_sample,
)

LOG_EVERY_S = 30.0


def task_specs(model_cfg: dict, datasets: list[dict], work_dir: str) -> list[dict]:
    """One progress spec per dataset of an arm's task, in the task's order."""
    arm = arm_abbr(model_cfg)
    rows = []
    for d in datasets:
        abbr = dataset_abbr(d)
        if abbr.startswith(FIDELITY_ABBR):
            staged = fidelity_tokens(test_range_slice(d))
            items, positions = staged if staged else (0, None)
        else:
            items, positions = count_items(d)[0] * int(d.get("n", 1)), None
        per = tokens_per_sample(model_cfg, abbr, None, positions, items)[0]
        rows.append(dict(dataset=abbr, items=items, weight=max(per, 1.0)))
    file = str(Path(work_dir) / "progress" / f"{arm}.json")
    return [dict(arm=arm, file=file, index=i, datasets=rows) for i in range(len(rows))]


def shard_specs(groups: list[list[dict]]) -> None:
    """The specs of one arm's tasks (each a list from task_specs): one file per task under
    progress/<arm>/, and the arm's totals in every spec (changed in place)."""
    rows = [spec["datasets"] for specs in groups for spec in specs[:1]]
    items = sum(r["items"] for task in rows for r in task)
    cost = sum(r["items"] * r["weight"] for task in rows for r in task)
    for k, specs in enumerate(groups):
        for spec in specs:
            path = Path(spec["file"])
            spec.update(
                file=str(path.with_suffix("") / f"{k}.json"),
                arm_items=items,
                arm_cost=cost,
                arm_tasks=len(groups),
            )


def arm_state(folder: Path) -> dict | None:
    """An arm's state summed over its tasks' files (shard_specs); None before any exists."""
    states = []
    for path in sorted(folder.glob("*.json")):
        try:
            states.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue  # being replaced: the next read sees it
    if not states:
        return None
    first = states[0]
    done_cost = sum(st["cost"] for st in states)
    elapsed = max(st["updated"] for st in states) - min(st["started"] for st in states)
    left = max(first["arm_cost"] - done_cost, 0.0)
    return dict(
        arm=first["arm"],
        items=sum(st["items"] for st in states),
        total=first["arm_items"],
        dataset="chunks done",
        dataset_items=sum(st["items"] >= st["total"] for st in states),
        dataset_total=first["arm_tasks"],
        elapsed_s=elapsed,
        eta_s=elapsed * left / done_cost if done_cost else None,
    )


class Progress:
    """One dataset's share of its arm's progress (spec from `task_specs`)."""

    def __init__(self, spec: dict, log=None):
        self.spec, self.log = spec, log
        rows, index = spec["datasets"], spec["index"]
        self.total_items = sum(r["items"] for r in rows)
        self.total_cost = sum(r["items"] * r["weight"] for r in rows)
        self.items_before = sum(r["items"] for r in rows[:index])
        self.cost_before = sum(r["items"] * r["weight"] for r in rows[:index])
        self.row = rows[index]
        self.done = 0
        self.started = self._started()
        self.logged = 0.0

    def _started(self) -> float:
        """When the arm's task started: the first dataset's start, kept in the file."""
        if self.spec["index"] > 0:
            try:
                return float(json.loads(Path(self.spec["file"]).read_text())["started"])
            except (OSError, ValueError, KeyError, TypeError):
                pass  # no earlier dataset wrote one (e.g. resumed): from now
        return time.time()

    def add(self, items: int) -> dict:
        self.done += items
        now = time.time()
        done_items = self.items_before + self.done
        done_cost = self.cost_before + self.done * self.row["weight"]
        elapsed = now - self.started
        left = max(self.total_cost - done_cost, 0.0)
        state = dict(
            arm=self.spec["arm"],
            started=self.started,
            updated=now,
            items=done_items,
            total=self.total_items,
            dataset=self.row["dataset"],
            dataset_items=self.done,
            dataset_total=self.row["items"],
            cost=done_cost,
            elapsed_s=elapsed,
            eta_s=elapsed * left / done_cost if done_cost else None,
        )
        for key in (
            "arm_items",
            "arm_cost",
            "arm_tasks",
        ):  # one of an arm's chunk tasks
            if key in self.spec:
                state[key] = self.spec[key]
        path = Path(self.spec["file"])
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(state))
        tmp.replace(path)
        if self.log and (
            now - self.logged >= LOG_EVERY_S or self.done >= self.row["items"]
        ):
            self.logged = now
            self.log(line(arm_state(path.parent) if "arm_tasks" in state else state))
        return state


def _hours(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    return (
        f"{seconds:.0f} s"
        if seconds < 120
        else (
            f"{seconds / 60:.1f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"
        )
    )


def line(state: dict) -> str:
    share = 100.0 * state["items"] / state["total"] if state["total"] else 100.0
    return (
        f"progress {state['arm']}: {state['items']:,}/{state['total']:,} items "
        f"({share:.1f}%), {state['dataset']} {state['dataset_items']}/"
        f"{state['dataset_total']}, {_hours(state['elapsed_s'])}, "
        f"ETA {_hours(state['eta_s'])}"
    )


def read_lines(run_dir: Path) -> list[str]:
    """The progress line of every arm with a progress file (or folder of chunk files) in a
    run folder."""
    out = []
    for path in sorted((run_dir / "progress").glob("*")):
        try:
            if path.is_dir():  # an arm's chunk files (shard_specs)
                state = arm_state(path)
            elif path.suffix == ".json":  # not a file being written (.<name>.<pid>)
                state = json.loads(path.read_text())
            else:
                continue
            if state is not None:
                out.append(line(state))
        except (OSError, ValueError, KeyError, TypeError):
            continue  # being replaced: the next poll reads it
    return out
