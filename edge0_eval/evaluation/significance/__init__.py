"""The tests that decide whether a change between two runs on the same items is real:
`paired.py` (exact McNemar-type and sign-flip tests, their power, a baseline of several runs)
and `sequential.py` (anytime-valid tests by betting that may stop after any item). numpy and
scipy only, no project import: the report's per-sample records, the gate and the planner all
read them, so they sit below every other subpackage.
"""
