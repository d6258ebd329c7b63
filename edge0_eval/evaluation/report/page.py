"""report.html: the report as one page people read, offline and self-contained.

The same figures as report.md (tables.py) and where they come from: each flipped item's
question and both answers side by side, the first difference marked; per fidelity prompt, the
teacher's continuation with each token shaded by the arm's KL (hover: the teacher's token, the
arm's likeliest tokens), worst prompts first; the plots, KL by position among them. No script,
no request outside the file (plots inlined, the style page.css): `<details>` opens and closes.
Every text that came from a dataset or a model is escaped: it shows as its characters.
"""

from __future__ import annotations

import base64
from html import escape
from pathlib import Path

from edge0_eval.evaluation.fidelity import report as fidelity_report
from edge0_eval.evaluation.report import tables

CSS = Path(__file__).with_name("page.css")


def _cells(row, tag: str = "td") -> str:
    return "".join(f"<{tag}>{escape(str(c))}</{tag}>" for c in row)


def _table(header: list, rows: list) -> str:
    body = "".join(f"<tr>{_cells(r)}</tr>" for r in rows)
    return f"<table><tr>{_cells(header, 'th')}</tr>{body}</table>"


def _section(key: str, title: str, *parts: str) -> str:
    return f'<section id="{key}"><h2>{escape(title)}</h2>{"".join(parts)}</section>'


def _block(key: str, title: str, text: str, header: list, rows: list) -> str:
    """A section of one table (and its text before it); nothing without rows."""
    return (
        _section(key, title, _p(text) if text else "", _table(header, rows))
        if rows
        else ""
    )


def _p(text: str) -> str:
    return f"<p>{escape(text)}</p>"


def first_difference(a: str, b: str) -> int:
    """Where the two texts first differ (the shorter one's length when one starts the other)."""
    return next(
        (i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))
    )


def _marked(text: str, at: int) -> str:
    """`text` escaped, its character at `at` marked and the rest after it shaded."""
    head, mark, rest = text[:at], text[at : at + 1], text[at + 1 :]
    mark = f"<mark>{escape(mark)}</mark>" if mark else "<mark>(ends here)</mark>"
    return f'{escape(head)}{mark}<span class="rest">{escape(rest)}</span>'


def _flipped_item(bench: str, arm: str, item: str, t: dict) -> str:
    at = first_difference(t["teacher"], t["arm"])
    (ts, as_) = t["scores"]
    kind = "right to wrong" if as_ < ts else "wrong to right"
    sides = "".join(
        f'<div><h4>{escape(who)}: score {s:.2f}</h4><div class="text">{_marked(text, at)}'
        "</div></div>"
        for who, s, text in (("teacher", ts, t["teacher"]), (arm, as_, t["arm"]))
    )
    return (
        f"<details><summary>{escape(f'{bench} · {arm} · item {item} · {kind}')}</summary>"
        f"<h4>question</h4><pre>{escape(t['question'])}</pre>"
        f'<div class="pair">{sides}</div></details>'
    )


def _flips(report: dict) -> str:
    rows = tables.flip_rows(report)
    if not rows:
        old = any("flips" not in r for r in report["benchmarks"])
        return _section("flips", "Flips", _p(tables.NO_FLIPS)) if old else ""
    items = []
    for r in report["benchmarks"]:
        for arm, f in (r.get("flips") or {}).items():
            flipped = f["right_to_wrong"] + f["wrong_to_right"]
            items += [
                _flipped_item(r["benchmark"], arm, i, t) for i, t in f["texts"].items()
            ]
            if flipped > len(f["texts"]):
                items.append(
                    _p(
                        f"{r['benchmark']}, {arm}: {len(f['texts'])} of {flipped} flipped "
                        "items shown; every id is in report.json"
                    )
                )
    return _section(
        "flips", "Flips", _p(tables.FLIPS_TEXT), _table(tables.FLIPS, rows), *items
    )


def _token(tid: int, kl: float, top: list, pieces: dict, scale: float) -> str:
    text = pieces.get(str(tid), f"#{tid}")
    alts = ", ".join(f"{pieces.get(str(i), f'#{i}')!r} {p:.3f}" for i, p in top)
    hover = f"teacher's token {text!r} · KL {kl:.4g} · arm's top: {alts}"
    return (
        f'<span class="tok" style="--a:{min(1.0, kl / scale):.2f}" '
        f'title="{escape(hover)}">{escape(text)}</span>'
    )


def _prompt(arm: str, page: dict, prompt: dict, scale: float, open_: bool) -> str:
    pieces = prompt.get("pieces") or {}
    tokens = "".join(
        _token(tid, kl, top, pieces, scale)
        for tid, (kl, top) in zip(prompt["tokens"], page["positions"])
    )
    head = f"{arm} · prompt {page['id']} ({prompt.get('source')}) · KL {page['kl']:.4g}"
    return (
        f"<details{' open' if open_ else ''}><summary>{escape(head)}</summary>"
        f"<h4>prompt</h4><pre>{escape(prompt.get('prompt') or '')}</pre>"
        f'<h4>teacher\'s continuation</h4><div class="tokens">{tokens}</div></details>'
    )


def _tokens(fid: dict) -> str:
    parts = []
    for arm, pages in (fid.get("pages") or {}).items():
        kls = sorted(kl for p in pages for kl, _ in p["positions"])
        scale = max(kls[int(0.99 * (len(kls) - 1))], 1e-9)  # p99: full colour
        parts.append(
            f"<h3>{escape(arm)}</h3>"
            + _p(
                f"{len(pages)} of {fid['items']} prompts, worst mean KL first; full "
                f"colour at KL {scale:.4g} nats (the shown positions' 99th percentile)"
            )
        )
        parts += [
            _prompt(arm, p, fid["prompts"][p["id"]], scale, n == 0)
            for n, p in enumerate(pages)
        ]
    return f'<div id="tokens">{"".join(parts)}</div>' if parts else ""


def _fidelity(fid: dict | None, png: Path) -> str:
    if not fid:
        return ""
    tables_ = [
        _p(text) + _table(header, rows)
        for text, header, rows in fidelity_report.figure_tables(fid["arms"])
    ]
    means = [
        [
            a,
            e["abbr"],
            e.get("items", ""),
            *(tables.fmt(e.get(m), 4) for m in fidelity_report.METRICS),
        ]
        for a, e in fid["arms"].items()
    ]
    return _section(
        "fidelity",
        "Fidelity (teacher-forced)",
        _table(["arm", "model", "items", *fidelity_report.METRICS], means),
        *tables_,
        _p("KL and agreement per source, and KL by continuation position:"),
        _png(png, "fidelity"),
        _tokens(fid),
    )


def _png(path: Path, alt: str) -> str:
    """A plot inlined (the page is one file); nothing when the report has none."""
    if not path.is_file():
        return ""
    data = base64.b64encode(path.read_bytes()).decode()
    return f'<img alt="{alt}" src="data:image/png;base64,{data}" width="900">'


def render(report: dict, folder: Path) -> str:
    """The page of `report`, its plots read from `folder`."""
    header, rows = tables.headline_rows(report)
    arms = ", ".join(f"{a} = {v['abbr']}" for a, v in report["arms"].items())
    body = [
        f'<p class="meta">{escape(report["created"])} · <code>{escape(report["command"])}'
        f"</code><br>arms: {escape(arms)}</p>",
        '<nav><a href="#headline">headline</a><a href="#flips">flips</a>'
        '<a href="#fidelity">fidelity</a><a href="#tokens">tokens</a>'
        '<a href="#truncation">truncation</a><a href="#engine">engine</a></nav>',
        _section(
            "headline",
            "Headline",
            _table(header, rows),
            _png(folder / "report.png", "scores")
            if tables.plot_informative(report)
            else _p(tables.NO_PLOT.strip()),
        ),
    ]
    body += [
        _block(
            "decomposition",
            "Gap decomposition",
            tables.DECOMPOSITION_TEXT,
            tables.DECOMPOSITION,
            tables.decomposition_rows(report),
        ),
        _flips(report),
        _fidelity(report.get("fidelity"), folder / "fidelity.png"),
        _block(
            "truncation",
            "Truncation",
            tables.TRUNCATION_TEXT,
            tables.TRUNCATION,
            tables.truncation_rows(report),
        ),
        _block("engine", "Engine stats", "", tables.ENGINE, tables.engine_rows(report)),
        _block("notes", "Notes", "", ["note"], [[n] for n in report["notes"]]),
    ]
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        "<title>Teacher-vs-student gap report</title>"
        f"<style>{CSS.read_text(encoding='utf-8')}</style></head><body>"
        f"<h1>Teacher-vs-student gap report</h1>{''.join(body)}</body></html>\n"
    )


def write_page(report: dict, path: Path) -> None:
    path.write_text(render(report, path.parent), encoding="utf-8")
