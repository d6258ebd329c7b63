"""The OpenCompass evaluators: `benchmark_evaluators.py` the five benchmarks' scorers that fail
loudly where OpenCompass's own would fail silently, and the open-thinking postprocessor every
benchmark dataset runs first; `agreement_evaluator.py` and `fidelity_evaluator.py` score the
agreement and fidelity sets.
"""
