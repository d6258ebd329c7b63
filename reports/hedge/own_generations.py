"""The student's own continuations of training-side prompts, greedy and sampled (T 0.6, top-p
0.95), as JSONL text for `edge0-eval draft-vocab --text` (a draft vocabulary counted on what the
student actually writes).

    python own_generations.py STUDENT NEXT_TOKEN_HEADS PROMPTS.jsonl N OUT.jsonl
"""
import json
import sys

from edge0_eval.engine.engine import Engine
from edge0_eval.engine.options import EngineOptions
from edge0_eval.generate import _encode

student, heads, prompts_file, n, out = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
prompts = [json.loads(line)["prompt"] for line in open(prompts_file)][:n]
engine = Engine.load(student, EngineOptions(mode="prerouted", prerouter_path=heads, no_hedge=True))
with open(out, "w") as f:
    for i, p in enumerate(prompts):
        ids = _encode(engine.tokenizer, p[:400], False)       # the chat template, as `generate`
        for temperature, top_p in ((0.0, 1.0), (0.6, 0.95)):
            r = engine.generate(ids, max_tokens=48, temperature=temperature, top_p=top_p, seed=i)
            f.write(json.dumps({"text": engine.tokenizer.decode(r.tokens)}) + "\n")
engine.close()
