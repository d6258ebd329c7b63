"""Mixed heads for any split from two trainings on the same store: context part from a
`--context-layers M` file, next-token part from the `--next-token` file.

Heads train independently (own loss, own Adam moments; the same seeded batches), so this is the
file `train-prerouter --next-token --context-layers m` writes for every m <= M
(tests/test_mixed_heads.py: the next-token rows of a mixed training equal a next-token
training's). Usage: assemble.py MIXED_M NEXT_TOKEN m OUT
"""
import sys
from pathlib import Path
from dataclasses import replace

import mlx.core as mx

from edge0_eval.engine.heads_file import load_heads, read_metadata, save_heads
from edge0_eval.engine.prerouter import PrerouterHeads

mixed_path, nt_path, m, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
meta = read_metadata(mixed_path)
dims = dict(hidden=int(meta["hidden"]), num_experts=int(meta["num_experts"]), top_k=int(meta["K"]))
mixed, nt = load_heads(mixed_path, **dims), load_heads(nt_path, **dims)
assert mixed.config.owners == nt.config.owners and mixed.config.consumers == nt.config.consumers
context = sorted(mixed.config.consumers)[:m]
assert set(context) <= set(mixed.config.context_consumers), "m exceeds the mixed file's split"
take = mx.array([c in context for c in mixed.config.consumers])[:, None, None]
pick = lambda a, b: mx.where(take, a, b)  # noqa: E731
heads = PrerouterHeads(replace(nt.config, context_consumers=context), pick(mixed.fc1, nt.fc1),
                       pick(mixed.fc2, nt.fc2), pick(mixed.linear, nt.linear))
save_heads(out, heads, {"source": f"assemble.py: context part of {Path(mixed_path).name}, m={m}",
                        "model": meta.get("model", ""), "model_type": meta.get("model_type", "")},
           dtype=None)
print(f"wrote {out}: context consumers {context}")
