"""edge0-eval: the Edge0 SSD-streaming MoE engine (MLX) and its OpenCompass plugin."""

__version__ = "0.1.0"
