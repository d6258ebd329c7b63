"""`edge0-eval init-prerouter`: untrained heads the engine serves; owners from --start-layer."""

from __future__ import annotations

import json

from edge0_eval import cli
from edge0_eval.engine.engine import Engine
from edge0_eval.engine.options import EngineOptions
from edge0_eval.formats.heads_file import read_metadata


def test_init_prerouter_writes_heads_the_engine_serves(edge0_qwen, tmp_path, capsys):
    out = tmp_path / "heads.safetensors"
    assert (
        cli.main(
            [
                "init-prerouter",
                str(edge0_qwen),
                "--start-layer",
                "1",
                "--width",
                "16",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert "untrained" in capsys.readouterr().out
    meta = read_metadata(out)
    assert json.loads(meta["owners"]) == [0, 1, 2] and meta["start_layer"] == "1"
    engine = Engine.load(
        edge0_qwen,
        EngineOptions(
            mode="prerouted", prerouter_path=str(out), no_lora=True, slots_per_layer=16
        ),
    )
    reactive = Engine.load(
        edge0_qwen,
        EngineOptions(
            mode="reactive", no_lora=True, no_prerouter=True, slots_per_layer=16
        ),
    )
    try:
        prompt = engine.tokenizer.encode("hello there")
        a = engine.generate(prompt, max_tokens=6)
        b = reactive.generate(prompt, max_tokens=6)
        assert len(a.tokens) == len(b.tokens) and a.tokens
        stats = engine.stats()
        assert (
            stats["prerouter_owners"] == 3
            and stats["prerouted_steps"] == len(a.tokens) - 1
        )
    finally:
        engine.close()
        reactive.close()


def test_init_prerouter_start_layer_sets_owners(edge0_qwen, tmp_path):
    out = tmp_path / "heads.safetensors"
    assert (
        cli.main(
            [
                "init-prerouter",
                str(edge0_qwen),
                "--start-layer",
                "3",
                "--width",
                "8",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert json.loads(read_metadata(out)["owners"]) == [2]


def test_init_prerouter_without_owners_is_one_clear_error(edge0_qwen, tmp_path, capsys):
    out = tmp_path / "heads.safetensors"
    assert (
        cli.main(
            ["init-prerouter", str(edge0_qwen), "--start-layer", "9", "--out", str(out)]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "no prerouter owners" in err and "Traceback" not in err
    assert not out.exists()


def test_init_prerouter_embedding_scale(edge0_qwen, tmp_path, capsys):
    """--embedding-scale fills the next-token heads' embedding columns; without --next-token it
    is one clear error."""
    from edge0_eval.engine.heads import load_heads

    out = tmp_path / "h.safetensors"
    assert (
        cli.main(
            [
                "init-prerouter",
                str(edge0_qwen),
                "--start-layer",
                "0",
                "--width",
                "8",
                "--next-token",
                "--embedding-scale",
                "0.5",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert "0.5 x shuffled routers" in capsys.readouterr().out
    meta = read_metadata(out)
    heads = load_heads(
        out,
        hidden=int(meta["hidden"]),
        num_experts=int(meta["num_experts"]),
        experts_per_token=int(meta["K"]),
    )
    cfg = heads.config
    emb = heads.linear[:, :, cfg.context_dim :]
    for o, c in enumerate(cfg.consumers):
        assert bool((emb[o] != 0).any().item()), c
    assert (
        cli.main(
            [
                "init-prerouter",
                str(edge0_qwen),
                "--start-layer",
                "0",
                "--width",
                "8",
                "--embedding-scale",
                "0.5",
                "--out",
                str(tmp_path / "x.safetensors"),
            ]
        )
        == 2
    )
    assert "add --next-token" in capsys.readouterr().err
