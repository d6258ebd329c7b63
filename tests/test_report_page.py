"""Flips, the llama.cpp-grade fidelity figures and the page report.html, each number worked by
hand; the page read by a real browser (headless Chromium)."""

from __future__ import annotations

import csv
import json
import math
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from oc_tree import OCRun
from PIL import Image
from test_report import (
    ARMS_4,
    INT4,
    PRE,
    STUDENT,
    TEACHER,
    P,
    Q,
    S,
    T,
    add_model,
    make_report,
    rows,
)

from edge0_eval.evaluation.fidelity import positions as fidelity_positions
from edge0_eval.evaluation.fidelity import report as fidelity_report
from edge0_eval.evaluation.fidelity.sets import score_item
from edge0_eval.evaluation.report import page
from edge0_eval.evaluation.report.flips import wilson
from edge0_eval.evaluation.report.tables import NO_FLIPS, NO_PLOT
from edge0_eval.evaluation.report.writers import write_report

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "reports" / "tiny"
HOSTILE = (
    "<script>document.title='pwned'</script>"
    "<img src=x onerror=\"document.title='pwned'\"></details>"
)


def _run(root: Path, student_aime=("a", "b", "c", "d")) -> Path:
    run = OCRun(root / "outputs" / "default")
    add_model(run, T, TEACHER)
    outputs = {"judge": True, "outputs": list(student_aime)}
    add_model(run, S, STUDENT, aime2026=outputs)
    add_model(run, Q, INT4)
    add_model(run, P, PRE)
    return run.finish()


def test_flips_by_hand(tmp_path, capsys):
    """AIME T 1,1,1,0 S 1,0,1,0: item 1 right to wrong; GPQA T 1,0,1,0 S 1,0,0,1: one each way;
    MMLU-Pro pooled: math/1 right to wrong."""
    report = make_report(tmp_path, _run(tmp_path), args=["--arms", ARMS_4])
    assert f"page: {tmp_path / 'rep' / 'report.html'}" in capsys.readouterr().out
    by = rows(report)
    aime = by["AIME 2026"]["flips"]["student"]
    assert (aime["right_to_wrong"], aime["wrong_to_right"]) == (1, 0)
    assert aime["right_to_wrong_ids"] == ["1"] and aime["net"] == -25.0
    assert aime["net"] == pytest.approx(by["AIME 2026"]["delta"])
    # Wilson 95% of 1 in 4: (p + z^2/2n -+ z sqrt(p q / n + z^2/4n^2)) / (1 + z^2/n)
    z, p, n = 1.96, 0.25, 4
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    assert aime["flip_rate"] == 25.0
    assert aime["flip_rate_ci95"] == pytest.approx(
        [100 * (centre - half), 100 * (centre + half)]
    )
    gpqa = by["GPQA-Diamond"]["flips"]["student"]
    assert gpqa["right_to_wrong_ids"] == ["2"] and gpqa["wrong_to_right_ids"] == ["3"]
    assert (gpqa["flip_rate"], gpqa["net"]) == (50.0, 0.0)
    assert by["MMLU-Pro"]["flips"]["student"]["right_to_wrong_ids"] == [
        "mmlu_pro_math/1"
    ]
    assert aime["texts"]["1"] == {
        "question": "q1",
        "teacher": "x",
        "arm": "b",
        "scores": [1.0, 0.0],
    }
    # int4 exact on AIME: T 1,1,1,0 Q 1,1,0,0
    assert by["AIME 2026"]["flips"]["int4_exact"]["right_to_wrong_ids"] == ["2"]
    out = tmp_path / "rep"
    table = {r["benchmark"]: r for r in csv.DictReader((out / "report.csv").open())}
    assert table["GPQA-Diamond"]["student_right_to_wrong"] == "1"
    assert float(table["AIME 2026"]["student_flip_rate"]) == 25.0
    md = (out / "report.md").read_text()
    assert "| GPQA-Diamond | student | 4 | 1 | 1 | 50.0 [15.0, 85.0] | +0.00 |" in md
    assert "- AIME 2026, student: right to wrong 1; wrong to right -" in md
    assert wilson(0, 5)[0] == 0.0 and wilson(5, 5)[1] == 100.0


def test_score_item_reverse_kl_and_delta_p_by_hand():
    """One position, top-1: teacher p .5 (tail .5), arm p .25 (tail .75)."""
    item = {
        "id": "a",
        "topk_logprobs": [[math.log(0.5)]],
        "rest": [0.5],
        "tokens": [7],
        "topk_ids": [[7]],
    }
    got = score_item(item, [[math.log(0.25)]], [3])
    kl = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    rkl = 0.25 * math.log(0.25 / 0.5) + 0.75 * math.log(0.75 / 0.5)
    assert got["kl_positions"] == [pytest.approx(kl, rel=1e-5)]
    assert got["rkl_positions"] == [pytest.approx(rkl, rel=1e-5)]
    assert got["dp_positions"] == [pytest.approx(-0.25)]
    assert got["top_positions"] == [[[7, 0.25]]] and got["agree_positions"] == [0]


def _fixed(arm_rows, nll):
    return [
        {
            "id": f"p{n}",
            "source": "s",
            "kl": float(np.mean(k)),
            "agreement": float(np.mean(a)),
            "nll": nll[n],
            "greedy_match": 0,
            "kl_positions": k,
            "rkl_positions": r,
            "dp_positions": d,
            "agree_positions": a,
            "top_positions": [[[1, 0.5]]] * len(k),
            "tokens": [1] * len(k),
        }
        for n, (k, r, d, a) in enumerate(arm_rows)
    ]


def test_fidelity_figures_by_hand():
    """Two prompts: KL [0.1, 0.5] and [0.0]; delta p [-0.2, 0.1] and [0.05]; agreement [1, 0]
    and [1]; NLL arm 2.0 and 3.0 against the teacher's 1.5 and 3.0."""
    zero = ([0.0, 0.0], [0.0, 0.0], [0.0, 0.0], [1, 1]), ([0.0], [0.0], [0.0], [1])
    arm = ([0.1, 0.5], [0.2, 0.4], [-0.2, 0.1], [1, 0]), ([0.0], [0.0], [0.05], [1])
    section = fidelity_report.summarize(
        {
            "teacher": fidelity_report.arm_items("t", _fixed(zero, [1.5, 3.0])),
            "student": fidelity_report.arm_items("s", _fixed(arm, [2.0, 3.0])),
        }
    )
    f = section["arms"]["student"]["figures"]
    # mean 0.6 / 3 = 0.2; residuals 0.6 - 0.4, 0 - 0.2: var 2/1 x 0.08 / 9, se 0.4 / 3
    assert f["kl"]["mean"] == pytest.approx(0.2)
    assert f["kl"]["se"] == pytest.approx(0.4 / 3)
    assert (f["kl"]["median"], f["kl"]["max"]) == (pytest.approx(0.1), 0.5)
    assert f["reverse_kl"]["mean"] == pytest.approx(0.2)
    assert f["delta_p"]["mean"] == pytest.approx(-0.05 / 3)
    assert f["delta_p"]["rms"] == pytest.approx(math.sqrt(0.0525 / 3))
    assert f["delta_p"]["share_large"] == pytest.approx(
        1 / 3
    )  # |-0.2|; 0.1 is not above
    assert f["agreement"]["value"] == pytest.approx(200 / 3)
    ci = [100 * (2 / 3 - 1.96 * 2 / 9), 100 * (2 / 3 + 1.96 * 2 / 9)]
    assert f["agreement"]["ci95"] == pytest.approx(ci)
    # log ratio: (0.5 x 2 + 0 x 1) / 3 = 1/3; residuals 1 - 2/3, 0 - 1/3: se 2/9
    assert f["ppl_ratio"]["value"] == pytest.approx(math.exp(1 / 3))
    lo, hi = math.exp(1 / 3 - 1.96 * 2 / 9), math.exp(1 / 3 + 1.96 * 2 / 9)
    assert f["ppl_ratio"]["ci95"] == pytest.approx([lo, hi])
    assert section["pages"]["student"][0]["id"] == "p0"  # worst KL first
    columns, table = fidelity_report.csv_rows(section)  # fidelity.csv
    assert table[1]["arm"] == "student" and table[1]["kl_mean"] == pytest.approx(0.2)
    assert table[1]["ppl_ratio_ci95_high"] == pytest.approx(hi)
    md = fidelity_report.markdown(section)
    assert "| student | KL(teacher \u2016 arm) | 3 | 0.20000 \u00b10.13333 |" in md
    assert "1.3956 [" in md  # exp(1/3)


def _chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if not found:
        pytest.fail(
            "no headless browser: install Debian's chromium (`apt-get install -y chromium`; "
            ".ci/run does it) to test report.html in a real browser"
        )
    return found


def _browse(html: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [_chromium(), "--headless", "--disable-gpu", "--no-sandbox"]
    cmd += ["--enable-logging=stderr", "--v=0", *args, html.resolve().as_uri()]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_hostile_answer_shows_as_text_and_runs_nothing(tmp_path):
    report = make_report(
        tmp_path, _run(tmp_path, ("ok", HOSTILE, "x", "x")), args=["--arms", ARMS_4]
    )
    assert rows(report)["AIME 2026"]["flips"]["student"]["texts"]["1"]["arm"] == HOSTILE
    html = tmp_path / "rep" / "report.html"
    text = html.read_text()
    # no tag of the answer's: no script, no img, no attribute of it inside a tag
    assert not re.search(r"<\s*script\b|<img src=x|<[^>]*onerror", text, re.I)
    got = _browse(html, "--dump-dom")
    assert got.returncode == 0, got.stderr[-2000:]
    assert "<title>Teacher-vs-student gap report</title>" in got.stdout  # no script ran
    assert ":CONSOLE" not in got.stderr
    # the answer's characters, all of them, in the rendered item (the first one marked)
    shown = re.sub(r"<[^>]+>", "", got.stdout).replace("&lt;", "<").replace("&gt;", ">")
    assert HOSTILE.replace('"', "&quot;") in shown or HOSTILE in shown
    assert got.stdout.count("<details") == text.count(
        "<details"
    )  # nothing closed early


def test_a_plot_of_zero_bars_is_a_sentence(tmp_path):
    """The testbed's scores are all zero (and its v1 report has no per-item outcomes)."""
    report = json.loads((REPO / "reports" / "testbed" / "report.json").read_text())
    (tmp_path / "report.png").write_bytes(b"a plot of a former report")
    write_report(report, tmp_path)
    assert not (tmp_path / "report.png").exists()
    md, html = ((tmp_path / n).read_text() for n in ("report.md", "report.html"))
    assert NO_PLOT in md and "report.png" not in md
    assert NO_PLOT.strip() in html and "<img" not in html
    assert NO_FLIPS in md and NO_FLIPS in html.replace("&#x27;", "'")
    report["benchmarks"][0]["student"] = 1.0  # one bar: a plot again
    write_report(report, tmp_path)
    assert (tmp_path / "report.png").read_bytes()[:4] == b"\x89PNG"


def test_page_reproduces_from_the_committed_tiny_report():
    """reports/tiny/report.html is what the page writer makes of reports/tiny/report.json."""
    report = json.loads((TINY / "report.json").read_text())
    assert page.render(report, TINY) == (TINY / "report.html").read_text()


def test_tiny_page_has_no_external_url_and_is_small():
    text = (TINY / "report.html").read_text()
    assert len(text.encode()) < 2_000_000
    links = re.findall(r"""(?:src|href)\s*=\s*["']?([^"'\s>]+)""", text, re.I)
    assert links and all(u.startswith(("#", "data:")) for u in links), links
    assert not re.search(r"url\(|@import|<script|<link", text, re.I)


def test_tiny_page_in_chromium(tmp_path):
    html = TINY / "report.html"
    got = _browse(html, "--dump-dom")
    assert got.returncode == 0, got.stderr[-2000:]
    assert ":CONSOLE" not in got.stderr, got.stderr
    for key in ('id="flips"', 'id="tokens"', 'class="tok"', 'id="fidelity"'):
        assert key in got.stdout, key
    # The screenshot: the same page without its plots (their bars share the tokens' red).
    bare = tmp_path / "report.html"
    bare.write_text(
        page.render(json.loads((TINY / "report.json").read_text()), tmp_path)
    )
    shot = tmp_path / "page.png"
    got = _browse(bare, f"--screenshot={shot}", "--window-size=1280,9000")
    assert shot.is_file(), got.stderr[-2000:]
    pixels = np.asarray(Image.open(shot).convert("RGB"), dtype=np.int32)
    assert pixels.std() > 10  # not blank
    # shaded tokens: the page's only red (rgba(214, 39, 40, KL)) over white
    red = (pixels[..., 0] - pixels[..., 1] > 40) & (
        pixels[..., 0] - pixels[..., 2] > 40
    )
    assert red.sum() > 200


def test_intervals_cover_by_simulation():
    """The flip rate's Wilson interval and the figures' prompt-clustered intervals hold about
    95% of their true value (simulated; the fault, an interval treating positions as
    independent, covers far less and fails)."""
    rng = np.random.default_rng(0)
    for n, p in ((10, 0.1), (40, 0.3), (200, 0.02)):
        k = rng.binomial(n, p, 4000)
        cover = np.mean([lo <= 100 * p <= hi for lo, hi in map(wilson, k, [n] * 4000)])
        assert 0.92 <= cover <= 0.99, (n, p, cover)
    # 40 prompts of 64 positions whose KL shares a per-prompt level: clustered by prompt
    hits = naive = 0
    for _ in range(400):
        level = rng.gamma(2.0, 0.01, 40)
        kl = [rng.exponential(m, 64) for m in level]
        d = fidelity_positions._divergence(kl)
        hits += abs(d["mean"] - 0.02) <= 1.96 * d["se"]
        every = np.concatenate(kl)
        naive += abs(every.mean() - 0.02) <= 1.96 * every.std() / math.sqrt(every.size)
    assert 0.92 <= hits / 400 <= 0.99 and naive / 400 < 0.85, (hits, naive)
