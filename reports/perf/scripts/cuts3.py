"""Scratch harness of reports/perf/2026-12-05-host-by-function.md, as that page ran it.

It imports the engine's internals of its day: run it in a checkout of commit 6f2f380
(the commit that put it in the report), not against the current package.
"""

# cuts3.py: the three cuts (apply, b8dca70's code) against 67f38b3's (revert)
import mlx.core as mx
import numpy as np

from edge0_eval.engine import moe, rows

G = moe.StreamingSwitchGLU
new_publish, new_call, new_add = G._publish, G.__call__, rows.StopRule.add


def old_publish(self, moved):
    moved = list(moved)
    for e, s in moved:  # keep the host table in step for the other arm (~3 us)
        self._io.table[e] = s
    self._io.lut[mx.array([e for e, _ in moved], dtype=mx.int32)] = mx.array(
        [s for _, s in moved], dtype=mx.int32
    )


def old_call(self, x, indices, pinned=False):
    io = self._io
    if io.resident:
        return self.glu(x, indices)
    if pinned:
        return self.glu(x, io.lut[indices])
    io.counters.evaluate(indices)
    ids = np.array(indices)
    unique = np.unique(ids).tolist()
    io.counters.union_experts += len(unique)
    io.counters.union_calls += 1
    if len(unique) <= io.slots.n_slots:
        self.load_experts(unique)
        return self.glu(x, io.lut[indices])
    return self._call_in_groups(x, indices, ids, unique)


def old_add(self, token):  # every token read as it comes, as 67f38b3's reader did
    if self.finish is not None:
        return True
    token = int(token)
    if token in self.stop_ids:
        return self._end("eos" if token in self.eos_ids else "stop_token")
    self.tokens.append(token)
    self.reader.add(token)
    new = self.reader.read_new()
    if self.stop_words:
        text = self.tail + new
        if any(w in text for w in self.stop_words):
            self.finish = "stop_word"
            return True
        self.tail = text[-self.keep :]
    if len(self.tokens) >= self.max_tokens:
        return self._end("length")
    return False


def apply():
    G._publish, G.__call__, rows.StopRule.add = new_publish, new_call, new_add


def revert():
    G._publish, G.__call__, rows.StopRule.add = old_publish, old_call, old_add
