"""argparse `type=` validators: a bad value is refused at parse time, naming the option.

argparse turns the ArgumentTypeError raised here into "argument --x: <message>" and exit 2, so
`--temp nan`, `--io-workers 0` or `--arms ,` never reach the code that would misuse them.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path


def _number(text: str, kind=float):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not {'an integer' if kind is int else 'a number'}"
        ) from None
    if kind is float and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def finite_float(text: str) -> float:
    return _number(text)


def positive_float(text: str) -> float:
    value = _number(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text} must be > 0")
    return value


def nonneg_float(text: str) -> float:
    value = _number(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} must be >= 0")
    return value


def positive_int(text: str) -> int:
    value = _number(text, int)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} must be at least 1")
    return value


def nonneg_int(text: str) -> int:
    value = _number(text, int)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} must be >= 0")
    return value


SEED_MAX = 2**64 - 1  # mx.random.key takes an unsigned 64-bit seed


def seed(text: str) -> int:
    """A sampling seed: a whole number in [0, 2**64 - 1], the range mx.random.key accepts."""
    value = _number(text, int)
    if not 0 <= value <= SEED_MAX:
        raise argparse.ArgumentTypeError(f"{text} must be in [0, 2**64 - 1]")
    return value


def float_range(low: float, high: float, low_open: bool = False):
    """A finite float in [low, high] ((low, high] with low_open)."""

    def parse(text: str) -> float:
        value = _number(text)
        if value < low or value > high or (low_open and value == low):
            raise argparse.ArgumentTypeError(
                f"{text} must be in {'(' if low_open else '['}{low:g}, {high:g}]"
            )
        return value

    parse.__name__ = f"number in range {low:g}..{high:g}"
    return parse


def named(value_type, name: str = "NAME"):
    """NAME=VALUE, VALUE checked by one of the validators above; gives (NAME, VALUE), so a
    repeatable option (`action="append"`) becomes a dict with `dict(args.option)`."""

    def parse(text: str) -> tuple[str, object]:
        key, sep, value = text.rpartition("=")
        if not sep or not key:
            raise argparse.ArgumentTypeError(f"{text!r} is not {name}=VALUE")
        try:
            return key, value_type(value)
        except argparse.ArgumentTypeError as exc:
            raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None

    parse.__name__ = f"{name}=VALUE"
    return parse


def json_object(text: str) -> dict:
    """A JSON object with string keys, e.g. '{"enable_thinking": false}'."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not valid JSON ({exc.msg})"
        ) from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a JSON object; give '{{\"name\": value, ...}}'"
        )
    return value


def name_list(text: str) -> str:
    """A comma-separated list with at least one non-empty name and no empty or repeated one."""
    names = [p.strip() for p in text.split(",")]
    if not any(names):
        raise argparse.ArgumentTypeError(f"{text!r} names nothing; give NAME[,NAME...]")
    if not all(names):
        raise argparse.ArgumentTypeError(f"{text!r} has an empty name between commas")
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise argparse.ArgumentTypeError(f"{text!r} repeats {', '.join(dupes)}")
    return text


def positive_int_list(text: str) -> list[int]:
    """A comma-separated list of distinct whole numbers >= 1 ("1,4,8"), in the order given."""
    names = name_list(text).split(",")
    values = []
    for name in names:
        try:
            values.append(positive_int(name.strip()))
        except argparse.ArgumentTypeError as exc:
            raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None
    if len(set(values)) < len(values):
        raise argparse.ArgumentTypeError(f"{text!r} repeats a value")
    return values


def output_file(text: str) -> str:
    """A file to write later: its folder must exist and it must not be a folder itself."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder; give a file name")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(
            f"folder {parent} does not exist; create it first"
        )
    return text


def output_path(text: str) -> str:
    """A file to write (its folders may be made later), but not a folder: checked before the
    work, so an atomic write's final rename cannot fail on it."""
    if Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder; give a file name")
    return text


def directory(text: str) -> str:
    """A folder that may not exist yet, but is not a file."""
    if Path(text).exists() and not Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a file, not a folder")
    return text
