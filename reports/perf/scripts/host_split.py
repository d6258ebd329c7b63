"""Scratch harness of reports/perf/2026-12-05-b8-host-time.md, as that page ran it.

It imports the engine's internals of its day: run it in a checkout of commit ec6fb37
(the commit that put it in the report), not against the current package.

python host_split.py S35_8 HEADS_K4 B: the stepping thread's CPU time a decode step by
function, each function's own (callees and evaluations out), inside BatchDecoder._step.
"""

import collections
import functools
import sys
import time

import mlx_lm.models.qwen3_5 as q35
import mlx_lm.models.qwen3_next as q3n
import mlx_lm.models.switch_layers as sl

from edge0_eval.bench import _prompt
from edge0_eval.engine import batch, moe, prerouted, step, store
from edge0_eval.engine.engine import Engine
from edge0_eval.engine.options import EngineOptions

own, stack = collections.Counter(), []


def wrap(cls, name):
    f, label = getattr(cls, name), f"{cls.__name__}.{name}"

    @functools.wraps(f)
    def g(*a, **k):
        if not stack and label != "BatchDecoder._step":
            return f(*a, **k)
        node = [time.thread_time(), 0.0]
        stack.append(node)
        try:
            return f(*a, **k)
        finally:
            total = time.thread_time() - node[0]
            stack.pop()
            own[label] += total - node[1]
            if stack:
                stack[-1][1] += total

    setattr(cls, name, g)


for cls, names in [
    (moe.Counters, ["evaluate"]),
    (
        moe.StreamingSwitchGLU,
        [
            "stage_begin",
            "stage_finish",
            "_write_slots",
            "load_experts",
            "__call__",
            "_chunks",
        ],
    ),
    (moe.LayerSlots, ["assign"]),
    (store.ExpertStore, ["submit_many"]),
    (prerouted.Prerouter, ["plan", "after_step", "finish", "_stage"]),
    (prerouted.PrerouterHeads, ["__call__"]),
    (step.DecodeStep, ["__call__", "forward", "logits", "_planned_route"]),
    (step.StreamingMoE, ["__call__"]),
    (step.QwenStreamingMoE, ["shared", "weights", "select"]),
    (batch.BatchDecoder, ["_step", "_take", "_snapshot", "_account"]),
    (q35.DecoderLayer, ["__call__"]),
    (q35.GatedDeltaNet, ["__call__"]),
    (q3n.Qwen3NextAttention, ["__call__"]),
    (sl.SwitchGLU, ["__call__"]),
]:
    for n in names:
        wrap(cls, n)
opts = EngineOptions(
    mode="prerouted", experts_per_token=4, slots_per_layer=8, prerouter_path=sys.argv[2]
)
e, b = Engine.load(sys.argv[1], opts), int(sys.argv[3])
prompts = [_prompt(e.tokenizer, 8, r) for r in range(b)]
e.generate_batch(prompts, max_tokens=3, batch_size=b, stop_token_ids=set())  # warm-up
own.clear()
rows = e.generate_batch(prompts, max_tokens=9, batch_size=b, stop_token_ids=set())
steps = rows[0].stats["batch_steps"]
for k, v in own.most_common():
    print(f"{k:32s} {1000 * v / steps:7.3f} ms a step")  # Counters.evaluate: evaluation
e.close()
