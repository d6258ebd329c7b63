"""The report's files: report.json, report.csv, report.md, report.html (page.py) and
report.png (and fidelity.png, fidelity.csv).

Everything here reads the dict `gap.build_report` makes; nothing is computed anew.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

from edge0_eval.errors import ConfigError, Edge0Error
from edge0_eval.evaluation.fidelity import report as fidelity_report
from edge0_eval.evaluation.report import page
from edge0_eval.evaluation.report.tables import (
    DECOMPOSITION,
    DECOMPOSITION_TEXT,
    ENGINE,
    FLIPS,
    FLIPS_TEXT,
    NO_FLIPS,
    NO_PLOT,
    TRUNCATION,
    TRUNCATION_TEXT,
    decomposition_rows,
    engine_rows,
    flip_rows,
    fmt,
    headline_rows,
    metric_label,
    plot_informative,
    plot_rows,
    score,
    truncation_rows,
)

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
    _write_rows(out / "fidelity.csv", *fidelity_report.csv_rows(report.get("fidelity")))
    if plot_informative(report):
        _write_plot(report, out / "report.png")
    else:
        (out / "report.png").unlink(missing_ok=True)  # a plot of a former report
    fidelity_report.write_plot(report.get("fidelity"), out / "fidelity.png")
    (out / "report.md").write_text(_markdown(report), encoding="utf-8")
    page.write_page(report, out / "report.html")


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
        "metric": metric_label(row),
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


FLIP_COLUMNS = ("right_to_wrong", "wrong_to_right", "flip_rate")


def _flip_cells(row: dict, arms: list[str]) -> dict:
    """Per non-teacher arm: its flips against the teacher (flips.py), empty when none."""
    cells = {}
    for arm in arms:
        f = (row.get("flips") or {}).get(arm) or {}
        ci = f.get("flip_rate_ci95") or [None, None]
        values = [f.get(k) for k in FLIP_COLUMNS] + ci
        for key, v in zip(
            FLIP_COLUMNS + ("flip_rate_ci_low", "flip_rate_ci_high"), values
        ):
            cells[f"{arm}_{key}"] = "" if v is None else repr(v)
    return cells


def _write_rows(path: Path, columns: list[str], rows: list[dict]) -> None:
    if not rows:
        path.unlink(missing_ok=True)
        return
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)


def _write_csv(report: dict, path: Path) -> None:
    arms = [a for a in report["arms"] if a != "teacher"]
    flips = [c for a in arms for c in _flip_cells({}, [a])]
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS + flips)
        writer.writeheader()
        for row in report["benchmarks"]:
            writer.writerow(
                {**_csv_row(row, row["benchmark"]), **_flip_cells(row, arms)}
            )
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


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def _markdown(report: dict) -> str:
    """report.md: one function per section, in this order."""
    md = _md_header(report) + _md_headline(report)
    md.append(fidelity_report.markdown(report.get("fidelity")))
    for section in (
        _md_decomposition,
        _md_flips,
        _md_pooled,
        _md_extras,
        _md_truncation,
        _md_samples,
        _md_engine,
    ):
        md += section(report)
    if report["notes"]:
        md.append("## Notes\n")
        md.extend(f"- {n}" for n in report["notes"])
        md.append("")
    md.append(
        "![teacher vs student](report.png)\n" if plot_informative(report) else NO_PLOT
    )
    return "\n".join(md)


def _md_header(report: dict) -> list[str]:
    md = [
        "# Teacher-vs-student gap report\n",
        f"- date: {report['created']}",
        f"- command: `{report['command']}`",
        "- arms: "
        + ", ".join(f"{a} = `{v['abbr']}`" for a, v in report["arms"].items()),
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
    if report["reference"] is not None:
        md.append(
            f"- reference: {report['reference'].get('name') or ''} "
            f"{report['reference'].get('source') or ''}".rstrip()
        )
    return md + [""]


def _md_headline(report: dict) -> list[str]:
    md = [_table(*headline_rows(report))]
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
    if report["reference"] is not None and omitted:
        md.append(
            "A reference number is shown only beside a headline of the same definition "
            "(edge0_eval/evaluation/report/definitions.py):\n"
        )
        md.extend(omitted + [""])
    return md


def _md_decomposition(report: dict) -> list[str]:
    rows = decomposition_rows(report)
    if not rows:
        return []
    return ["## Gap decomposition\n", DECOMPOSITION_TEXT, _table(DECOMPOSITION, rows)]


def _md_flips(report: dict) -> list[str]:
    rows = flip_rows(report)
    if not rows:
        old = any("flips" not in r for r in report["benchmarks"])
        return ["## Flips\n", NO_FLIPS + "\n"] if old else []
    ids = [
        f"- {r['benchmark']}, {arm}: right to wrong {', '.join(f['right_to_wrong_ids']) or '-'};"
        f" wrong to right {', '.join(f['wrong_to_right_ids']) or '-'}"
        for r in report["benchmarks"]
        for arm, f in (r.get("flips") or {}).items()
        if f["right_to_wrong"] + f["wrong_to_right"]
    ]
    return [
        "## Flips\n",
        f"{FLIPS_TEXT}\n",
        _table(FLIPS, rows),
        *(["Flipped item ids:\n", *ids, ""] if ids else []),
    ]


def _md_pooled(report: dict) -> list[str]:
    pooled = [
        (r["benchmark"], a, v)
        for r in report["benchmarks"]
        for a, v in r["arms"].items()
        if "categories" in v
    ]
    if not pooled:
        return []
    header = ["benchmark", "arm", "items", "pooled per question", "mean of categories"]
    rows = [
        [b, a, v["items"] or "", fmt(v["score"]), fmt(v["category_mean"])]
        + [len(v["datasets"])]
        for b, a, v in pooled
    ]
    return [
        "## Pooled per question vs mean of categories\n",
        "The headline is pooled over all questions (official MMLU-Pro figure); "
        "OpenCompass's summary group is the unweighted mean of categories.\n",
        _table(header + ["categories"], rows),
    ]


def _md_extras(report: dict) -> list[str]:
    extras = [
        [r["benchmark"], a, m, fmt(s)]
        for r in report["benchmarks"]
        for a, v in r["arms"].items()
        for m, s in v["extra"].items()
    ]
    if not extras:
        return []
    return [
        "## Secondary metrics\n",
        _table(["benchmark", "arm", "metric", "score"], extras),
    ]


def _md_truncation(report: dict) -> list[str]:
    return [
        "## Truncation\n",
        TRUNCATION_TEXT,
        _table(TRUNCATION, truncation_rows(report)),
    ]


def _md_samples(report: dict) -> list[str]:
    repeated = [
        (r["benchmark"], a, v)
        for r in report["benchmarks"]
        for a, v in r["arms"].items()
        if (v.get("samples_per_item") or 1) > 1
    ]
    if not repeated:
        return []
    rows = [
        [b, a, v["items"], v["samples_per_item"]]
        + [f"{fmt(v['score'])} ±{fmt(v.get('score_half_width'))}"]
        + [
            ", ".join(
                f"{k} {fmt(p['score'])} ±{fmt(p['half_width'])}"
                for k, p in (v.get("pass_at_k") or {}).items()
            )
            or "n/a"
        ]
        for b, a, v in repeated
    ]
    return [
        "## Samples per item\n",
        "avg@n: each item's mean over its n samples, then the mean over items; "
        "pass@k (where the benchmark defines it): per item 1 - C(n-c, k)/C(n, k) for "
        "c correct of n, then the mean. ±: 95%, clustered by item (an item's samples "
        "are one observation).\n",
        _table(["benchmark", "arm", "items", "n", "avg@n", "pass@k"], rows),
    ]


def _md_engine(report: dict) -> list[str]:
    return ["## Engine stats\n", _table(ENGINE, engine_rows(report))]


def _write_plot(report: dict, path: Path) -> None:
    # slow import (-X importtime); `gate` imports gap.py for SCHEMA and never plots
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, arms = plot_rows(report), list(report["arms"])  # in ARM_NAMES order
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
