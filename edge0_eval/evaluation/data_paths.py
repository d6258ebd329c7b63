"""Where OpenCompass looks for benchmark data, and files shipped inside installed packages.

The lowest layer of the data modules (data/checks.py, data/nltk_data.py and data.py import it; it
imports none of them). It sits beside benchmarks.py, not in data/, because fidelity/scoring.py
reads it too, and data/staging.py reads the fidelity set: neither subpackage imports the other
both ways.
"""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path

from edge0_eval.errors import Edge0Error
from edge0_eval.evaluation.benchmarks import BY_KEY

# The staged benchmarks and where OpenCompass 0.5.4 looks for each (evaluation/benchmarks.py).
BENCHMARKS = tuple(BY_KEY)
PATHS = {key: bench.data_path for key, bench in BY_KEY.items()}


def data_root(root: str | os.PathLike | None = None) -> Path:
    """The directory OpenCompass resolves `./data/...` against."""
    return Path(root or os.environ.get("COMPASS_DATA_CACHE") or os.getcwd())


def dist_file(dist_name: str, suffix: str) -> Path:
    """A file shipped inside an installed distribution, found without importing its code."""
    try:
        dist = importlib.metadata.distribution(dist_name)
    except importlib.metadata.PackageNotFoundError:
        raise Edge0Error(
            f'{dist_name} is not installed; pip install "edge0-eval[eval]"'
        ) from None
    for f in dist.files or ():
        if str(f).replace("\\", "/").endswith(suffix):
            return Path(dist.locate_file(f))
    raise Edge0Error(f"{dist_name} {dist.version} does not contain {suffix}")
