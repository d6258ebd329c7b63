"""Every relative link and image in a tracked markdown file resolves to a tracked file or
folder inside the repository: a moved or deleted page leaves no link pointing nowhere."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path, PurePosixPath

import pytest

ROOT = Path(__file__).resolve().parents[1]
# [text](target) and ![alt](target); the target ends at whitespace (a title may follow).
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_FENCE = re.compile(r"^\s*(```|~~~)")
_SKIP = ("http://", "https://", "mailto:", "#")


def _tracked(root: Path) -> list[str]:
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the tracked files are unknown")
    return [p for p in out.decode().split("\0") if p]


def _links(text: str):
    """(line number, target) of each link outside fenced blocks and inline code."""
    fenced = False
    for n, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            for m in _LINK.finditer(re.sub(r"`[^`]*`", "", line)):
                yield n, m.group(1)


def _resolve(md: str, path: str) -> str | None:
    """The repository path a link of md names; None above the root or absolute."""
    if path.startswith("/"):
        return None
    parts: list[str] = []
    for part in (PurePosixPath(md).parent / path).parts:
        if part == "..":
            if not parts:
                return None
            parts.pop()
        elif part != ".":
            parts.append(part)
    return "/".join(parts) or "."


def broken_links(files: list[str], read) -> list[str]:
    """'file:line: target' for each relative link of the markdown among files (repository
    paths) that names no file or folder among them; read(path) gives a file's text."""
    known = set(files) | {str(p) for f in files for p in PurePosixPath(f).parents}
    bad = []
    for md in (f for f in files if f.endswith(".md")):
        for n, target in _links(read(md)):
            path = target.split("#", 1)[0].split("?", 1)[0]
            if not target.startswith(_SKIP) and _resolve(md, path) not in known:
                bad.append(f"{md}:{n}: {target}")
    return bad


def test_every_relative_link_in_the_docs_resolves():
    files = _tracked(ROOT)
    bad = broken_links(files, lambda p: (ROOT / p).read_text(encoding="utf-8"))
    assert not bad, (
        "links to nothing (point them at what exists or drop them):\n" + "\n".join(bad)
    )


def test_a_broken_link_is_found(tmp_path):
    pages = {
        "README.md": "[ok](docs/a.md) [dir](docs/) ![img](docs/fig.png) [web](https://x.y)\n"
        "[anchor](#limits) [here](docs/a.md#part) `[code](nowhere.md)`\n"
        "```\n[fenced](nowhere.md)\n```\n",
        "docs/a.md": "[up](../README.md) [gone](old.md)\n[out](../../outside/x.md)\n",
        "docs/fig.png": "",
        "docs/b.md": "![gone](figs/missing.png)\n[abs](/etc/passwd)\n",
    }
    for name, text in pages.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    found = broken_links(list(pages), lambda p: (tmp_path / p).read_text())
    assert found == [
        "docs/a.md:1: old.md",
        "docs/a.md:2: ../../outside/x.md",
        "docs/b.md:1: figs/missing.png",
        "docs/b.md:2: /etc/passwd",
    ]
