"""edge0_eval.formats knows what is on disk and nothing that runs: each of its modules imports
alone (no import cycle) and loads no edge0_eval module outside formats/ and errors.py, so the
engine builds its objects from what formats returns and never the other way round."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import edge0_eval.formats

MODULES = sorted(
    p.stem
    for p in Path(edge0_eval.formats.__file__).parent.glob("*.py")
    if p.stem != "__init__"
)
CODE = (
    "import importlib, sys\n"
    "importlib.import_module(sys.argv[1])\n"
    "print(' '.join(sorted(m for m in sys.modules if m.startswith('edge0_eval.'))))\n"
)


def test_every_format_module_is_listed():
    assert len(MODULES) >= 8 and "model_dir" in MODULES and "adapters" in MODULES


@pytest.mark.parametrize("name", MODULES)
def test_format_module_imports_alone_and_no_engine(name):
    proc = subprocess.run(
        [sys.executable, "-c", CODE, f"edge0_eval.formats.{name}"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    loaded = proc.stdout.split()
    outside = [
        m
        for m in loaded
        if not m.startswith("edge0_eval.formats") and m != "edge0_eval.errors"
    ]
    assert f"edge0_eval.formats.{name}" in loaded and not outside, outside
