"""An OpenCompass run before and while it runs: `run_config.py` reads a run config as this
project does (arms, datasets, item counts, test ranges, expected tokens); `planner.py` says what
a config costs and can detect, and sizes a gate config's sample to its budget
(`edge0-eval plan`); `fidelity_bench.py` measures the teacher-forced scorers' speed the planner
prices fidelity at (`edge0-eval fidelity bench`); `opencompass_run.py` runs OpenCompass from
Python (`gate-run`, the demo); `progress.py` writes each arm's progress and ETA while it runs.
"""
