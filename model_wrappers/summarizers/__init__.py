"""The OpenCompass summarizer: `summarizer.py` can weight a summary group by its subsets' scored
items (MMLU-Pro's per-question average).
"""
