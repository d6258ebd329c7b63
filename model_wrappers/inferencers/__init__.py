"""The OpenCompass inferencers: `inferencer.py` generates answers (with each sample's engine
stats, the model's identity and the arm's progress), `fidelity_inferencer.py` hands a fidelity
set's items to the model's teacher-forced scorer instead of generating.
"""
