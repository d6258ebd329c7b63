"""The teacher-vs-student gap report (`edge0-eval report`): `gap.py` builds it from OpenCompass
output folders (per benchmark the paired teacher-student delta and its interval, per arm its
settings, the fidelity section); `arms.py` says which model abbr is which arm and what each
scored; `definitions.py` what each headline measures and when a published reference may stand
beside it; `writers.py` writes report.json, .csv, .md and .png from the built report.
"""
