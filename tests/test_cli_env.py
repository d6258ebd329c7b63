"""The installed environment: console scripts and the opencompass entry point start."""

import shutil
import subprocess
import sys
from pathlib import Path

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
