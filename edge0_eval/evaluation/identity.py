"""A model's identity: which weights and adapters produced a run's outputs.

Computed where the model runs (model_wrappers/inferencers/inferencer.py writes it into every
sample's engine stats as `model_identity`), so a report made on another machine, without the
model files, still knows it. Short digests (16 hex digits of sha256):
  weights    config.json, the tokenizer files, the expert index (experts.index.json: every
             expert bundle's crc32) and the resident or teacher weight files' names, sizes and
             safetensors headers (fidelity.sets.fingerprint)
  lora, prerouter, hedge   the whole adapter / heads files the engine resolved (None: none)
`report` lets arms differ in identity (that is what is compared); `gate` says when the
current run's identity differs from the baseline's, since that is the change being judged.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from edge0_eval.evaluation.fidelity.sets import fingerprint
from edge0_eval.formats.layout import INDEX_NAME, RESIDENT_NAME

DIGITS = 16
_cache: dict[tuple, str] = {}


def _stamp(path: Path) -> tuple:
    st = path.stat()
    return (str(path.resolve()), st.st_size, st.st_mtime_ns)


def file_digest(path: Path) -> str:
    """sha256 of a whole file (an adapter: small next to the weights), once per version."""
    key = ("file", *_stamp(path))
    if key not in _cache:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 24), b""):
                h.update(block)
        _cache[key] = h.hexdigest()[:DIGITS]
    return _cache[key]


def weights_digest(path: Path, streaming: bool) -> str:
    files = sorted(
        [path / n for n in ("config.json", INDEX_NAME) if (path / n).is_file()]
        + list(path.glob("*.safetensors"))
    )
    key = (
        "weights",
        str(path.resolve()),
        streaming,
        *(s for f in files for s in _stamp(f)),
    )
    if key not in _cache:
        _cache[key] = fingerprint(
            path,
            [RESIDENT_NAME] if streaming else None,
            (INDEX_NAME,) if streaming else (),
        )[:DIGITS]
    return _cache[key]


def model_identity(path: str, engine_options=None) -> dict:
    """{weights, lora, prerouter, hedge} of the model at `path`: a streaming student when
    `engine_options` (its EngineOptions) is given, else an mlx-lm checkpoint (the teacher)."""
    model = Path(path)
    if engine_options is None:
        return {"weights": weights_digest(model, streaming=False)}
    resolved = engine_options.resolve(model)
    return {
        "weights": weights_digest(model, streaming=True),
        **{
            name: None if p is None else file_digest(Path(p))
            for name, p in (
                ("lora", resolved.lora_path),
                ("prerouter", resolved.prerouter_path),
                ("hedge", resolved.hedge_path),
            )
        },
    }
