"""Evaluation: benchmark data, fixtures, OpenCompass output reading, the gap report and the gate."""
