"""A file the engine keeps reading while it serves must stay the file it opened.

The expert file is read for as long as an engine lives (engine/store.py), and the index's
checksums, loaded once, describe it as it was opened. A write into it in place (the same inode:
a convert run again into the folder, a copy over it, a restore) changes what later reads return,
and a bundle whose checksum passed before the write would be trusted afterwards, or never
checked with --no-verify-crc. `FileGuard` takes the open file's stamp (size, mtime, ctime) when
the store opens it and compares it after every read, one `fstat` of the open descriptor (cost:
`edge0-eval bench --compare-file-guard`). A write moves mtime when it starts, so a read that saw
any written byte is followed by a check that sees the new stamp; ctime also moves when a writer
sets mtime back, and when the file is deleted or another is renamed over its path (the folder
then holds another model than the one served). Any change stops the engine with one error naming
the file; a permission change stops it too, a false alarm that costs a restart, never a score.

Adapters, heads, draft vocabularies and resident weights need no guard: each is read whole and
evaluated when the engine loads (formats/adapters.py, heads_file.py, draft_file.py,
Engine.load), and never again.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from edge0_eval.errors import CheckpointError


class FileGuard:
    """The stamp of an open file, taken when it was opened, checked after each read."""

    def __init__(self, fd: int, path: str | Path, fix: str):
        self._fd, self.path, self.fix = fd, Path(path), fix
        self.stamp = self._now()

    def _now(self) -> tuple[int, int, int]:
        st = os.fstat(self._fd)
        return (st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    @property
    def age_ns(self) -> int:
        """Nanoseconds since the file was last written, as stamped when it was opened."""
        return time.time_ns() - self.stamp[1]

    def check(self) -> None:
        """Raise CheckpointError if the file changed since it was opened."""
        now = self._now()
        if now != self.stamp:
            raise CheckpointError(
                f"{self.path} changed while the engine was reading it "
                f"({self._what(now)}): what it holds now is not what the index "
                f"describes, so the run stops and records nothing; {self.fix}"
            )

    def _what(self, now: tuple[int, int, int]) -> str:
        (size0, mtime0, _), (size, mtime, _) = self.stamp, now
        if size != size0:
            return f"size {size0} -> {size} bytes"
        if mtime != mtime0:
            return f"written in place, mtime moved {(mtime - mtime0) / 1e9:+.3f} s"
        return (
            "ctime moved: deleted or replaced by another file, its mtime set back "
            "after a write, or its permissions changed"
        )
