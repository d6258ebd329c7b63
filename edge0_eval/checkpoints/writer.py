"""Writing the streaming layout: bundles in (layer, expert) order, the index, side files, and
an output directory that appears only when complete."""

from __future__ import annotations

import contextlib
import hashlib
import re
import shutil
import tempfile
import threading
from pathlib import Path

from edge0_eval.errors import CheckpointError, ConfigError
from edge0_eval.formats.layout import ExpertIndex, crc32, pack_bundle

# Files in SRC that are weights (or weight indexes) and so are not copied to OUT.
_WEIGHT_FILE = re.compile(
    r"(\.safetensors|\.safetensors\.index\.json|\.bin|\.pt|\.pth|\.gguf"
    r"|\.npz|\.h5|\.msgpack|\.ckpt)$"
)


def file_digest(path: Path, stop: threading.Event | None = None) -> dict:
    """{"sha256", "bytes"} of a file; gives up early (returns {}) once `stop` is set."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 * 2**20):
            if stop is not None and stop.is_set():
                return {}
            h.update(chunk)
    return {"sha256": h.hexdigest(), "bytes": path.stat().st_size}


def file_digests(paths: list[Path], stop: threading.Event) -> dict[str, dict]:
    return {p.name: file_digest(p, stop) for p in paths}


class BundleWriter:
    """Appends bundles to experts.bin in (layer, expert) order, recording their crc32."""

    def __init__(self, path: Path, index: ExpertIndex):
        self.index = index
        self.file = open(path, "wb")
        index.crc32 = []

    def write_layer(self, layer: int, expert_arrays) -> None:
        """`expert_arrays(e)` -> {bundle tensor name: numpy array} for expert e of `layer`."""
        crcs, layout = [], self.index.layout(layer)
        for e in range(self.index.num_experts):
            if self.file.tell() != self.index.bundle_offset(layer, e):
                raise RuntimeError(
                    f"bundle ({layer}, {e}) would land at the wrong offset"
                )
            bundle = pack_bundle(layout, expert_arrays(e))
            crcs.append(crc32(bundle))
            self.file.write(bundle)
        self.index.crc32.append(crcs)

    def close(self) -> None:
        self.file.close()


def copy_side_files(src: Path, dst: Path) -> None:
    """Tokenizer, generation config, chat template, code...: every regular non-weight file
    but hidden ones (local caches, such as the weights' digests, describe the source's files)."""
    for path in sorted(src.iterdir()):
        if (
            path.is_file()
            and not path.name.startswith(".")
            and path.name != "config.json"
            and not _WEIGHT_FILE.search(path.name)
        ):
            shutil.copy2(path, dst / path.name)


def check_out_empty(out: str | Path) -> Path:
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(
            f"{out} exists and is not empty; choose a new directory or remove it"
        )
    return out


@contextlib.contextmanager
def output_dir(out: str | Path):
    """Build OUT in a temp dir next to it; rename into place on success, remove on failure.

    A failed or interrupted write leaves nothing behind, and a non-empty OUT is refused.
    """
    out = check_out_empty(out)
    parent = out.parent if str(out.parent) else Path(".")
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=parent))
    try:
        yield tmp
        if out.exists():
            out.rmdir()
        tmp.chmod(0o755)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def check_free_space(directory: Path, needed: int) -> None:
    free = shutil.disk_usage(directory).free
    if free < needed:
        raise CheckpointError(
            f"not enough free space in {directory}: need about "
            f"{needed / 1e9:.2f} GB, {free / 1e9:.2f} GB free"
        )
