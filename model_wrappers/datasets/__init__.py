"""The OpenCompass dataset loaders of this project's own sets: `agreement_dataset.py` the tiny
gate's agreement set, `fidelity_dataset.py` a teacher-forced fidelity set (with the preflight
that checks the set against the arms before any model loads).
"""
