"""Fidelity by position: buckets, the per-position KL tail, and their place in the report."""

from __future__ import annotations

import json

import numpy as np
import pytest

from edge0_eval.evaluation.fidelity import positions as fp
from edge0_eval.evaluation.fidelity import report as fr
from edge0_eval.evaluation.fidelity.sets import score_item, tail_mass


def _item(kl, agree):
    return [float(v) for v in kl], [int(a) for a in agree]


def test_profile_buckets_tail_and_shares_match_a_direct_count():
    rng = np.random.default_rng(0)
    short = _item(rng.exponential(0.05, 100), rng.random(100) < 0.9)
    long = _item(np.linspace(0.0, 2.0, 1500), rng.random(1500) < 0.5)
    p = fp.profile([short, long])
    every = np.array(short[0] + long[0])
    assert p["positions"] == 1600 and p["kl_mean"] == pytest.approx(every.mean())
    assert p["quantiles"]["0.99"] == pytest.approx(np.quantile(every, 0.99))
    assert p["share_above"]["1"] == pytest.approx((every > 1.0).mean())
    labels = [b["bucket"] for b in p["by_position"]]
    assert labels == ["0-63", "64-127", "128-255", "256-511", "512-1023", "1024-2047"]
    first, late = p["by_position"][0], p["by_position"][-1]
    assert first["items"] == 2 and first["positions"] == 128
    assert first["kl"] == pytest.approx((sum(short[0][:64]) + sum(long[0][:64])) / 128)
    # Only the long item reaches 1024: its positions 1024..1499, and no interval from one item.
    assert (
        late["items"] == 1
        and late["positions"] == 476
        and late["kl_half_width"] is None
    )
    assert late["kl"] == pytest.approx(np.mean(long[0][1024:]))
    assert late["agreement"] == pytest.approx(100 * np.mean(long[1][1024:]))
    # A divergence that grows along the continuation shows as a rising curve.
    kls = [b["kl"] for b in fp.profile([long, long])["by_position"]]
    assert kls == sorted(kls)
    assert fp.profile([([], [])]) is None


def test_clustered_interval_is_the_item_means_interval_at_equal_lengths():
    """With every item the same length the ratio estimator's interval is the plain one over
    item means (1.96 sd / sqrt(n)); positions of one item are not counted as independent."""
    rng = np.random.default_rng(1)
    means = rng.normal(1.0, 0.3, 12)
    items = [_item(rng.normal(m, 0.01, 64), np.ones(64)) for m in means]
    got = fp.profile(items)["by_position"][0]
    per_item = [np.mean(k) for k, _ in items]
    assert got["kl"] == pytest.approx(np.mean(per_item))
    assert got["kl_half_width"] == pytest.approx(
        1.96 * np.std(per_item, ddof=1) / np.sqrt(12)
    )
    # Counting the 768 positions as independent would give a far narrower, wrong interval.
    every = np.concatenate([k for k, _ in items])
    assert got["kl_half_width"] > 5 * 1.96 * every.std(ddof=1) / np.sqrt(every.size)


def _scored(n_items, length, shift, rng):
    """score_item rows of an arm whose log-probs sit `shift` off a 2-id teacher row."""
    rows = []
    for i in range(n_items):
        t = np.log(np.array([[0.7, 0.2]] * length, dtype=np.float32))
        item = {
            "id": f"i{i}",
            "topk_logprobs": t.tolist(),
            "rest": tail_mass(t).tolist(),
            "tokens": [1] * length,
        }
        arm = t + shift * rng.random(t.shape)
        argmax = [1 if j % 3 or not shift else 2 for j in range(length)]
        rows.append({"id": f"i{i}", "source": "text", **score_item(item, arm, argmax)})
    return rows


def test_report_section_and_plot_carry_the_position_view(tmp_path):
    rng = np.random.default_rng(2)
    loaded = {
        "teacher": fr.arm_items("t", _scored(4, 70, 0.0, rng)),
        "student": fr.arm_items("s", _scored(4, 70, -0.5, rng)),
    }
    section = fr.summarize(loaded)
    teacher, student = (
        section["arms"]["teacher"]["positions"],
        section["arms"]["student"]["positions"],
    )
    assert teacher["kl_mean"] == 0.0 and teacher["share_above"]["0.1"] == 0.0
    assert student["kl_mean"] == pytest.approx(section["arms"]["student"]["kl"])
    assert [b["bucket"] for b in student["by_position"]] == ["0-63", "64-127"]
    assert student["by_position"][1]["agreement"] == pytest.approx(100 * 4 / 6)
    md = fr.markdown(section)
    assert "KL p99" in md and "share KL > 0.1" in md and "| 64-127 |" in md
    json.dumps(section)  # report.json holds it as is
    fr.write_plot(section, tmp_path / "fidelity.png")
    assert (tmp_path / "fidelity.png").stat().st_size > 0
    # Results from before per-position figures: the section still builds, and says so.
    for row in loaded["student"]["items"].values():
        row["kl_positions"] = row["agree_positions"] = None
    old = fr.summarize(loaded)
    assert "positions" not in old["arms"]["student"] and old["status"] == "ok"
    assert any("no per-position figures" in n for n in old["notes"])
