"""safetensors files: the one header check every reader runs before MLX sees a file, and the
atomic writer every writer uses."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import mlx.core as mx

from edge0_eval.errors import CheckpointError
from edge0_eval.formats.json_files import json_name, no_constant, type_ok, unreadable

# safetensors dtype codes -> bytes per element (the format's full list).
ST_ITEMSIZE = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "F64": 8,
    "I64": 8,
    "U64": 8,
}
ST_FLOAT = {"F16": "float16", "BF16": "bfloat16", "F32": "float32"}
# A header larger than this is not a weights header (safetensors itself caps it at 100 MB).
_MAX_HEADER = 100 * 2**20


def write_safetensors(path: str | Path, arrays: dict, metadata: dict) -> Path:
    """Write a safetensors file atomically (a reader never sees half of one); the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp.safetensors")
    try:
        mx.save_safetensors(str(tmp), arrays, metadata=metadata)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def read_safetensors_header(
    path: str | Path, what: str, fix: str
) -> tuple[dict[str, tuple[str, list[int], int, int]], dict[str, str]]:
    """({name: (dtype code, shape, begin, end)}, metadata) of a safetensors file.

    Checks what the format defines: the 8-byte little-endian header length within the file, a
    UTF-8 JSON object, `__metadata__` a string->string object, each tensor's dtype a format code,
    shape a list of non-negative integers, data_offsets consistent with dtype x shape, tensors
    contiguous without overlap and ending exactly at the file's end.
    """
    path = Path(path)

    def bad(why: str) -> CheckpointError:
        return CheckpointError(
            f"{path}: {what} is truncated or corrupt, not a valid "
            f"safetensors file ({why}); {fix}"
        )

    n, size, raw = _header_bytes(path, what, fix, bad)
    try:
        header = json.loads(raw.decode("utf-8").rstrip(" "), parse_constant=no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise bad(f"header is not UTF-8 JSON: {exc}") from None
    if not isinstance(header, dict):
        raise bad(f"header is a JSON {json_name(type(header))}, not an object")
    meta = header.pop("__metadata__", None)
    if meta is None:
        meta = {}
    if not isinstance(meta, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in meta.items()
    ):
        raise bad("__metadata__ must be an object of string values")
    tensors = {name: _tensor_entry(name, info, bad) for name, info in header.items()}
    pos = 0
    for begin, end, name in sorted((t[2], t[3], name) for name, t in tensors.items()):
        if begin != pos:
            raise bad(
                f"tensor {name!r} starts at {begin}, expected {pos} "
                f"({'overlap' if begin < pos else 'gap'})"
            )
        pos = end
    if 8 + n + pos != size:
        raise bad(f"tensors end at byte {8 + n + pos} but the file has {size} bytes")
    return tensors, dict(meta)


def _header_bytes(path: Path, what: str, fix: str, bad) -> tuple[int, int, bytes]:
    """(header length, file size, header bytes), the length checked against the file."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise bad("shorter than the 8-byte header length")
            n = int.from_bytes(head, "little")
            if n < 2 or n > size - 8 or n > _MAX_HEADER:
                raise bad(
                    f"header length {n} does not fit the file's {size} bytes (truncated?)"
                )
            return n, size, f.read(n)
    except OSError as exc:
        raise unreadable(path, what, fix, exc) from None


def _tensor_entry(name: str, info, bad) -> tuple[str, list[int], int, int]:
    """(dtype code, shape, begin, end) of one header entry, its sizes consistent."""
    if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
        raise bad(f"tensor {name!r} entry must hold exactly dtype, shape, data_offsets")
    code, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    # A JSON object or list is unhashable: test the type before looking it up.
    if not isinstance(code, str) or code not in ST_ITEMSIZE:
        raise bad(f"tensor {name!r} has dtype {code!r}, not a safetensors dtype")
    if not isinstance(shape, list) or not all(
        type_ok(d, int) and d >= 0 for d in shape
    ):
        raise bad(f"tensor {name!r} has shape {shape!r}, not a list of sizes")
    if not (
        isinstance(offsets, list)
        and len(offsets) == 2
        and all(type_ok(o, int) and o >= 0 for o in offsets)
    ):
        raise bad(f"tensor {name!r} has data_offsets {offsets!r}, not [begin, end]")
    begin, end = offsets
    if end - begin != math.prod(shape) * ST_ITEMSIZE[code]:
        raise bad(
            f"tensor {name!r}: data_offsets {begin}..{end} do not hold {code} {shape}"
        )
    return code, list(shape), begin, end


def checkpoint_float_dtype(directory: str | Path) -> str | None:
    """The floating dtype a model directory's weights hold, as mlx-lm computes in it: its token
    embedding's (the weight, or a quantized one's scales), else the commonest floating dtype of
    its *.safetensors tensors; None where none is floating. Headers only, never the weights."""
    counts: dict[str, int] = {}
    fix = "convert the checkpoint again"
    for file in sorted(Path(directory).glob("*.safetensors")):
        tensors, _ = read_safetensors_header(file, "weights", fix)
        for name, (code, _, _, _) in tensors.items():
            if code not in ST_FLOAT:
                continue
            if "embed" in name and name.endswith((".weight", ".scales")):
                return ST_FLOAT[code]
            counts[code] = counts.get(code, 0) + 1
    return ST_FLOAT[max(counts, key=counts.get)] if counts else None
