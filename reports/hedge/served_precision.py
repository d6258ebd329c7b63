"""The draft hedge's precision served: `edge0-eval generate` on the first 6 held-out prompts,
greedy and sampled (T 0.6, top-p 0.95), 48 tokens each; the engine's own stats per prompt,
weighted by the drafts each compared (tokens - 2: the first token comes from the prefill, the
last is never consumed).

    python served_precision.py STUDENT NEXT_TOKEN_HEADS DRAFT_VOCAB HELD_PROMPTS.jsonl OUT.json
"""
import json
import subprocess
import sys
import tempfile
from pathlib import Path

student, heads, vocab, prompts_file, out = sys.argv[1:6]
prompts = [json.loads(line)["prompt"] for line in open(prompts_file)][:6]
rows = []
with tempfile.TemporaryDirectory() as tmp:
    for i, p in enumerate(prompts):
        for temperature, top_p, name in ((0.0, 1.0, "greedy"), (0.6, 0.95, "t0.6")):
            path = Path(tmp) / f"{name}_{i}.json"
            subprocess.run(["edge0-eval", "generate", student, "--prompt", p[:400],
                            "--max-tokens", "48", "--temp", str(temperature), "--top-p", str(top_p),
                            "--mode", "prerouted", "--prerouter", heads, "--hedge", vocab,
                            "--json", str(path)], check=True, capture_output=True)
            d = json.loads(path.read_text())
            n = len(d["tokens"])
            rows.append({"decode": name, "prompt": i, "tokens": n, "compared_drafts": max(0, n - 2),
                         "draft_match_rate": d["stats"]["draft_match_rate"],
                         "hedge_precision": d["stats"]["hedge_precision"]})
summary = {}
for name in ("greedy", "t0.6"):
    rs = [r for r in rows if r["decode"] == name]
    w = sum(r["compared_drafts"] for r in rs)
    summary[name] = {"compared_drafts": w, **{k: sum(r[k] * r["compared_drafts"] for r in rs) / w
                                              for k in ("draft_match_rate", "hedge_precision")}}
Path(out).write_text(json.dumps({"draft_vocab": Path(vocab).name, "summary": summary,
                                 "rows": rows}, indent=1))
print(json.dumps(summary, indent=1))
