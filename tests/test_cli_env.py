"""The installed environment: console scripts and the opencompass entry point start."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from edge0_eval import cli
from edge0_eval.cli import COMMANDS


def _script(name: str) -> str:
    path = Path(sys.executable).parent / name
    return str(path) if path.exists() else shutil.which(name)


def test_help_lists_every_verb():
    proc = subprocess.run(
        [_script("edge0-eval"), "--help"], capture_output=True, text=True
    )
    assert proc.returncode == 0
    for verb in COMMANDS:
        assert verb in proc.stdout


def test_unknown_verb_fails():
    proc = subprocess.run(
        [_script("edge0-eval"), "frobnicate"], capture_output=True, text=True
    )
    assert proc.returncode == 2 and "unknown command" in proc.stderr


def test_opencompass_command_starts():
    # pyarrow >= 21 needs numpy 2 while opencompass pins numpy < 2: the pin keeps this working.
    proc = subprocess.run(
        [_script("opencompass"), "--help"], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage: opencompass" in proc.stdout


# The top level of edge0_eval holds the verbs, one module each, and the command line itself;
# libraries live in packages.
NOT_VERBS = {"__init__", "__main__", "cli", "errors"}


def test_every_verb_is_a_top_level_module_named_for_it():
    package = Path(cli.__file__).parent
    top = {p.stem for p in package.glob("*.py")} - NOT_VERBS
    modules = {verb: module for verb, (module, _) in COMMANDS.items()}
    assert modules == {v: f"edge0_eval.{v.replace('-', '_')}" for v in COMMANDS}
    assert top == {m.rsplit(".", 1)[1] for m in modules.values()}


@pytest.mark.parametrize("verb", sorted(COMMANDS))
def test_every_verb_answers_help(verb, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main([verb, "--help"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: edge0-eval {verb}")
