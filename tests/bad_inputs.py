"""Helpers for test_bad_inputs: corrupting files, and the one rule every case checks.

`expect_clear_error(fn, *names)` runs `fn` under a time limit and requires exactly one kind of
outcome: an Edge0Error whose message names one of `names` (the file or option). Anything else
(another exception = a traceback for the user, success = a corrupt input accepted, the alarm =
a hang) fails the case.
"""

from __future__ import annotations

import contextlib
import json
import random
import shutil
import signal
import struct
from pathlib import Path

from edge0_eval.errors import Edge0Error

LIMIT_S = 60


class Hang(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds: int = LIMIT_S):
    def on_alarm(signum, frame):
        raise Hang(f"no answer within {seconds} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def outcome(fn) -> tuple[str, str]:
    """('error', message) | ('accepted', '') | ('traceback', repr) | ('hang', '')."""
    try:
        with time_limit():
            fn()
    except Hang:
        return "hang", ""
    except Edge0Error as exc:
        return "error", str(exc)
    except SystemExit as exc:  # argparse: exit 2 with the message on stderr
        return (
            ("error", "argparse")
            if exc.code == 2
            else ("traceback", f"exit {exc.code}")
        )
    except BaseException as exc:  # noqa: BLE001 - everything else is a traceback for the user
        return "traceback", f"{type(exc).__name__}: {exc}"
    return "accepted", ""


def expect_clear_error(fn, *names, capsys=None) -> str:
    kind, message = outcome(fn)
    assert kind == "error", f"expected one clear error, got {kind}: {message}"
    if message == "argparse" and capsys is not None:
        message = capsys.readouterr().err
        assert "Traceback" not in message
    assert any(str(n) in message for n in names), (
        f"error does not name {names}: {message}"
    )
    return message


def copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# -- JSON and safetensors editing -------------------------------------------------------------


def edit_json(path: Path, change) -> None:
    data = json.loads(path.read_text())
    out = change(data)
    path.write_text(json.dumps(data if out is None else out))


def read_header(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def write_header(
    path: Path, header, body: bytes, raw_header: bytes | None = None
) -> None:
    text = raw_header if raw_header is not None else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + body)


def edit_header(path: Path, change) -> None:
    header, body = read_header(path)
    out = change(header)
    write_header(path, header if out is None else out, body)


# -- seeded mutations -------------------------------------------------------------------------

_CODES = ["F16", "BF16", "F32", "U32", "I32", "U8", "I64", "F64", "Q4", "", None, 7]


def _other(rng: random.Random, value, choices):
    options = [c for c in choices if c != value]
    return rng.choice(options)


def _bad_number(rng: random.Random, value):
    if isinstance(value, bool):
        return rng.choice([not value, 0, "yes"])
    if isinstance(value, int):
        return rng.choice(
            [
                value + 1,
                value - 1,
                -value - 1,
                0 if value else 1,
                float(value) + 0.5,
                str(value),
                None,
                [value],
                value * 1024 + 3,
                2**63,
            ]
        )
    return rng.choice([None, "x", [], {}, -1, 3.5])


def mutate_index(rng: random.Random, data: dict) -> str:
    """Change one field of an index dict in place so that it no longer describes its file."""
    fields = [k for k in data if k != "source"]
    key = rng.choice(fields + ["tensors"] * 4 + ["crc32"] * 2 + ["<delete>", "<add>"])
    if key == "<delete>":
        victim = rng.choice(
            [
                k
                for k in data
                if k not in ("source", "file_size", "alignment", "file", "crc32")
            ]
        )
        del data[victim]
        return f"delete {victim}"
    if key == "<add>":
        data[rng.choice(["extra", "bits2", "experts"])] = 1
        return "unknown field"
    value = data[key]
    if key == "tensors":
        t = rng.choice(value)
        part = rng.choice(
            ["shape", "dtype", "offset", "nbytes", "name", "swap", "drop"]
        )
        if part == "swap":
            a, b = rng.sample(range(len(value)), 2)
            value[a]["offset"], value[b]["offset"] = (
                value[b]["offset"],
                value[a]["offset"],
            )
            if value[a]["offset"] == value[b]["offset"]:
                value[a]["offset"] += 64
        elif part == "drop":
            value.remove(t)
        elif part == "dtype":
            t["dtype"] = _other(
                rng,
                t["dtype"],
                ["float16", "bfloat16", "float32", "uint32", "int8", "f16", None, 3],
            )
        elif part == "shape":
            i = rng.randrange(len(t["shape"]))
            t["shape"][i] = _bad_number(rng, t["shape"][i])
        elif part == "name":
            t["name"] = _other(
                rng,
                t["name"],
                [
                    "gate_proj.weight",
                    "up_proj.weight",
                    "down_proj.scales",
                    "gate.weight",
                    "",
                    None,
                ],
            )
        else:
            t[part] = _bad_number(rng, t[part])
        return f"tensors[{t.get('name')}].{part}"
    if key == "crc32":
        if not value:
            return "crc32 empty already"
        row = rng.randrange(len(value))
        col = rng.randrange(len(value[row]))
        choice = rng.choice(["flip", "drop_row", "type"])
        if choice == "flip":
            value[row][col] ^= 1 << rng.randrange(32)
        elif choice == "drop_row":
            value.pop(row)
        else:
            value[row][col] = rng.choice([-1, 2**32, "0", None, 1.5])
        return f"crc32 {choice}"
    if key in ("model_type", "mode", "module_path", "file", "format"):
        data[key] = _other(
            rng,
            value,
            [
                "qwen2_moe",
                "bailing_hybrid",
                "llama",
                "mxfp4",
                "",
                None,
                "experts2.bin",
                "x.{layer}",
                5,
            ],
        )
    elif key == "moe_layers":
        data[key] = rng.choice(
            [
                value[:-1],
                value + [value[-1] + 1],
                list(reversed(value)),
                [value[0]] * len(value),
                [float(v) for v in value],
                [],
                "0,1",
                [v + 1 for v in value],
            ]
        )
        if data[key] == value:
            data[key] = []
    else:
        new = _bad_number(rng, value)
        data[key] = new if new != value or type(new) is not type(value) else None
    return f"{key}"


def mutate_header(rng: random.Random, header: dict, body: bytes) -> tuple:
    """One change to a safetensors header/file: (header or None, raw header or None, body, what).

    Every change breaks the format or relabels data (a dtype lie), never a harmless edit.
    """
    names = [k for k in header if k != "__metadata__"]
    op = rng.choice(
        [
            "dtype",
            "shape",
            "offsets",
            "delete",
            "add",
            "meta",
            "truncate",
            "length",
            "bytes",
            "list",
            "extend",
        ]
    )
    if op == "list":
        return None, json.dumps(list(header.items())).encode(), body, op
    if op == "bytes":
        raw = bytearray(json.dumps(header).encode())
        pos = rng.randrange(len(raw))
        # A different byte: replacing one with itself would be no mutation at all.
        raw[pos] = rng.choice([c for c in b'{}[]:,"\xff\x00' if c != raw[pos]])
        return None, bytes(raw), body, op
    if op == "truncate":
        cut = rng.randrange(1, max(2, len(body)))
        return header, None, body[:-cut], op
    if op == "extend":
        return header, None, body + b"\0" * rng.choice([1, 7, 64]), op
    if op == "length":
        raw = json.dumps(header).encode()
        return (
            None,
            raw + b" " * 0,
            body,
            op,
        )  # see write_mutated: length is perturbed there
    if op == "meta":
        header["__metadata__"] = rng.choice([[1, 2], "x", 5, {"kind": 3}, {"r": None}])
        return header, None, body, op
    if op == "add":
        header[f"bogus.{rng.randrange(99)}"] = {
            "dtype": "F16",
            "shape": [2],
            "data_offsets": [0, 4],
        }
        return header, None, body, op
    name = rng.choice(names)
    info = header[name]
    if op == "delete":
        del header[name]
    elif op == "dtype":
        size = {"F16": 2, "BF16": 2, "F32": 4, "U32": 4, "I32": 4, "U8": 1}.get(
            info["dtype"]
        )
        same = [
            c
            for c, s in {"F16": 2, "BF16": 2, "F32": 4, "U32": 4, "I32": 4}.items()
            if s == size and c != info["dtype"]
        ]
        # Wrong JSON types too: an object or a list as the dtype.
        info["dtype"] = rng.choice(
            same + ["Q4", "F64", "", None, {}, ["F16"]]
            if same
            else ["Q4", None, {}, ["F16"]]
        )
    elif op == "shape":
        i = rng.randrange(len(info["shape"])) if info["shape"] else None
        if i is None:
            info["shape"] = [3]
        else:
            info["shape"][i] = rng.choice(
                [
                    info["shape"][i] + 1,
                    info["shape"][i] * 2 + 1,
                    -1,
                    float(info["shape"][i]) + 0.5,
                    "4",
                    None,
                    {},
                    [2],
                ]
            )
    else:
        begin, end = info["data_offsets"]
        info["data_offsets"] = rng.choice(
            [
                [begin + 2, end + 2],
                [end, begin],
                [begin, end + 4],
                [begin, None],
                [-1, end],
                [begin],
                "0-4",
                [begin, {}],
                {"begin": begin, "end": end},
            ]
        )
    return header, None, body, f"{op} {name}"


def write_mutated(rng: random.Random, path: Path, header, raw, body, what: str) -> None:
    text = raw if raw is not None else json.dumps(header).encode()
    n = len(text)
    if what == "length":
        n = rng.choice([n + 1, n - 1, 0, 2**40, len(text) + len(body) + 9])
    path.write_bytes(struct.pack("<Q", n) + text + body)
