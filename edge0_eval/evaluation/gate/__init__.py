"""The CI regression gate (`edge0-eval gate`, `gate-baseline`, `gate-run`): `checks.py` compares
a report.json with a baseline's, benchmark by benchmark and for fidelity, on the paired tests
of significance/; `sequential_checks.py` does the same as anytime-valid tests over the rounds
of a sequential run; `inputs.py` reads the reports it compares, every field checked;
`baselines.py` makes a baseline from several runs of one config; `rounds.py` is a gate
sample's seeded draw and the rounds it is scored in.
"""
