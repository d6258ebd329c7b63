"""Checkpoint making: tiny and synthetic models, the real-weight testbed, conversion to the
streaming layout, tokenizers, and mlx-lm reference loading."""
