"""Scratch harness of reports/perf/2026-12-05-host-by-function.md, as that page ran it.

It imports the engine's internals of its day: run it in a checkout of commit a8b5503
(the commit that put it in the report), not against the current package.
"""

# breakdown.py B T R: each wrapped function's own host ms a decode step (the last round)
import collections
import functools
import sys
import time

from edge0_eval.bench import _prompt
from edge0_eval.engine import batch, moe, prerouted
from edge0_eval.engine import rows as rowsmod
from edge0_eval.engine import step as stepmod
from edge0_eval.engine.engine import Engine
from edge0_eval.engine.options import EngineOptions

B, T, R = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
acc, stack, insteps, C = collections.Counter(), [], [False], None


def wrap(cls, name, label):
    f = getattr(cls, name)

    @functools.wraps(f)
    def g(*a, **k):
        w0, t0 = C.eval_wait_seconds + C.read_wait_seconds, time.perf_counter()
        stack.append(0.0)
        try:
            return f(*a, **k)
        finally:
            dt = (
                time.perf_counter()
                - t0
                - (C.eval_wait_seconds + C.read_wait_seconds - w0)
            )
            inner = stack.pop()
            if label == "_step other" or insteps[0]:
                acc[label] += dt - inner
            if stack:
                stack[-1] += dt

    setattr(cls, name, g)


wrap(batch.BatchDecoder, "_step", "_step other")
_f = batch.BatchDecoder._step


def _g(*a, **k):
    insteps[0] = True
    try:
        return _f(*a, **k)
    finally:
        insteps[0] = False


batch.BatchDecoder._step = _g
for cls, name, label in [
    (stepmod.DecodeStep, "__call__", "step other"),
    (stepmod.DecodeStep, "forward", "forward layers"),
    (prerouted.Prerouter, "after_step", "after_step other"),
    (prerouted.Prerouter, "plan", "plan (heads) other"),
    (prerouted.Prerouter, "_stage", "_stage other"),
    (moe.StreamingSwitchGLU, "stage_begin", "stage_begin other"),
    (moe.StreamingSwitchGLU, "_chunks", "_chunks"),
    (moe.LayerSlots, "assign", "assign"),
    (moe.ExpertStore, "submit_many", "submit_many"),
    (moe.StreamingSwitchGLU, "stage_finish", "stage_finish other"),
    (moe.StreamingSwitchGLU, "_write_slots", "_write_slots"),
    (moe.StreamingSwitchGLU, "__call__", "switch __call__ other"),
    (moe.StreamingSwitchGLU, "load_experts", "load_experts other"),
    (stepmod.DecodeStep, "logits", "logits"),
    (batch.BatchDecoder, "_take", "_take"),
    (rowsmod.IncrementalText, "add", "IncrementalText.add"),
    (batch.BatchDecoder, "_snapshot", "_snapshot"),
]:
    wrap(cls, name, label)
opts = EngineOptions(
    mode="prerouted", experts_per_token=4, slots_per_layer=8, prerouter_path="HEADS_K4"
)
e = Engine.load("S35_8", opts)
C = e.counters
prompts = [_prompt(e.tokenizer, 8, r) for r in range(B)]
for r in range(R):
    acc.clear()
    h0 = C.host_seconds
    out = e.generate_batch(prompts, max_tokens=T, batch_size=B, stop_token_ids=set())
    steps = out[0].stats["batch_steps"]
    print("round", r, "host ms/step %.3f" % (1000 * (C.host_seconds - h0) / steps))
for k, v in acc.most_common():
    print("%-24s %7.3f ms/step" % (k, 1000 * v / steps))
e.close()
