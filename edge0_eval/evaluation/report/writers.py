"""The report's files: report.json, report.csv, report.md and report.png (and fidelity.png).

Everything here reads the dict `gap.build_report` makes; nothing is computed anew.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

from edge0_eval.errors import ConfigError, Edge0Error
from edge0_eval.evaluation.fidelity import report as fidelity_report
from edge0_eval.evaluation.outputs.samples import FLAG_ALPHA

# Plot legend per arm (the arms themselves, and their order, come from report["arms"]).
ARM_LABELS = {
    "teacher": "teacher (fp16)",
    "int4_exact": "int4 exact routing",
    "prerouted_nolora": "prerouted, no LoRA",
    "student": "student",
}


def write_report(report: dict, out: Path) -> None:
    try:
        text = json.dumps(report, indent=2, allow_nan=False) + "\n"
    except ValueError:
        raise Edge0Error(
            "the report holds NaN or infinite values (a corrupt results file?); "
            "refusing to write it: see the results files named in the notes"
        ) from None
    try:
        out.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise ConfigError(f"--out {out}: a file is in the way; name a folder") from None
    (out / "report.json").write_text(text, encoding="utf-8")
    _write_csv(report, out / "report.csv")
    _write_plot(report, out / "report.png")
    fidelity_report.write_plot(report.get("fidelity"), out / "fidelity.png")
    (out / "report.md").write_text(_markdown(report), encoding="utf-8")


CSV_COLUMNS = [
    "benchmark",
    "metric",
    "status",
    "items",
    "version",
    "teacher",
    "student",
    "delta",
    "ci_low",
    "ci_high",
    "half_width",
    "int4_exact",
    "prerouted_nolora",
    "quantization_loss",
    "routing_loss",
    "lora_recovery",
    "ref_teacher",
    "ref_student",
    "ref_delta",
]


def _csv_row(row: dict, name: str) -> dict:
    dec = row.get("decomposition") or {}
    ref = row.get("reference") or {}
    ci = row.get("delta_ci95") or [None, None]
    values = {
        "benchmark": name,
        "metric": _metric_label(row),
        "status": row.get("status", ""),
        "items": row.get("items"),
        "version": row.get("version"),
        "teacher": row["teacher"],
        "student": row["student"],
        "delta": row["delta"],
        "ci_low": ci[0],
        "ci_high": ci[1],
        "half_width": row["delta_half_width"],
        "int4_exact": dec.get("int4_exact"),
        "prerouted_nolora": dec.get("prerouted_nolora"),
        "quantization_loss": dec.get("quantization_loss"),
        "routing_loss": dec.get("routing_loss"),
        "lora_recovery": dec.get("lora_recovery"),
        "ref_teacher": ref.get("teacher"),
        "ref_student": ref.get("student"),
        "ref_delta": ref.get("delta"),
    }
    return {
        k: "" if v is None else (repr(v) if isinstance(v, float) else v)
        for k, v in values.items()
    }


def _write_csv(report: dict, path: Path) -> None:
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        for row in report["benchmarks"]:
            writer.writerow(_csv_row(row, row["benchmark"]))
        avg = report["average"]
        writer.writerow(
            _csv_row(
                {
                    **avg,
                    "status": "ok" if avg["complete"] else "partial",
                    "items": None,
                    "version": None,
                },
                "average",
            )
        )


def _fmt(value, digits: int = 2, signed: bool = False) -> str:
    if value is None:
        return "n/a"
    return f"{value:+.{digits}f}" if signed else f"{value:.{digits}f}"


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def _metric_label(row: dict) -> str:
    """The headline's definition, short: 'pass@1, n=1', 'accuracy, avg@4'."""
    d = row.get("definition")
    if not d:
        return ""
    n = d.get("samples")
    return f"{d['metric']}, " + (
        "n=1" if n == 1 else f"avg@{n}" if n else "avg over samples"
    )


def _truncation_diff(diff: dict | None, arm: str) -> str:
    if arm == "teacher":
        return ""
    if not diff:
        return "n/a"
    half = f" ±{diff['half_width']:.1f}" if diff["half_width"] is not None else ""
    p = f" (p {diff['p_value']:.2g})" if diff.get("p_value") is not None else ""
    return f"{diff['difference']:+.1f}{half}{p}" + (" FLAG" if diff["flag"] else "")


def _ci_text(row: dict) -> str:
    ci = row.get("delta_ci95")
    return f"[{ci[0]:+.2f}, {ci[1]:+.2f}]" if ci else "n/a"


def _markdown(report: dict) -> str:
    arms = report["arms"]
    has_ref = report["reference"] is not None
    md = [
        "# Teacher-vs-student gap report\n",
        f"- date: {report['created']}",
        f"- command: `{report['command']}`",
        "- arms: " + ", ".join(f"{a} = `{v['abbr']}`" for a, v in arms.items()),
        f"- delta = student - teacher, in points; 95% interval: {report['interval']['method']}",
    ]
    rule = report.get("open_thinking") or {}
    if rule.get("rule"):
        meaning = rule["meaning"].get(
            rule["rule"],
            "differs between datasets: "
            + ", ".join(f"{d} {r}" for d, r in rule["datasets"].items()),
        )
        md.append(
            f"- open thinking (an output cut inside `<think>`): {rule['rule']}: {meaning}"
        )
    elif "rule" in rule:
        md.append(
            "- open thinking (an output cut inside `<think>`): rule unknown (no config "
            "dump to read the datasets' postprocessors from)"
        )
    md.append(
        "- metric: what each headline measures per sample, and samples per item (n=1: one; "
        "avg@n: the mean over n samples per item, then over items)"
    )
    if has_ref:
        md.append(
            f"- reference: {report['reference'].get('name') or ''} "
            f"{report['reference'].get('source') or ''}".rstrip()
        )
    md.append("")

    header = [
        "benchmark",
        "metric",
        "items",
        "teacher",
        "student",
        "delta",
        "95% CI",
        "status",
        "version",
    ]
    if has_ref:
        header += ["ref teacher", "ref student", "ref delta"]
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
        line = [
            r["benchmark"],
            _metric_label(r),
            r["items"] if r["items"] is not None else "",
            _fmt(r["teacher"]),
            _fmt(r["student"]),
            _fmt(r["delta"], signed=True),
            _ci_text(r),
            status,
            r["version"] or "",
        ]
        if has_ref:
            ref = r.get("reference") or {}
            line += [
                _fmt(ref.get("teacher"), 1),
                _fmt(ref.get("student"), 1),
                _fmt(ref.get("delta"), 1, signed=True),
            ]
        body.append(line)
    md.append(_table(header, body))
    flags = [
        f"- {r['benchmark']}: {f}"
        for r in report["benchmarks"]
        for f in r.get("truncation_flags") or []
    ]
    if flags:
        md.append(
            "Truncation differs between arms (paired sign-flip test, two-sided p < 0.05; "
            "see Truncation):\n"
        )
        md.extend(flags + [""])
    omitted = [
        f"- {r['benchmark']}: reference left out: {r['reference_omitted']}"
        for r in report["benchmarks"] + [dict(report["average"], benchmark="average")]
        if r.get("reference_omitted")
    ]
    if has_ref and omitted:
        md.append(
            "A reference number is shown only beside a headline of the same definition "
            "(edge0_eval/evaluation/report/definitions.py):\n"
        )
        md.extend(omitted + [""])
    md.append(fidelity_report.markdown(report.get("fidelity")))

    decs = [
        (r["benchmark"], r["decomposition"])
        for r in report["benchmarks"]
        if r["decomposition"]
    ]
    if decs:
        if report["average"]["decomposition"]:
            decs.append(("average", report["average"]["decomposition"]))
        md.append("## Gap decomposition\n")
        md.append(
            "quantization loss = teacher - int4 exact; routing loss = int4 exact - "
            "prerouted (no LoRA); LoRA recovery = student - prerouted (no LoRA); "
            "total gap = teacher - student = quantization + routing - recovery.\n"
        )
        md.append(
            _table(
                [
                    "benchmark",
                    "teacher",
                    "int4 exact",
                    "prerouted, no LoRA",
                    "student",
                    "quantization loss",
                    "routing loss",
                    "LoRA recovery",
                    "total gap",
                ],
                [
                    [
                        n,
                        *(
                            _fmt(d[k])
                            for k in (
                                "teacher",
                                "int4_exact",
                                "prerouted_nolora",
                                "student",
                            )
                        ),
                        *(
                            _fmt(d[k], signed=True)
                            for k in (
                                "quantization_loss",
                                "routing_loss",
                                "lora_recovery",
                                "total_gap",
                            )
                        ),
                    ]
                    for n, d in decs
                ],
            )
        )

    pooled = [
        (r["benchmark"], a, v)
        for r in report["benchmarks"]
        for a, v in r["arms"].items()
        if "categories" in v
    ]
    if pooled:
        md.append("## Pooled per question vs mean of categories\n")
        md.append(
            "The headline is pooled over all questions (official MMLU-Pro figure); "
            "OpenCompass's summary group is the unweighted mean of categories.\n"
        )
        md.append(
            _table(
                [
                    "benchmark",
                    "arm",
                    "items",
                    "pooled per question",
                    "mean of categories",
                    "categories",
                ],
                [
                    [
                        b,
                        a,
                        v["items"] or "",
                        _fmt(v["score"]),
                        _fmt(v["category_mean"]),
                        len(v["datasets"]),
                    ]
                    for b, a, v in pooled
                ],
            )
        )

    extras = [
        (r["benchmark"], a, m, s)
        for r in report["benchmarks"]
        for a, v in r["arms"].items()
        for m, s in v["extra"].items()
    ]
    if extras:
        md.append("## Secondary metrics\n")
        md.append(
            _table(
                ["benchmark", "arm", "metric", "score"],
                [[b, a, m, _fmt(s)] for b, a, m, s in extras],
            )
        )

    md.append("## Truncation\n")
    md.append(
        "Outputs that stopped at the length limit (max_out_len), and of those the ones "
        "still inside their thinking block (scored by the open-thinking rule above). "
        "vs teacher: the arm's rate minus the teacher's, paired on items (clustered by "
        "item), with its 95% interval and the two-sided mid-p value of a paired sign-flip "
        f"test of the per-item differences; FLAG: p < {FLAG_ALPHA:g}. n/a: the arm's "
        "predictions carry no finish reasons.\n"
    )
    md.append(
        _table(
            [
                "benchmark",
                "arm",
                "outputs",
                "cut at the limit",
                "cut inside thinking",
                "vs teacher (points)",
            ],
            [
                [r["benchmark"], a]
                + (
                    [
                        t["outputs"],
                        f"{t['length']} ({100 * t['length'] / t['outputs']:.1f}%)",
                        t["open_thinking"],
                    ]
                    if (t := v.get("truncation"))
                    else ["n/a"] * 3
                )
                + [_truncation_diff(v.get("truncation_vs_teacher"), a)]
                for r in report["benchmarks"]
                for a, v in r["arms"].items()
            ],
        )
    )

    repeated = [
        (r["benchmark"], a, v)
        for r in report["benchmarks"]
        for a, v in r["arms"].items()
        if (v.get("samples_per_item") or 1) > 1
    ]
    if repeated:
        md.append("## Samples per item\n")
        md.append(
            "avg@n: each item's mean over its n samples, then the mean over items; "
            "pass@k (where the benchmark defines it): per item 1 - C(n-c, k)/C(n, k) for "
            "c correct of n, then the mean. ±: 95%, clustered by item (an item's samples "
            "are one observation).\n"
        )
        md.append(
            _table(
                ["benchmark", "arm", "items", "n", "avg@n", "pass@k"],
                [
                    [
                        b,
                        a,
                        v["items"],
                        v["samples_per_item"],
                        f"{_fmt(v['score'])} ±{_fmt(v.get('score_half_width'))}",
                        ", ".join(
                            f"{k} {_fmt(p['score'])} ±{_fmt(p['half_width'])}"
                            for k, p in (v.get("pass_at_k") or {}).items()
                        )
                        or "n/a",
                    ]
                    for b, a, v in repeated
                ],
            )
        )

    md.append("## Engine stats\n")
    eng_rows = []
    for arm, stats in report["engine"].items():
        if stats is None:
            eng_rows.append([arm, arms[arm]["abbr"]] + ["n/a"] * 8)
            continue
        cache = (
            ", ".join(f"{k} {v}" for k, v in sorted(stats["cache"].items())) or "n/a"
        )
        eng_rows.append(
            [
                arm,
                arms[arm]["abbr"],
                stats["samples"],
                _fmt(stats["decode_tok_s"]),
                stats.get("batch_size", 1),
                _fmt(stats.get("batch_decode_tok_s")),
                _fmt(stats["prefill_tok_s"]),
                _fmt(stats["peak_memory_gib"]),
                stats["tokens"] if stats["tokens"] is not None else "n/a",
                cache,
            ]
        )
    md.append(
        _table(
            [
                "arm",
                "model",
                "samples",
                "decode tok/s per row (mean)",
                "batch size (max)",
                "batch decode tok/s (mean)",
                "prefill tok/s (mean)",
                "peak memory GiB (max)",
                "tokens",
                "cache",
            ],
            eng_rows,
        )
    )

    if report["notes"]:
        md.append("## Notes\n")
        md.extend(f"- {n}" for n in report["notes"])
        md.append("")
    md.append("![teacher vs student](report.png)\n")
    return "\n".join(md)


def _write_plot(report: dict, path: Path) -> None:
    # slow import (-X importtime); `gate` imports gap.py for SCHEMA and never plots
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["benchmarks"] + [
        dict(
            report["average"],
            benchmark="average",
            status="ok" if report["average"]["benchmarks"] else "n/a",
        )
    ]
    arms = list(report["arms"])  # build_report lists them in report.ARM_NAMES order

    def score(row, arm):
        if arm in ("teacher", "student"):
            return row[arm]
        return (row.get("decomposition") or {}).get(arm)

    width = 0.8 / len(arms)
    fig, ax = plt.subplots(figsize=(max(7.5, 1.6 * len(rows) + 2.0), 4.5))
    for i, arm in enumerate(arms):
        xs = [j + (i - (len(arms) - 1) / 2) * width for j in range(len(rows))]
        ax.bar(xs, [score(r, arm) or 0.0 for r in rows], width, label=ARM_LABELS[arm])
    for j, r in enumerate(rows):
        ref = r.get("reference") or {}
        top = max(
            [score(r, a) or 0.0 for a in arms] + [ref.get(a) or 0.0 for a in arms]
        )
        if r["status"] == "ok" and r["gap"] is not None:
            half = r.get("delta_half_width")
            text = f"gap {r['gap']:.1f}" + (
                f"\n\u00b1{half:.1f}" if half is not None else ""
            )
        else:
            text = r["status"]
        ax.annotate(
            text,
            (j, top),
            xytext=(0, 3),
            textcoords="offset points",
            ha="center",
            va="bottom",
            fontsize=8,
        )
        for i, arm in enumerate(arms):
            if ref.get(arm) is not None:
                x = j + (i - (len(arms) - 1) / 2) * width
                ax.plot(
                    [x - width / 2, x + width / 2],
                    [ref[arm]] * 2,
                    color="black",
                    lw=1.5,
                )
    ax.set_xticks(range(len(rows)), [r["benchmark"] for r in rows], fontsize=8)
    ax.set_ylabel("score")
    ax.set_ylim(0, 115)
    ax.set_title(
        "teacher vs student"
        + (" (black lines: reference)" if report["reference"] else "")
    )
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))  # off the bars
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
