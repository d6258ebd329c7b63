"""The report's tables as rows of cells: report.md (writers.py) and report.html (page.py)
show the same figures from the dict `gap.build_report` makes."""

from __future__ import annotations

from edge0_eval.evaluation.outputs.samples import FLAG_ALPHA
from edge0_eval.evaluation.report.flips import FLIP_SIZE

FLIPS_TEXT = (
    "Items the arm scores differently from the teacher (paired on the teacher's items): "
    f"right to wrong = the item's score fell by {FLIP_SIZE:g} or more (of 1; with one "
    "binary sample: right for the teacher, wrong for the arm), wrong to right = rose by as "
    "much; flip rate = both over the items, with its 95% Wilson interval; net = the mean "
    "change in points, the benchmark's delta."
)


def fmt(value, digits: int = 2, signed: bool = False) -> str:
    if value is None:
        return "n/a"
    return f"{value:+.{digits}f}" if signed else f"{value:.{digits}f}"


def metric_label(row: dict) -> str:
    """The headline's definition, short: 'pass@1, n=1', 'accuracy, avg@4'."""
    d = row.get("definition")
    if not d:
        return ""
    n = d.get("samples")
    return f"{d['metric']}, " + (
        "n=1" if n == 1 else f"avg@{n}" if n else "avg over samples"
    )


def truncation_diff(diff: dict | None, arm: str) -> str:
    if arm == "teacher":
        return ""
    if not diff:
        return "n/a"
    half = f" ±{diff['half_width']:.1f}" if diff["half_width"] is not None else ""
    p = f" (p {diff['p_value']:.2g})" if diff.get("p_value") is not None else ""
    return f"{diff['difference']:+.1f}{half}{p}" + (" FLAG" if diff["flag"] else "")


def ci_text(row: dict) -> str:
    ci = row.get("delta_ci95")
    return f"[{ci[0]:+.2f}, {ci[1]:+.2f}]" if ci else "n/a"


NO_PLOT = "No score plot: every score is zero, so its bars would show nothing.\n"
HEADLINE = ["benchmark", "metric", "items", "teacher", "student", "delta", "95% CI"]
HEADLINE += ["status", "version"]


def headline_rows(report: dict) -> tuple[list[str], list[list]]:
    """The headline table (header, rows), the average last; md and the page share it."""
    has_ref = report["reference"] is not None
    header = HEADLINE + (["ref teacher", "ref student", "ref delta"] if has_ref else [])
    body = []
    for r in report["benchmarks"] + [
        dict(report["average"], benchmark="average", items=None, version=None)
    ]:
        status = r.get("status") or (
            "complete" if r["complete"] else f"over {len(r['benchmarks'])} ok"
        )
        flagged = [
            a
            for a, v in (r.get("arms") or {}).items()
            if (v.get("truncation_vs_teacher") or {}).get("flag")
        ]
        if flagged:
            status += f" (truncation differs: {', '.join(flagged)})"
        items = "" if r["items"] is None else r["items"]  # 0 items is said, not blank
        line = [r["benchmark"], metric_label(r), items]
        line += [fmt(r["teacher"]), fmt(r["student"]), fmt(r["delta"], signed=True)]
        line += [ci_text(r), status, r["version"] or ""]
        if has_ref:
            ref = r.get("reference") or {}
            line += [fmt(ref.get(k), 1) for k in ("teacher", "student")]
            line.append(fmt(ref.get("delta"), 1, signed=True))
        body.append(line)
    return header, body


DECOMPOSITION = ["benchmark", "teacher", "int4 exact", "prerouted, no LoRA", "student"]
DECOMPOSITION += ["quantization loss", "routing loss", "LoRA recovery", "total gap"]
DECOMPOSITION_TEXT = (
    "quantization loss = teacher - int4 exact; routing loss = int4 exact - "
    "prerouted (no LoRA); LoRA recovery = student - prerouted (no LoRA); "
    "total gap = teacher - student = quantization + routing - recovery.\n"
)


def decomposition_rows(report: dict) -> list[list]:
    decs = [
        (r["benchmark"], r["decomposition"])
        for r in report["benchmarks"]
        if r["decomposition"]
    ]
    if decs and report["average"]["decomposition"]:
        decs.append(("average", report["average"]["decomposition"]))
    scores = ("teacher", "int4_exact", "prerouted_nolora", "student")
    steps = ("quantization_loss", "routing_loss", "lora_recovery", "total_gap")
    return [
        [n, *(fmt(d[k]) for k in scores), *(fmt(d[k], signed=True) for k in steps)]
        for n, d in decs
    ]


FLIPS = ["benchmark", "arm", "items", "right to wrong", "wrong to right"]
FLIPS += ["flip rate % [95% CI]", "net (points)"]


NO_FLIPS = (
    "Flips: not computed; this report carries no per-item outcomes (a v1 report.json): "
    "make it again with `edge0-eval report` from its run folders."
)


def flip_rows(report: dict) -> list[list]:
    return [
        [r["benchmark"], arm, f["items"], f["right_to_wrong"], f["wrong_to_right"]]
        + [f"{f['flip_rate']:.1f} [{lo:.1f}, {hi:.1f}]", fmt(f["net"], signed=True)]
        for r in report["benchmarks"]
        for arm, f in (r.get("flips") or {}).items()
        for lo, hi in [f["flip_rate_ci95"]]
    ]


TRUNCATION = ["benchmark", "arm", "outputs", "cut at the limit", "cut inside thinking"]
TRUNCATION += ["vs teacher (points)"]
TRUNCATION_TEXT = (
    "Outputs that stopped at the length limit (max_out_len), and of those the ones "
    "still inside their thinking block (scored by the open-thinking rule above). "
    "vs teacher: the arm's rate minus the teacher's, paired on items (clustered by "
    "item), with its 95% interval and the two-sided mid-p value of a paired sign-flip "
    f"test of the per-item differences; FLAG: p < {FLAG_ALPHA:g}. n/a: the arm's "
    "predictions carry no finish reasons.\n"
)


def truncation_rows(report: dict) -> list[list]:
    rows = []
    for r in report["benchmarks"]:
        for a, v in r["arms"].items():
            t = v.get("truncation")
            cells = (
                [
                    t["outputs"],
                    f"{t['length']} ({100 * t['length'] / t['outputs']:.1f}%)",
                ]
                + [t["open_thinking"]]
                if t
                else ["n/a"] * 3
            )
            diff = truncation_diff(v.get("truncation_vs_teacher"), a)
            rows.append([r["benchmark"], a, *cells, diff])
    return rows


ENGINE = ["arm", "model", "samples", "decode tok/s per row (mean)", "batch size (max)"]
ENGINE += ["batch decode tok/s (mean)", "prefill tok/s (mean)", "peak memory GiB (max)"]
ENGINE += ["tokens", "cache"]


def engine_rows(report: dict) -> list[list]:
    rows = []
    for arm, stats in report["engine"].items():
        abbr = report["arms"][arm]["abbr"]
        if stats is None:
            rows.append([arm, abbr] + ["n/a"] * 8)
            continue
        cache = (
            ", ".join(f"{k} {v}" for k, v in sorted(stats["cache"].items())) or "n/a"
        )
        rows.append(
            [arm, abbr, stats["samples"], fmt(stats["decode_tok_s"])]
            + [stats.get("batch_size", 1), fmt(stats.get("batch_decode_tok_s"))]
            + [fmt(stats["prefill_tok_s"]), fmt(stats["peak_memory_gib"])]
            + [stats["tokens"] if stats["tokens"] is not None else "n/a", cache]
        )
    return rows


def plot_rows(report: dict) -> list[dict]:
    average = report["average"]
    status = "ok" if average["benchmarks"] else "n/a"
    return report["benchmarks"] + [dict(average, benchmark="average", status=status)]


def score(row: dict, arm: str) -> float | None:
    if arm in ("teacher", "student"):
        return row[arm]
    return (row.get("decomposition") or {}).get(arm)


def plot_informative(report: dict) -> bool:
    """False when every bar would be zero (or missing): such a plot says nothing."""
    return any(score(r, a) for r in plot_rows(report) for a in report["arms"])
