"""JSON-lines input files read the same way everywhere: one object per non-empty line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

from edge0_eval.errors import ConfigError


def iter_jsonl(path: Path, raw: str | None = None) -> Iterator[tuple[int, dict]]:
    """(line number, object) for each non-empty line; one clear error naming file:line."""
    text = path.read_text(encoding="utf-8", errors="replace") if raw is None else raw
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}:{lineno}: not valid JSON ({exc})") from None
        if not isinstance(record, dict):
            raise ConfigError(f"{path}:{lineno}: expected a JSON object")
        yield lineno, record
