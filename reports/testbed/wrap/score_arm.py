"""Score one prerouted arm on a fidelity set, as the OpenCompass prerouted_nolora / student arms
serve it (EngineOptions(mode="prerouted", slots_per_layer=16), teacher-forced with
evaluation.fidelity.score_model), optionally with only some owners of a heads file.

    python score_arm.py STUDENT SET HEADS OUT.json [--owners 0..28] [--lora FILE] [--weights router]

--owners writes the selected heads (the same trained weights) to OUT.heads.safetensors first,
so arms that differ only in their start layer share every head they both have.
"""

import argparse
import json
import time

from edge0_eval.engine.engine import Engine, EngineOptions
from edge0_eval.engine.heads_file import load_heads, read_metadata, save_heads
from edge0_eval.evaluation.fidelity import score_model
from edge0_eval.evaluation.fidelity_set import read_set
from edge0_eval.training.options import parse_owners

p = argparse.ArgumentParser()
p.add_argument("student")
p.add_argument("set")
p.add_argument("heads")
p.add_argument("out")
p.add_argument("--owners", nargs="+", default=None)
p.add_argument("--lora", default=None)
p.add_argument("--weights", default="head", choices=["head", "router"],
               help="EngineOptions.prerouted_weights: the combination weights of a planned set")
a = p.parse_args()

heads_path = a.heads
if a.owners:
    meta = read_metadata(a.heads)
    config = json.load(open(f"{a.student}/config.json"))
    heads = load_heads(a.heads, hidden=config["hidden_size"], num_experts=config["num_experts"],
                       top_k=int(meta["K"]), owners=parse_owners(a.owners))
    heads_path = f"{a.out}.heads.safetensors"
    save_heads(heads_path, heads, {"source": meta.get("source", ""), "model": meta.get("model", ""),
                                   "model_type": meta.get("model_type", "")}, dtype=None)
opts = EngineOptions(mode="prerouted", slots_per_layer=16, prerouter_path=heads_path,
                     no_lora=a.lora is None, lora_path=a.lora, prerouted_weights=a.weights)
engine = Engine.load(a.student, opts)
fset = read_set(a.set)
started = time.perf_counter()
rows = score_model(engine, fset)
seconds = time.perf_counter() - started
json.dump({"heads": a.heads, "owners": a.owners, "lora": a.lora, "weights": a.weights,
           "seconds": seconds,
           "prerouted_layers": sorted(set(engine.prerouter.consumers)),
           "rows": rows}, open(a.out, "w"), indent=1)
print(a.out, len(rows), "items", f"{seconds:.0f} s")
