"""What each headline measures, and when a published number may stand beside it.

A headline is the benchmark's per-sample metric (benchmarks.Benchmark.definition: accuracy,
pass@1, prompt-level strict accuracy, accuracy pooled per question) averaged over the item's
samples and then over items: "avg@n" with n samples per item (n = 1: one sample).

A reference file (reports/reference/*.json) gives, beside its numbers, what each measures:
  "definitions": {BENCHMARK: {"metric": the per-sample metric or null (not known),
                              "samples": 1 | "several" | N | null, "basis": why}}
A reference number is shown only beside a headline of the same definition: the same metric
and the same samples per item ("several": any n > 1; the mean over samples estimates the same
quantity at any n, only its noise differs). Otherwise the row says why it is left out.
"""

from __future__ import annotations

from pathlib import Path

from edge0_eval.errors import Edge0Error
from edge0_eval.evaluation.benchmarks import Benchmark
from edge0_eval.evaluation.outputs.predictions import strict_loads


def headline(bench: Benchmark, metric: str | None, n: int | None) -> dict:
    """{metric, samples, text} of a benchmark row whose items have n samples each."""
    what = bench.definition or metric or "score"
    if n is None:
        samples = "mean over each item's samples (the counts differ between items)"
    elif n == 1:
        samples = "one sample per item"
    else:
        samples = f"avg@{n}: the mean over {n} samples per item, then over items"
    return {"metric": what, "samples": n, "text": f"{what}; {samples}"}


def load_reference(path: str) -> dict:
    try:
        ref = strict_loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:
        raise Edge0Error(f"--reference {path}: cannot read ({exc})") from exc
    arms = ref.get("arms") if isinstance(ref, dict) else None
    if not isinstance(arms, dict) or not all(
        isinstance(v, dict)
        and all(
            isinstance(x, (int, float)) and not isinstance(x, bool) for x in v.values()
        )
        for v in arms.values()
    ):
        raise Edge0Error(
            f'--reference {path}: expected {{"arms": {{"teacher": '
            f'{{BENCHMARK: score}}, "student": {{...}}}}}}'
        )
    defs = ref.get("definitions", {})
    if not isinstance(defs, dict) or not all(
        isinstance(d, dict) and set(d) <= {"metric", "samples", "basis"}
        for d in defs.values()
    ):
        raise Edge0Error(
            f"--reference {path}: 'definitions' must map each benchmark to "
            f'{{"metric", "samples", "basis"}} (see '
            f"edge0_eval/evaluation/report/definitions.py)"
        )
    ref.setdefault("file", str(path))
    return ref


def _delta(ref: dict) -> float | None:
    t, s = ref.get("teacher"), ref.get("student")
    # published numbers have one decimal; keep their difference free of float noise
    return None if t is None or s is None else round(s - t, 10)


def reference_for(
    reference: dict, name: str, definition: dict
) -> tuple[dict | None, str | None]:
    """(the reference's {teacher, student, delta} for this row, or None; why it is left out)."""
    ref = {
        arm: reference["arms"].get(arm, {}).get(name) for arm in ("teacher", "student")
    }
    if all(v is None for v in ref.values()):
        return None, None
    theirs = reference.get("definitions", {}).get(name)
    if theirs is None:
        return None, "the reference does not say what its number measures"
    basis = f" ({theirs['basis']})" if theirs.get("basis") else ""
    if theirs.get("metric") is None:
        return None, f"the reference's metric is not known{basis}"
    if theirs["metric"] != definition["metric"]:
        return None, (
            f"the reference measures {theirs['metric']}, this headline "
            f"{definition['metric']}{basis}"
        )
    samples, n = theirs.get("samples"), definition["samples"]
    same = samples == n or (samples == "several" and isinstance(n, int) and n > 1)
    if not same:
        said = (
            "an unknown number of samples"
            if samples is None
            else (
                "several samples per item"
                if samples == "several"
                else f"{samples} per item"
            )
        )
        return None, (
            f"the reference averages {said}, this run {n or 'unequal'} per item"
            f"{basis}: run with the same samples per item (dataset n)"
        )
    return {**ref, "delta": _delta(ref)}, None


def average_reference(
    reference: dict, rows: list[dict]
) -> tuple[dict | None, str | None]:
    """The reference's average, only when every benchmark it averages is shown beside a row
    of the same definition."""
    if not reference.get("average"):
        return None, None
    names = reference.get("benchmarks") or list(reference["arms"].get("teacher", {}))
    shown = {r["benchmark"] for r in rows if r.get("reference")}
    left = [n for n in names if n not in shown]
    if left:
        return None, (
            f"the reference's average includes {', '.join(left)}, whose reference "
            f"is not of this report's definition (or not in it)"
        )
    ref = {arm: reference["average"].get(arm) for arm in ("teacher", "student")}
    return {**ref, "delta": _delta(ref)}, None
