"""Flags generated from options dataclasses: each option declared once, as a field.

    @dataclass
    class RunOptions:
        model: str = option(help="converted model directory", flag="model")  # positional
        steps: int = option(100, "optimizer steps", type=ct.positive_int)
        fresh: bool = option(False, "start over")  # False: --fresh, store_true
        verify: bool = option(True, "check reads")  # True: --verify / --no-verify

    add_fields(parser, RunOptions)           # one argument per field, default the field's
    options = from_args(RunOptions, args)    # and the dataclass back from the namespace

A field's metadata holds its flag: `help` and argparse's keywords (type, choices, metavar,
nargs, action, const, required); `flag` is the flag's name when not `--field-name` (a name
without dashes is positional), `flag=False` a field with no flag. A `type` given as a string
names a validator of value_types, a tuple one of its factories and the factory's arguments
(for options below this layer: the engine's, a plan's). The
flag's default is the field's; a bool defaults to store_true when False, --x/--no-x when True.
`least` (no flag keyword) is the smallest value a field takes: `check_fields` holds it, and
`choices`, however the options were made (a test or a config passes no flags).
"""

from __future__ import annotations

import argparse
from dataclasses import MISSING, fields

from edge0_eval.arguments import value_types
from edge0_eval.engine.options import option
from edge0_eval.errors import ConfigError

__all__ = ["add_fields", "check_fields", "field_flags", "from_args", "option"]
_KEYWORDS = ("type", "choices", "metavar", "nargs", "action", "const", "required")


def field_default(f):
    """The field's default value, or MISSING."""
    return f.default_factory() if f.default_factory is not MISSING else f.default


def field_flags(cls, **changes) -> dict:
    """name -> (flag, argparse keywords) of every field of `cls` with a flag; `changes` maps a
    field name to metadata that replaces its own (a verb's help, choices or default)."""
    out = {}
    for f in fields(cls):
        meta = {**f.metadata, **changes.get(f.name, {})}
        name = _flag(f, meta)
        if name is False or not f.metadata:
            continue
        kw = {k: meta[k] for k in _KEYWORDS if k in meta}
        kw["help"] = meta.get("help")
        if "type" in kw:
            kw["type"] = _value_type(kw["type"])
        default = meta.get("default", field_default(f))
        if name.startswith("-"):
            kw["dest"] = f.name
            if default is not MISSING:
                kw["default"] = default
            if isinstance(default, bool) and "action" not in kw:
                kw["action"] = (
                    argparse.BooleanOptionalAction if default else "store_true"
                )
            elif type(default) in (int, float) and "type" not in kw:
                kw["type"] = type(default)
        out[f.name] = (name, kw)
    return out


def add_fields(parser, cls, only=None, skip=(), **changes) -> None:
    """One argument per field of `cls` that has a flag (of `only` when given, none of `skip`),
    in field order; `changes` as `field_flags`."""
    for name, (flag, kw) in field_flags(cls, **changes).items():
        if (only is None or name in only) and name not in skip:
            parser.add_argument(flag, **kw)


def from_args(cls, args: argparse.Namespace, **given):
    """`cls` from the parsed arguments named as its fields; `given` values win."""
    names = {f.name for f in fields(cls)} - set(given)
    return cls(**{k: v for k, v in vars(args).items() if k in names}, **given)


def check_fields(options) -> None:
    """Each field's `least` and `choices`, as one ConfigError naming its flag."""
    for f in fields(options):
        value, flag = getattr(options, f.name), _flag(f, f.metadata)
        least, choices = f.metadata.get("least"), f.metadata.get("choices")
        if least is not None and value is not None and value < least:
            raise ConfigError(f"{flag} must be at least {least}")
        if choices and value not in choices:
            raise ConfigError(
                f"{flag} must be one of {', '.join(map(str, choices))}, not {value!r}"
            )


def _flag(f, meta) -> str:
    return meta.get("flag", "--" + f.name.replace("_", "-"))


def _value_type(spec):
    """An argparse `type`: a value_types validator by name, or (factory name, *arguments)."""
    if not isinstance(spec, (str, tuple)):
        return spec
    name, *params = (spec,) if isinstance(spec, str) else spec
    found = getattr(value_types, name)
    return found(*params) if params else found
