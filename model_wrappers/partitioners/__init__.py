"""The OpenCompass partitioners: `partitioner.py` checks data, checkpoints and adapters before
any task starts and gives every task its progress spec; `round_partitioner.py` splits a gate
sample into the rounds of a sequential run.
"""
