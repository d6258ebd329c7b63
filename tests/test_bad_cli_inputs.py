"""Bad options and input files of draft-vocab, init-prerouter, generate --prompts and fidelity
make: each is one clear error naming the option or file, exit 2, no traceback, and
nothing written."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

from edge0_eval import cli
from edge0_eval.errors import CheckpointError, ConfigError
from edge0_eval.formats.draft_file import load_draft_vocab, save_draft_vocab


def _refused(argv, capsys, *names) -> str:
    try:
        rc = cli.main([str(a) for a in argv])
    except SystemExit as exc:  # argparse
        rc = exc.code
    out = capsys.readouterr()
    message = out.err + out.out
    assert rc == 2, f"exit {rc}: {message}"
    assert "Traceback" not in message
    assert any(n in message for n in names), f"does not name {names}: {message}"
    return message


@pytest.mark.parametrize("verb", ["draft-vocab", "init-prerouter"])
def test_out_naming_a_folder_refused_before_work(verb, edge0_qwen, tmp_path, capsys):
    out = tmp_path / "taken"
    out.mkdir()
    text = tmp_path / "t.txt"
    text.write_text("the cat the dog")
    extra = ["--text", text] if verb == "draft-vocab" else []
    _refused([verb, edge0_qwen, *extra, "--out", out], capsys, "--out")
    assert list(out.iterdir()) == []


def test_draft_of_unknown_format_version_refused(tmp_path):
    path = save_draft_vocab(tmp_path / "d.safetensors", np.array([1, 2]), 64, {})
    arrays, meta = mx.load(str(path), return_metadata=True)
    mx.save_safetensors(str(path), arrays, meta | {"format_version": "99"})
    with pytest.raises(CheckpointError, match="format_version"):
        load_draft_vocab(path, 64)


@pytest.mark.parametrize(
    "option,value", [("--start-layer", "-1"), ("--width", "0"), ("--width", "-4")]
)
def test_init_prerouter_layout_out_of_range(
    option, value, edge0_qwen, tmp_path, capsys
):
    out = tmp_path / "heads.safetensors"
    _refused(
        ["init-prerouter", edge0_qwen, option, value, "--out", out], capsys, option
    )
    assert not out.exists()


@pytest.mark.parametrize(
    "line,names",
    [
        ('{"prompt": "hi", "seed": 1180591620717411303424}', ('"seed"', ":1")),
        ('{"prompt": "hi \\ud800"}', (":1",)),
        ('{"prompt": "hi", "temperature": 0.5}', ("'temperature'",)),
    ],
)
def test_generate_prompts_row_refused(line, names, edge0_qwen, tmp_path, capsys):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(line + "\n")
    out = tmp_path / "out.json"
    message = _refused(
        ["generate", edge0_qwen, "--prompts", rows, "--json", out], capsys, str(rows)
    )
    assert all(n in message for n in names), message
    assert not out.exists()


def test_generate_unknown_key_names_the_accepted_keys(edge0_qwen, tmp_path, capsys):
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "hi"}\n{"prompt": "hi", "temp": 1}\n')
    message = _refused(["generate", edge0_qwen, "--prompts", rows], capsys, ":2")
    assert "'prompt'" in message and "'seed'" in message


def test_generate_seed_beyond_64_bits_refused(edge0_qwen, capsys):
    _refused(
        ["generate", edge0_qwen, "--prompt", "x", "--seed", str(2**64)],
        capsys,
        "--seed",
    )


def test_generate_prompt_longer_than_the_context_refused(edge0_qwen, tmp_path, capsys):
    config = json.loads((edge0_qwen / "config.json").read_text())
    limit = (
        config.get("max_position_embeddings")
        or config.get("text_config", {})["max_position_embeddings"]
    )
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"prompt": "a b " * limit}) + "\n")
    message = _refused(
        ["generate", edge0_qwen, "--raw", "--prompts", rows, "--max-tokens", "1"],
        capsys,
        "max_position_embeddings",
    )
    assert str(limit) in message


def test_fidelity_make_bad_text_and_options(tmp_path, capsys):
    teacher = tmp_path / "no-teacher"  # every case is refused before the teacher loads
    out = tmp_path / "set.json"
    binary = tmp_path / "bin.txt"
    binary.write_bytes(b"\xff\xfe\x00\x81 not text")
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    base = ["fidelity", "make", teacher, "--prompts-from", ""]
    _refused([*base, "--text", binary, "--out", out], capsys, str(binary))
    _refused([*base, "--text", empty, "--out", out], capsys, str(empty))
    _refused(
        [*base, "--text", empty, "--compute-dtype", "float8", "--out", out],
        capsys,
        "--compute-dtype",
    )
    folder = tmp_path / "folder"
    folder.mkdir()
    _refused([*base, "--text", empty, "--out", folder], capsys, "--out")
    blank = tmp_path / "blank.jsonl"  # a prompt that is not a non-empty string
    for line in ('{"prompt": ""}', '{"prompt": 5}', '["prompt"]'):
        blank.write_text(line + "\n")
        _refused([*base, "--text", blank, "--out", out], capsys, f"{blank} line 1")
    assert not out.exists()


def test_fidelity_make_refuses_a_converted_student_as_teacher(
    edge0_qwen, tmp_path, capsys
):
    text = tmp_path / "p.txt"
    text.write_text("hello")
    message = _refused(
        [
            "fidelity",
            "make",
            edge0_qwen,
            "--prompts-from",
            "",
            "--text",
            text,
            "--out",
            tmp_path / "set.json",
        ],
        capsys,
        str(edge0_qwen),
    )
    assert (
        "converted streaming model" in message and not (tmp_path / "set.json").exists()
    )


ROUTING_VERBS = [  # verbs whose --top-k was the routing width, with what they need to parse
    ["serve", "M"],
    ["bench", "M"],
    ["fidelity", "bench", "M"],
    ["init-prerouter", "M", "--out", "h.safetensors"],
    ["train-prerouter", "M", "--text", "t.txt", "--out", "h.safetensors"],
    ["train-lora", "T", "S", "--prompts", "p.jsonl", "--out", "l.safetensors"],
    ["distill", "T", "S", "--prompts", "p.jsonl", "--out", "l.safetensors"],
    ["make-tiny", "out"],
    ["testbed", "build", "out"],
]


@pytest.mark.parametrize(
    "argv", ROUTING_VERBS, ids=[" ".join(v[:2]) for v in ROUTING_VERBS]
)
def test_the_routing_width_old_spelling_is_refused_with_its_new_name(argv, capsys):
    """--top-k was the routing width here while mlx-lm's (and every sampling API's) samples:
    a user typing mlx-lm's flag got K experts a token, silently. The old spelling is one
    error naming --experts-per-token; generate's --top-k samples (test_sampling_parity)."""
    with pytest.raises(SystemExit) as exc:
        cli.main([*argv, "--top-k", "4"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--experts-per-token K" in err, err
    last = err.strip().splitlines()[-1]  # argparse: its usage, then one error line
    assert "argument --top-k: --top-k is no longer" in last and "Traceback" not in err


def test_generate_top_k_samples_and_the_routing_width_is_experts_per_token(
    edge0_qwen, tmp_path, capsys
):
    """generate --top-k 1 is top-1 sampling (greedy's tokens), not one expert a token; the
    width is --experts-per-token; --sample-top-k is refused with the new name."""
    out = tmp_path / "out.json"

    def run(*argv) -> dict:
        base = ["generate", str(edge0_qwen), "--prompt", "Hello", "--max-tokens", "6"]
        assert cli.main([*base, "--json", str(out), *argv]) == 0
        return json.loads(out.read_text())

    greedy = run("--temp", "0")
    top1 = run("--temp", "1", "--seed", "3", "--top-k", "1")
    assert top1["tokens"] == greedy["tokens"]
    assert top1["stats"]["top_k"] == greedy["stats"]["top_k"] == 4  # the native width
    assert run("--experts-per-token", "2")["stats"]["top_k"] == 2
    with pytest.raises(SystemExit):
        cli.main(["generate", str(edge0_qwen), "--prompt", "x", "--sample-top-k", "3"])
    assert "--sample-top-k is --top-k now" in capsys.readouterr().err


def test_a_student_config_with_the_old_top_k_key_is_refused(edge0_qwen):
    from model_wrappers.models.edge0_model import resolve_engine_options

    with pytest.raises(ConfigError, match="top_k is experts_per_token now"):
        resolve_engine_options(str(edge0_qwen), mode="reactive", top_k=4)
    opts = resolve_engine_options(
        str(edge0_qwen), mode="reactive", no_lora=True, experts_per_token=2
    )
    assert opts.experts_per_token == 2


def test_fidelity_bench_bad_options(tmp_path, capsys):
    """Refused before any model loads, each naming its option."""
    model = tmp_path / "no-model"
    base = ["fidelity", "bench", model]
    _refused([*base, "--arms", "steps,tokens"], capsys, "--arms")
    _refused(
        [*base, "--prompts", "2", "--steps-prompts", "3"], capsys, "--steps-prompts"
    )
    _refused([*base, "--score-mib", "0"], capsys, "--score-mib")
