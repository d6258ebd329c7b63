"""The benchmark data OpenCompass reads, offline: `staging.py` lays out the data tree (what PyPI
packages ship, the files a user supplies, the fidelity set) and `checks.py` verifies it (files,
columns, item counts; `edge0-eval data verify` and the configs' preflight); `nltk_data.py` is
IFBench's NLTK data, staged without the internet; `fixtures.py` writes the tiny fixture tree of
all five benchmarks. Where the tree lives is `data_paths.py`, one level up.
"""
