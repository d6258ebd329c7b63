"""JSON model files read one way: UTF-8, strict JSON (no NaN), the expected top-level type; the
one test of a JSON value against a Python type hint (`type_ok`); and the one error for a model
file that cannot be read (`unreadable`, also the safetensors reader's)."""

from __future__ import annotations

import json
import math
import typing
from pathlib import Path

from edge0_eval.errors import CheckpointError


def unreadable(path: Path, what: str, fix: str, exc: OSError) -> CheckpointError:
    """The error for a file that cannot be opened or read: missing, a folder, or the OS's
    reason."""
    if isinstance(exc, FileNotFoundError):
        return CheckpointError(f"{path}: {what} not found; {fix}")
    if isinstance(exc, IsADirectoryError):
        return CheckpointError(f"{path}: {what} is a directory, not a file; {fix}")
    return CheckpointError(f"{path}: cannot read {what} ({exc.strerror}); {fix}")


def read_json_file(path: str | Path, what: str, fix: str, kind: type = dict):
    """Parse a UTF-8 JSON file whose top level must be `kind`; one error naming the file."""
    path = Path(path)
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CheckpointError(
            f"{path}: {what} is not UTF-8 text (byte {exc.start}); {fix}"
        ) from None
    except OSError as exc:
        raise unreadable(path, what, fix, exc) from None
    try:
        data = json.loads(text, parse_constant=no_constant)
    except (json.JSONDecodeError, ValueError, RecursionError) as exc:
        raise CheckpointError(
            f"{path}: {what} is not valid JSON ({exc}); {fix}"
        ) from None
    if not isinstance(data, kind):
        raise CheckpointError(
            f"{path}: {what} must be a JSON {json_name(kind)}, not "
            f"{json_name(type(data))}; {fix}"
        )
    return data


def no_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def json_name(kind) -> str:
    return {
        dict: "object",
        list: "array",
        str: "string",
        int: "integer",
        float: "number",
        bool: "boolean",
        type(None): "null",
    }.get(kind, kind.__name__)


def type_ok(value, hint) -> bool:
    """Whether a JSON value fits a type hint as mlx-lm's ModelArgs use them: bools are not ints,
    floats are finite; hints this cannot judge pass."""
    origin = typing.get_origin(hint)
    if hint is typing.Any:
        return True
    if origin is typing.Union:
        return any(type_ok(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return (
            isinstance(value, (int, float))
            and not isinstance(value, bool)
            and math.isfinite(value)
        )
    if hint is str:
        return isinstance(value, str)
    if hint is dict or origin is dict:
        return isinstance(value, dict)
    if hint is list or origin is list:
        return isinstance(value, list)
    return True  # types we cannot judge are left to mlx-lm
