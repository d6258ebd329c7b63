"""The fidelity section of the gap report.

Reads each arm's fidelity results (configs/datasets/edge0_fidelity.py: per-item kl, agreement,
nll, greedy_match, source in `details`) from the OpenCompass runs the report reads. Per arm: the
means, a 95% interval from the paired per-item differences against the teacher (mean +- t *
sd / sqrt(n), as the benchmark tables), a per-source breakdown, and the decomposition
  quantization   int4_exact        vs teacher
  routing        prerouted_nolora  vs int4_exact
  LoRA recovery  student           vs prerouted_nolora (positive: the LoRA brought it back)
in KL (nats) and agreement (points). The teacher row is a sanity check: KL 0, agreement 100.

Its gate checks (and their defaults) are evaluation/gate/fidelity_checks.py.
"""

from __future__ import annotations

import json
import math

from edge0_eval.errors import Edge0Error
from edge0_eval.evaluation.fidelity import positions as fidelity_positions
from edge0_eval.evaluation.fidelity.sets import DATASET_ABBR, METRICS
from edge0_eval.evaluation.outputs.runs import Run
from edge0_eval.evaluation.outputs.samples import mean_half_width

ARMS = ("teacher", "int4_exact", "prerouted_nolora", "student")
# (step, arm a, arm b): the step's figure is KL(a) - KL(b) and agreement(b) - agreement(a), so
# quantization and routing are losses and lora_recovery a gain, each positive when as named.
STEPS = (
    ("quantization", "int4_exact", "teacher"),
    ("routing", "prerouted_nolora", "int4_exact"),
    ("lora_recovery", "prerouted_nolora", "student"),
)
# The teacher scored on its own set reproduces its numbers exactly; allow float noise only.
SANITY_KL = 1e-9
# sets.score_item's per-position fields, each with its nesting depth (lists in lists).
POSITION_KEYS = {"kl_positions": 1, "agree_positions": 1, "rkl_positions": 1}
POSITION_KEYS.update({"dp_positions": 1, "top_positions": 3, "tokens": 1})
PAGE_PROMPTS = 25  # prompts per arm on the page (worst KL first); all in results


def is_fidelity(dataset: str) -> bool:
    return dataset.startswith(DATASET_ABBR)


def _first(value):
    # OpenCompass regroups details per example, each key a list over replicas (n = 1 here).
    return value[0] if isinstance(value, list) and value else value


def _depth(value) -> int:
    return 1 + _depth(value[0]) if isinstance(value, list) and value else 0


def _per_position(value, depth: int = 1) -> list | None:
    """A per-position list of a detail, regrouped (one level more) or not; None if absent."""
    if isinstance(value, list) and value and _depth(value) > depth:
        value = value[0]
    return value if isinstance(value, list) else None


def load_arm(abbr: str, run: Run) -> dict:
    """{status, dataset, items: {id: {metric..., source}}, notes} of one arm's fidelity."""
    datasets = [d for d in run.datasets if is_fidelity(d)]
    out = {"abbr": abbr, "status": "missing", "dataset": None, "items": {}, "notes": []}
    if not datasets:
        out["notes"].append(f"{abbr}: no fidelity dataset in {run.path}")
        return out
    out["dataset"] = datasets[0]
    path = run.path / "results" / abbr / f"{datasets[0]}.json"
    try:
        result = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        out["status"] = "failed"
        out["notes"].append(f"{path}: unreadable or missing ({type(exc).__name__})")
        return out
    if "error" in result or not result.get("details"):
        out["status"] = "failed"
        out["notes"].append(f"{path}: {result.get('error') or 'no per-item details'}")
        return out
    details = result["details"]
    details = list(details.values()) if isinstance(details, dict) else details
    for detail in details:
        if not isinstance(detail, dict) or "id" not in detail:
            continue
        row = {
            m: _detail_number(path, _first(detail["id"]), m, _first(detail[m]))
            for m in METRICS
            if m in detail
        }
        _check_item(path, _first(detail["id"]), row)
        if len(row) != len(METRICS):
            out["status"] = "failed"
            out["notes"].append(
                f"{path}: item {_first(detail['id'])} lacks one of {METRICS}"
            )
            return out
        row["source"] = str(_first(detail.get("source", "")))
        # Results written before per-position figures were recorded have none (no profile).
        for key, depth in POSITION_KEYS.items():
            row[key] = _per_position(detail.get(key), depth)
        row["prompt"], row["pieces"] = (
            _first(detail.get(k)) for k in ("prompt", "pieces")
        )
        out["items"][str(_first(detail["id"]))] = row
    out["status"] = "ok" if out["items"] else "failed"
    return out


KL_ROUNDING = 1e-6  # a per-item mean KL this far below 0 is rounding, not corruption


def _detail_number(path, item, metric: str, value) -> float:
    """A metric of one item's details as the evaluator writes it: a JSON number (a string such
    as "abc" or "0.5", a bool, null or NaN is a corrupt file, not something to convert)."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
    ):
        raise Edge0Error(
            f"{path}: item {item}: {metric} is {value!r}, not a finite number; the "
            f"fidelity results are corrupt, re-run that task (delete the file)"
        )
    return float(value)


def _check_item(path, item, row: dict) -> None:
    """Details hold KL in nats (finite, >= 0 but for rounding: an arm within float32 rounding
    of the teacher can score -1e-8) and agreement as a share in [0, 1]."""
    kl, agreement = row.get("kl"), row.get("agreement")
    if kl is not None and not (math.isfinite(kl) and kl >= -KL_ROUNDING):
        raise Edge0Error(
            f"{path}: item {item}: kl {kl} is not a finite number >= 0; the "
            f"fidelity results are corrupt, re-run that task (delete the file)"
        )
    if agreement is not None and not 0.0 <= agreement <= 1.0:
        raise Edge0Error(
            f"{path}: item {item}: agreement {agreement} is not a share in [0, 1]; "
            f"the fidelity results are corrupt, re-run that task (delete the file)"
        )


def teacher_sane(kl: float, agreement: float) -> bool:
    """The teacher on its own set: KL 0 (float noise allowed), agreement 100 points."""
    return abs(kl) <= SANITY_KL and agreement == 100.0


def _scale(metric: str) -> float:
    return 100.0 if metric == "agreement" else 1.0  # agreement in points


def _summary(items: dict, ids: list[str], teacher: dict | None) -> dict:
    out = {"items": len(ids)}
    for m in METRICS:
        values = [items[i][m] * _scale(m) for i in ids]
        out[m] = sum(values) / len(values)
        if teacher is not None:
            _, hw = mean_half_width(
                [v - teacher[i][m] * _scale(m) for i, v in zip(ids, values)]
            )
            out[f"{m}_half_width"] = hw
    return out


def build(arms: dict) -> dict | None:
    """The report's `fidelity` entry from arm -> (abbr, run); None when no run has fidelity."""
    if not any(is_fidelity(d) for _, r in arms.values() for d in r.datasets):
        return None
    return summarize({arm: load_arm(abbr, r) for arm, (abbr, r) in arms.items()})


def arm_items(abbr: str, rows: list[dict]) -> dict:
    """load_arm's shape from scored rows (fidelity.score_model): for tests and tools."""
    return {
        "abbr": abbr,
        "status": "ok",
        "dataset": DATASET_ABBR,
        "notes": [],
        "items": {
            r["id"]: {
                **{m: float(r[m]) for m in METRICS},
                "source": r["source"],
                **{k: r.get(k) for k in (*POSITION_KEYS, "prompt", "pieces")},
            }
            for r in rows
        },
    }


def _arm_entry(arm: str, got: dict, ids: list[str], teacher, notes: list) -> dict:
    """One arm's row of the section: means, intervals, per source, positions, figures."""
    entry = {"abbr": got["abbr"], "status": got["status"], "dataset": got["dataset"]}
    if got["status"] == "ok" and ids and set(got["items"]) != set(ids):
        entry["status"] = "items_mismatch"
        notes.append(
            f"fidelity: {arm} {got['abbr']} scored {len(got['items'])} items, "
            f"the teacher {len(ids)}; not paired"
        )
    if entry["status"] != "ok" or not ids:
        return entry
    # The teacher's interval against itself says nothing: none.
    versus = None if arm == "teacher" else teacher["items"]
    entry.update(_summary(got["items"], ids, versus))
    sources = sorted({got["items"][i]["source"] for i in ids})
    entry["by_source"] = {
        s: _summary(
            got["items"], [i for i in ids if got["items"][i]["source"] == s], versus
        )
        for s in sources
    }
    rows = [got["items"][i] for i in ids]
    if all(r.get("kl_positions") is not None for r in rows):
        entry["positions"] = fidelity_positions.profile(
            [(r["kl_positions"], r["agree_positions"]) for r in rows]
        )
    else:
        notes.append(
            f"fidelity: {arm} {got['abbr']}: no per-position figures (results "
            f"from before they were recorded); re-run its fidelity task for "
            f"the position view"
        )
    entry["figures"] = fidelity_positions.figures(
        rows, [teacher["items"][i] for i in ids]
    )
    return entry


def _decomposition(loaded: dict, table: dict, ids: list[str]) -> dict:
    out = {}
    for step, a, b in STEPS:
        if not ids or any(table.get(x, {}).get("status") != "ok" for x in (a, b)):
            continue
        out[step] = {
            m: dict(
                zip(
                    ("delta", "half_width"),
                    mean_half_width(
                        [
                            sign
                            * (loaded[a]["items"][i][m] - loaded[b]["items"][i][m])
                            * _scale(m)
                            for i in ids
                        ]
                    ),
                )
            )
            for m, sign in (("kl", 1.0), ("agreement", -1.0))
        }
    return out


def _sanity(table: dict, notes: list) -> dict | None:
    if table.get("teacher", {}).get("status") != "ok":
        return None
    t = table["teacher"]
    sanity = {"kl": t["kl"], "agreement": t["agreement"]}
    sanity["ok"] = teacher_sane(t["kl"], t["agreement"])
    if not sanity["ok"]:
        notes.append(
            f"fidelity: the teacher arm scores KL {t['kl']:.3g}, agreement "
            f"{t['agreement']:.2f} on its own set: the set was made from another "
            f"teacher, path or backend (a v1 set of a bailing_hybrid teacher: make "
            f"it again, fidelity/sets.py)"
        )
    return sanity


def _pages(loaded: dict, table: dict, ids: list[str]) -> tuple[dict, dict]:
    """The page's token view: per non-teacher arm its PAGE_PROMPTS worst prompts by KL, each
    position's (KL, arm's top three of the teacher's top-k); and those prompts' text."""
    pages, prompts = {}, {}
    for arm, entry in table.items():
        items = loaded[arm]["items"]
        ok = arm != "teacher" and entry["status"] == "ok"
        shown = [
            i for i in ids if ok and items[i]["top_positions"] and items[i]["tokens"]
        ]
        if not shown:
            continue
        worst = sorted(shown, key=lambda i: -items[i]["kl"])[:PAGE_PROMPTS]
        pages[arm] = [
            {
                "id": i,
                "kl": items[i]["kl"],
                "positions": [
                    list(p)
                    for p in zip(items[i]["kl_positions"], items[i]["top_positions"])
                ],
            }
            for i in worst
        ]
        for i in worst:
            prompts[i] = {
                k: items[i].get(k) for k in ("source", "prompt", "tokens", "pieces")
            }
    return pages, prompts


def summarize(loaded: dict) -> dict:
    """The section from arm -> load_arm(...) results."""
    notes = [n for a in loaded.values() for n in a["notes"]]
    teacher = loaded.get("teacher")
    ids = sorted(teacher["items"]) if teacher and teacher["status"] == "ok" else []
    table = {
        arm: _arm_entry(arm, got, ids, teacher, notes) for arm, got in loaded.items()
    }
    per_item = {
        arm: {
            i: [loaded[arm]["items"][i]["kl"], loaded[arm]["items"][i]["agreement"]]
            for i in ids
        }
        for arm, e in table.items()
        if e["status"] == "ok" and ids
    }
    sanity = _sanity(table, notes)
    ok = (
        bool(ids)
        and all(e["status"] == "ok" for e in table.values())
        and bool(sanity and sanity["ok"])
    )
    pages, prompts = _pages(loaded, table, ids)
    return {
        "status": "ok" if ok else "incomplete",
        "items": len(ids),
        "units": UNITS,
        "interval": "95%, paired per-item differences against the teacher",
        "arms": table,
        "decomposition": _decomposition(loaded, table, ids),
        "teacher_sanity": sanity,
        "per_item": per_item,
        "pages": pages,
        "prompts": prompts,
        "notes": notes,
    }


UNITS = {  # the figures' units: docs/gate.md (the report)
    "kl": "nats, KL(teacher || arm) over the teacher's top-k + tail",
    "agreement": "points: % of positions whose argmax is the teacher's token",
    "nll": "nats per teacher token",
    "greedy_match": "positions",
}


# --------------------------------------------------------------------------- writers


def _f(value, digits: int = 4, signed: bool = False) -> str:
    if value is None:
        return "n/a"
    return f"{value:+.{digits}f}" if signed else f"{value:.{digits}f}"


def _pm(value, hw, digits: int) -> str:
    return _f(value, digits) + (f" \u00b1{hw:.{digits}f}" if hw is not None else "")


def _table(header, rows) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return (
        "\n".join(lines + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows])
        + "\n"
    )


def markdown(fid: dict | None) -> str:
    if fid is None:
        return ""
    md = [
        "## Fidelity (teacher-forced)\n",
        f"Each arm's next-token log-probs on the teacher's own greedy continuations, "
        f"{fid['items']} prompts; KL(teacher || arm) in nats over the teacher's top-k plus a "
        f"tail bucket, agreement = % of positions where the arm's argmax is the teacher's "
        f"token, NLL of the teacher's tokens, greedy match = positions before the first "
        f"disagreement. \u00b1: {fid['interval']}. Status: {fid['status']}.\n",
    ]
    rows = []
    for arm, e in fid["arms"].items():
        if e["status"] != "ok" or "kl" not in e:
            rows.append([arm, e["abbr"], e["status"], "", "", "", ""])
            continue
        rows.append(
            [
                arm,
                e["abbr"],
                e["items"],
                _pm(e["kl"], e.get("kl_half_width"), 4),
                _pm(e["agreement"], e.get("agreement_half_width"), 2),
                _pm(e["nll"], e.get("nll_half_width"), 3),
                _pm(e["greedy_match"], e.get("greedy_match_half_width"), 2),
            ]
        )
    md.append(
        _table(
            ["arm", "model", "items", "KL", "agreement", "NLL", "greedy match"], rows
        )
    )
    if fid["decomposition"]:
        md.append(
            "Decomposition: quantization loss = int4 exact vs teacher, routing loss = "
            "prerouted no LoRA vs int4 exact, LoRA recovery = student vs prerouted no LoRA; "
            "KL in nats (rise for a loss, fall for the recovery), agreement in points "
            "(drop for a loss, gain for the recovery); positive = as named.\n"
        )
        md.append(
            _table(
                ["step", "KL", "agreement"],
                [
                    [
                        s,
                        _pm(d["kl"]["delta"], d["kl"]["half_width"], 4),
                        _pm(d["agreement"]["delta"], d["agreement"]["half_width"], 2),
                    ]
                    for s, d in fid["decomposition"].items()
                ],
            )
        )
    src_rows = [
        [
            arm,
            s,
            v["items"],
            _f(v["kl"]),
            _f(v["agreement"], 2),
            _f(v["nll"], 3),
            _f(v["greedy_match"], 2),
        ]
        for arm, e in fid["arms"].items()
        for s, v in (e.get("by_source") or {}).items()
    ]
    if src_rows:
        md.append("Per source:\n")
        md.append(
            _table(
                ["arm", "source", "items", "KL", "agreement", "NLL", "greedy match"],
                src_rows,
            )
        )
    if fid["notes"]:
        md.extend(f"- {n}" for n in fid["notes"])
        md.append("")
    md.append(fidelity_positions.markdown(fid["arms"]))
    md.append(figures_markdown(fid["arms"]))
    md.append("![fidelity](fidelity.png)\n")
    return "\n".join(md)


def _ci(entry: dict | None, digits: int) -> str:
    if not entry:
        return "n/a"
    ci = entry["ci95"]
    return _f(entry["value"], digits) + (
        f" [{ci[0]:.{digits}f}, {ci[1]:.{digits}f}]" if ci else ""
    )


def figure_tables(arms: dict) -> list[tuple[str, list, list]]:
    """llama.cpp's `--kl-divergence` figures per arm, pooled over positions, as (text,
    header, rows) tables; none without figures."""
    have = {a: e["figures"] for a, e in arms.items() if e.get("figures")}
    if not have:
        return []
    qs = [*fidelity_positions.FIGURE_QUANTILES, "max"]
    directions = (
        ("KL(teacher \u2016 arm)", "kl"),
        ("KL(arm \u2016 teacher)", "reverse_kl"),
    )
    kl_rows = [
        [a, label, f["positions"], _pm(f[key]["mean"], f[key]["se"], 5)]
        + [_f(f[key][q], 5) for q in qs]
        for a, f in have.items()
        for label, key in directions
    ]
    dqs = ["mean", "rms", "min", *fidelity_positions.DP_QUANTILES, "max"]
    dp_rows = [
        [a, *(_f(f["delta_p"][q], 4, signed=q != "rms") for q in dqs)]
        + [f"{100 * f['delta_p']['share_large']:.2f}%"]
        + [_ci(f["agreement"], 2), _ci(f["ppl_ratio"], 4)]
        for a, f in have.items()
    ]
    large = f"share abs(delta p) > {fidelity_positions.DP_LARGE:g}"
    return [
        (
            "Pooled over every position of every prompt, as llama.cpp's `llama-perplexity "
            "--kl-divergence` reports them; both KL directions over the same top-k plus "
            "tail buckets, mean \u00b1 its standard error clustered by prompt:",
            ["arm", "direction", "positions", "mean \u00b1 SE", *qs],
            kl_rows,
        ),
        (
            "delta p: the arm's minus the teacher's probability of the teacher's token "
            f"(mean, RMS, percentiles; {large}); same top: agreement in % with "
            "its 95% interval clustered by prompt; PPL ratio: perplexity of the teacher's "
            "tokens, arm / teacher, with its 95% interval (clustered by prompt, on the log):",
            ["arm", *(f"delta p {q}" for q in dqs), large, "same top %", "PPL ratio"],
            dp_rows,
        ),
    ]


def figures_markdown(arms: dict) -> str:
    return "\n".join(
        f"{text}\n\n{_table(header, rows)}"
        for text, header, rows in figure_tables(arms)
    )


def _flat(value, prefix: str = "") -> dict:
    """{"kl_mean": ..., "agreement_ci95_low": ...} from the nested figures."""
    if isinstance(value, dict):
        return {
            k: v
            for key, sub in value.items()
            for k, v in _flat(sub, f"{prefix}{key}_").items()
        }
    if isinstance(value, list):
        return {f"{prefix}low": value[0], f"{prefix}high": value[1]}
    return {prefix.rstrip("_"): value}


def csv_rows(fid: dict | None) -> tuple[list[str], list[dict]]:
    """fidelity.csv: one row per arm with figures (columns, rows); none without."""
    arms = ((fid or {}).get("arms") or {}).items()
    rows = [{"arm": a, **_flat(e["figures"])} for a, e in arms if e.get("figures")]
    return list(dict.fromkeys(k for r in rows for k in r)), rows


def write_plot(fid: dict | None, path) -> None:
    if fid is None:
        return
    import matplotlib  # slow import: plotting only (gate reads this module too)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # slow import: plotting only

    arms = [
        a
        for a in ARMS
        if fid["arms"].get(a, {}).get("status") == "ok" and "kl" in fid["arms"][a]
    ]
    groups = ["all"] + sorted(
        {s for a in arms for s in fid["arms"][a].get("by_source", {})}
    )
    by_position = any(fid["arms"].get(a, {}).get("positions") for a in arms)
    fig, axes = plt.subplots(
        1, 3 if by_position else 2, figsize=(16 if by_position else 11, 4)
    )
    width = 0.8 / max(1, len(arms))
    for ax, metric, label in (
        (axes[0], "kl", "KL(teacher || arm), nats (lower is better)"),
        (axes[1], "agreement", "top-1 agreement, % (higher is better)"),
    ):
        for i, arm in enumerate(arms):
            e = fid["arms"][arm]
            values = [
                e[metric] if g == "all" else e["by_source"].get(g, {}).get(metric, 0.0)
                for g in groups
            ]
            errs = [
                (e if g == "all" else e["by_source"].get(g, {})).get(
                    f"{metric}_half_width"
                )
                or 0.0
                for g in groups
            ]
            xs = [j + (i - (len(arms) - 1) / 2) * width for j in range(len(groups))]
            ax.bar(xs, values, width, yerr=errs, capsize=3, label=arm)
        ax.set_xticks(range(len(groups)), groups)
        ax.set_title(label, fontsize=9)
    axes[1].set_ylim(0, 105)
    if by_position:
        fidelity_positions.plot(axes[2], {a: fid["arms"][a] for a in arms})
    else:
        # off the bars
        axes[1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.suptitle(
        f"teacher-forced fidelity, {fid['items']} prompts (error bars: 95% paired "
        f"interval vs the teacher)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
