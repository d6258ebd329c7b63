"""Scratch harness of reports/perf/2026-12-05-fewer-ops.md, as that page ran it.

It imports the engine's internals of its day: run it in a checkout of commit 36a4f93
(the commit that put it in the report), not against the current package.
"""

# steps.py B T R: host ms of each decode step at B (one process)
import sys

from edge0_eval.bench import _prompt
from edge0_eval.engine import batch
from edge0_eval.engine.engine import Engine
from edge0_eval.engine.options import EngineOptions

B, T, R = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
opts = EngineOptions(
    mode="prerouted", experts_per_token=4, slots_per_layer=8, prerouter_path="HEADS_K4"
)
e = Engine.load("S35_8", opts)
c, per, orig = e.counters, [], batch.BatchDecoder._step


def _step(self):
    h = c.host_seconds
    orig(self)
    per.append(round(1000 * (c.host_seconds - h), 2))


batch.BatchDecoder._step = _step
prompts = [_prompt(e.tokenizer, 8, r) for r in range(B)]
e.generate_batch(prompts, max_tokens=3, batch_size=B, stop_token_ids=set())
for r in range(R):
    per.clear()
    e.generate_batch(prompts, max_tokens=T, batch_size=B, stop_token_ids=set())
    print("round", r, per)
e.close()
