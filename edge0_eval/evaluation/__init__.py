"""Evaluation: benchmark data, fixtures, OpenCompass output reading, the gap report and the gate.

One subpackage per subject, each importing only those before it (tests/test_layers.py checks
that none imports back): `significance/` (the paired and sequential tests), `outputs/` (reading
OpenCompass output trees), `fidelity/` (the teacher-forced fidelity set, its scoring and report
section), `data/` (the benchmark data tree, staged and verified), `report/` (the gap report),
`gate/` (the CI gate), `plan/` (a run config read, planned, run). At the top: `benchmarks.py`
and `data_paths.py`, which every subject reads; `identity.py`, a model's identity in every
run's stats; `agreement.py`, the tiny gate's agreement set.
"""
