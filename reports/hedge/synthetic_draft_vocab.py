"""Draft vocabularies for the synthetic 8-layer shape, from the prerouted student's own
greedy decode of bench's prompt (random weights: text counts never match). `drop` removes the
ids of `drop` distinct generated tokens from the middle, so those steps' drafts miss (a set match rate,
as --embedding-scale sets a precision).

    python synthetic_draft_vocab.py MODEL NEXT_TOKEN_HEADS TOKENS N OUT DROP
"""
import sys
import numpy as np
from edge0_eval.bench import _prompt
from edge0_eval.engine.draft import save_draft_vocab
from edge0_eval.engine.engine import Engine
from edge0_eval.engine.options import EngineOptions

model, heads, tokens, n, out, drop = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], int(sys.argv[6])
e = Engine.load(model, EngineOptions(mode="prerouted", prerouter_path=heads, no_hedge=True, no_lora=True, top_k=4, slots_per_layer=8))
vocab = e.family.embedding(e.model).weight.shape[0]
r = e.generate(_prompt(e.tokenizer, 8), max_tokens=tokens, stop_token_ids=set())
e.close()
gen = list(dict.fromkeys(r.tokens))
print("generated", r.tokens, "distinct", len(gen))
mid = len(gen) // 2
keep = gen[:mid] + gen[mid + drop:]   # drafts are compared for tokens[1:-1]
dropped = set(gen) - set(keep)
rest = [i for i in range(vocab) if i not in set(gen)][: n - len(keep)]
ids = np.array(keep + rest)
print("dropped", sorted(dropped), "miss steps", sum(t in dropped for t in r.tokens[1:-1]), "of", len(r.tokens) - 2)
save_draft_vocab(out, ids, vocab, {"source": "reports/hedge/synthetic_draft_vocab.py"})
