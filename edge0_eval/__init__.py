"""edge0-eval: the Edge0 SSD-streaming MoE engine (MLX) and its OpenCompass plugin.

The public API, as mlx-lm's `from mlx_lm import load, generate`:

    from edge0_eval import Engine, EngineOptions

    engine = Engine.load("path/to/converted", EngineOptions(mode="prerouted"))
    result = engine.generate(engine.tokenizer.encode("def add(a, b):"), max_tokens=32)
    print(result.text, result.stats["decode_tok_s"])

The names are imported on first use, so `import edge0_eval.errors` (every command's first
import) loads no MLX.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# name -> the module that defines it
_API = {
    "Engine": "edge0_eval.engine.engine",
    "GenerationResult": "edge0_eval.engine.engine",
    "EngineOptions": "edge0_eval.engine.options",
    "NonFiniteError": "edge0_eval.engine.step",
    "Edge0Error": "edge0_eval.errors",
    "CheckpointError": "edge0_eval.errors",
    "ConfigError": "edge0_eval.errors",
}
__all__ = list(_API)


def __getattr__(name: str):
    if name in _API:
        return getattr(importlib.import_module(_API[name]), name)
    raise AttributeError(f"module 'edge0_eval' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
