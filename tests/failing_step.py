"""An engine's step that raises where a test says: it stands in for `Engine.step` (a
`DecodeStep`), passing every other call and attribute (prefill, new_cache) to the real one."""

from __future__ import annotations

from typing import Callable


class FailingStep:
    """`fails(where)` -> the exception to raise at that step (None: run it)."""

    def __init__(self, step, fails: Callable[[str], BaseException | None]):
        self.step, self.fails = step, fails

    def __call__(self, *args, where: str = "", **kwargs):
        error = self.fails(where)
        if error is not None:
            raise error
        return self.step(*args, where=where, **kwargs)

    def __getattr__(self, name):
        return getattr(self.step, name)
