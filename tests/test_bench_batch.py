"""`edge0-eval bench --batch 1,4,8`: batch sizes interleaved like the arms, figures labelled,
ratios to B = 1 from the same run; bad values refused at parse time."""

from __future__ import annotations

import argparse
import json

import pytest
from bad_inputs import expect_clear_error

from edge0_eval import bench
from edge0_eval.cli import main

K = 2


def _bench(model, tmp_path, *extra) -> dict:
    out = tmp_path / "bench.json"
    argv = [
        "bench",
        str(model),
        "--tokens",
        "4",
        "--prompt-tokens",
        "6",
        "--raw-reads",
        "0",
        "--experts-per-token",
        str(K),
        "--json",
        str(out),
        *extra,
    ]
    assert main(argv) == 0
    return json.loads(out.read_text())


def test_batch_sizes_interleave_with_the_arms(edge0_qwen, tmp_path, capsys):
    heads = tmp_path / "heads.safetensors"
    assert (
        main(
            [
                "init-prerouter",
                str(edge0_qwen),
                "--start-layer",
                "1",
                "--width",
                "16",
                "--experts-per-token",
                str(K),
                "--out",
                str(heads),
            ]
        )
        == 0
    )
    report = _bench(
        edge0_qwen,
        tmp_path,
        "--arms",
        "resident,reactive,prerouted",
        "--batch",
        "1,3",
        "--repeats",
        "2",
        "--cache",
        "cold",
        "--prerouter",
        str(heads),
    )
    runs = report["runs"]
    order = [(r["round"], r["batch"], r["arm"]) for r in runs]
    assert order == [
        (n, b, a)
        for n in (0, 1)
        for b in (1, 3)
        for a in ("resident", "reactive", "prerouted")
    ]
    for r in runs:
        b = r["batch"]
        assert r["batch_size"] == b and r["generated_tokens"] == 4 * b
        assert len(r["row_decode_tok_s"]) == b and all(
            v > 0 for v in r["row_decode_tok_s"]
        )
        assert r["decode_tok_s"] == r["batch_decode_tok_s"] > 0
        assert r["peak_memory_gib"] > 0 and r["emulated"] is False
        if r["arm"] == "resident":
            assert r["cache"].startswith("warm") and r["mean_union_per_layer"] is None
            assert r["bytes_per_token"] == 0
        else:
            assert r["cache"] == "cold" and r["storage"] == "real disk"
            # A layer's union holds at least one row's K and at most every row's.
            assert K <= r["mean_union_per_layer"] <= K * b
            assert r["bytes_per_token"] > 0
    b3 = [r for r in runs if r["batch"] == 3 and r["arm"] == "reactive"]
    assert all(r["mean_union_per_layer"] > K for r in b3)  # the rows route apart
    t = report["targets"]
    for arm in ("resident", "reactive", "prerouted"):
        assert {f"{arm}_b3_over_b1_decode", f"{arm}_b3_over_b1_peak"} <= set(t)

    def mean(key, b):
        return (
            sum(r[key] for r in runs if r["arm"] == "reactive" and r["batch"] == b) / 2
        )

    assert t["reactive_b3_over_b1_bytes_per_token"] == pytest.approx(
        mean("bytes_per_token", 3) / mean("bytes_per_token", 1), abs=1e-3
    )
    printed = capsys.readouterr().out
    assert "aggregate tok/s" in printed and "union/layer" in printed


def test_emulated_storage_is_labelled(edge0_qwen, tmp_path):
    report = _bench(
        edge0_qwen,
        tmp_path,
        "--arms",
        "reactive",
        "--batch",
        "2",
        "--io-throttle-mbps",
        "500",
    )
    (row,) = report["runs"]
    assert row["emulated"] is True and row["storage"] == "EMULATED at 500 MB/s"
    assert row["batch"] == 2 and "--batch 2" in report["command"]
    # No B = 1 run to compare with: said, not silently empty.
    assert "B = 1" in report["targets"]["note"]


@pytest.mark.parametrize(
    "value,message",
    [
        ("0", "at least 1"),
        ("x", "not an integer"),
        ("1,,4", "empty"),
        ("4,4", "repeats"),
    ],
)
def test_bad_batch_values_are_refused(value, message, capsys):
    err = expect_clear_error(
        lambda: main(["bench", "M", "--batch", value]), "--batch", capsys=capsys
    )
    assert message in err


def test_batch_with_a_reference_arm_is_one_clear_error(edge0_qwen, capsys):
    assert (
        main(
            [
                "bench",
                str(edge0_qwen),
                "--arms",
                "mlx-lm,reactive",
                "--batch",
                "2",
                "--raw-reads",
                "0",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "--batch" in err and "mlx-lm" in err and "Traceback" not in err


def test_echoed_command_reruns_as_written():
    """The report's command parses back to the same options (flags, not argparse dests)."""
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(
        [
            "M",
            "--prerouter",
            "H.safetensors",
            "--lora",
            "L",
            "--no-verify-crc",
            "--batch",
            "1,4",
            "--emulate-balanced",
        ]
    )
    echoed = bench._argv_echo(args)
    assert "--prerouter H.safetensors" in echoed and "--no-verify-crc" in echoed
    assert vars(parser.parse_args(" ".join(echoed).split())) == vars(args)
