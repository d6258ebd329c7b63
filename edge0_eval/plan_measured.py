"""What an earlier run of a config measured, for `edge0-eval plan --from RUN`: per arm and
dataset the mean generated tokens per sample and the tokens/s of its generate calls (prefill
included; for teacher-forced fidelity, prompt and continuation tokens/s), read from the engine
stats the report reads, and the run's overhead per arm (its wall time less the generation it
measured)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from edge0_eval.errors import ConfigError, Edge0Error
from edge0_eval.evaluation.fidelity_set import DATASET_ABBR as FIDELITY_ABBR
from edge0_eval.evaluation.predictions import read_json


@dataclass
class Measured:
    tokens: dict[tuple[str, str], float]  # (arm, dataset) -> mean tokens per sample
    rates: dict[tuple[str, str], float]  # (arm, dataset) -> tokens/s of its calls
    arm_rates: dict[str, float]  # arm -> tokens/s over all its datasets
    overhead_s: float | None  # per arm: run wall time minus generation


def _stats_files(pred_dir: Path) -> dict[str, list[Path]]:
    out: dict[str, list[Path]] = {}
    for path in sorted(pred_dir.glob("*.engine_stats.json")):
        stem = path.name[: -len(".engine_stats.json")]
        base, _, shard = stem.rpartition("_")
        dataset = base if shard.isdigit() and base else stem
        out.setdefault(dataset, []).append(path)
    return out


def _call_seconds(rows: list[dict], path: Path) -> float:
    """Seconds of the generate calls behind `rows`, in order: each call's rows carry its
    batch_size; a batched call's time is its batch_wall_s, a single prompt's its wall_s."""
    total, i = 0.0, 0
    while i < len(rows):
        size = rows[i].get("batch_size", 1)
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise Edge0Error(
                f"{path}: row {i} has batch_size {size!r}; the file is corrupt, "
                f"re-run that task"
            )
        call = rows[i : i + size]
        walls = [r.get("batch_wall_s", r.get("wall_s")) for r in call]
        if any(not isinstance(w, (int, float)) for w in walls):
            raise Edge0Error(
                f"{path}: rows {i}..{i + len(call) - 1} lack wall_s; made by an "
                f"older edge0-eval? re-run that task"
            )
        total += max(walls)
        i += size
    return total


def _run_wall_s(run: Path) -> float | None:
    """The run's wall time: from its folder name (OpenCompass names it by its start time) to
    the newest summary file."""
    try:
        start = datetime.strptime(run.name, "%Y%m%d_%H%M%S").timestamp()
    except ValueError:
        return None
    ends = [p.stat().st_mtime for p in (run / "summary").glob("summary_*")]
    return max(ends) - start if ends else None


def read_previous(run: Path) -> Measured:
    pred_root = run / "predictions"
    if not pred_root.is_dir():
        raise ConfigError(
            f"--from {run}: no predictions/ folder; give an OpenCompass run "
            f"folder (outputs/<config>/<timestamp>)"
        )
    tokens, rates, totals = {}, {}, {}
    for model_dir in sorted(p for p in pred_root.iterdir() if p.is_dir()):
        arm = model_dir.name
        for dataset, files in _stats_files(model_dir).items():
            rows: list[dict] = []
            seconds = 0.0
            for path in files:
                data = read_json(path, "engine stats")
                if not isinstance(data, list) or not all(
                    isinstance(r, dict) for r in data
                ):
                    raise Edge0Error(
                        f"{path}: engine stats must be a list of objects; the "
                        f"file is corrupt, re-run that task"
                    )
                rows += data
                seconds += _call_seconds(data, path)
            counts = [r.get("tokens") for r in rows]
            if not rows or any(
                isinstance(c, bool) or not isinstance(c, int) for c in counts
            ):
                raise Edge0Error(
                    f"{files[0]}: a row without a whole 'tokens' count; the file "
                    f"is corrupt, re-run that task"
                )
            tokens[(arm, dataset)] = sum(counts) / len(counts)
            work = sum(counts)
            if (
                dataset == FIDELITY_ABBR
            ):  # scoring runs the prompt as well: plan.fidelity_tokens
                prompts = [r.get("prompt_tokens") for r in rows]
                if any(isinstance(p, bool) or not isinstance(p, int) for p in prompts):
                    raise Edge0Error(
                        f"{files[0]}: a row without a whole 'prompt_tokens' "
                        f"count; the file is corrupt, re-run that task"
                    )
                work += sum(prompts)
            if seconds > 0:
                rates[(arm, dataset)] = work / seconds
            done = totals.setdefault(arm, [0, 0.0])
            done[0] += sum(counts)
            done[1] += seconds
    if not tokens:
        raise ConfigError(f"--from {run}: no engine stats under {pred_root}")
    wall = _run_wall_s(run)
    overhead = None
    if wall is not None:
        overhead = max(0.0, wall - sum(s for _, s in totals.values())) / len(totals)
    arm_rates = {arm: n / s for arm, (n, s) in totals.items() if s > 0}
    return Measured(tokens, rates, arm_rates, overhead)
