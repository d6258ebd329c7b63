"""Teacher-forced fidelity: how closely an arm's next-token distribution follows the teacher's.
`sets.py` is the fidelity set file (format, validation, the per-item metrics; numpy only, so
configs and the report read it without MLX); `scoring.py` makes a set from the teacher and
scores an arm on its served path (`edge0-eval fidelity make`); `report.py` is the gap report's
fidelity section and its gate checks, with `positions.py`'s view of divergence by position.
"""
