#!/usr/bin/env bash
# Host work per decode step and the read bound on a CUDA GPU, solo and batched, before (BASE)
# and after (this checkout): the figures docs/performance.md gives for the CPU, on a GPU.
#
# Needs: this project installed with MLX's CUDA build (`pip install "mlx[cuda]"` in place of
# `mlx[cpu]`, see README, Setup) on a Linux machine with an NVIDIA GPU. Run from the project
# root (about 8 minutes; each step runs under its own time limit, JSON and logs to $OUT):
#   OUT=out bash docs/device/host_work_cuda.sh
# BASE (default: the commit that added the profile's host figures, found by its subject,
# before the host-work changes) comes from the checkout's own .git into a temporary folder, renamed
# edge0_eval_base so that both run side by side in one process for the A/B.
#
# Steps (EDGE0_STEPS picks some):
#   synth   the 8-layer 35B shape (random weights) and untrained heads, owners 0..6, K = 4
#   solo    bench compute-only,reactive,prerouted, cold, 3 rounds (round 0 compiles kernels):
#           prerouted step / bound and the profile; BASE the same with 2 rounds
#   batch   bench prerouted at B = 1, 8, cold, 2 rounds, this checkout and BASE
#   ab      host ms per step, BASE and this checkout in one process, generate calls
#           alternated after a warm-up, cold, B = 1 and B = 8 (medians)
#   solo1   a solo generate and a batch of one, alternated on one engine: aggregate tok/s
# On the CPU (no GPU check, no synth; the model and heads given), e.g. the A/B alone:
#   EDGE0_DRY=1 EDGE0_STEPS=ab EDGE0_AB="1:8:6 8:4:2" EDGE0_CACHE=warm \
#       EDGE0_MODEL=S35_8 EDGE0_HEADS=S35_8/prerouter_k4.safetensors OUT=out \
#       bash docs/device/host_work_cuda.sh
set -uo pipefail
WORK=$(mktemp -d)  # the base tree and, unless given, the model and $OUT
BASEDIR=$WORK/base
OUT=${OUT:-$WORK/out}
BASE=${EDGE0_BASE:-$(git log --format=%h -1 --grep='^Profile: host ms per decode step')}
DRY=${EDGE0_DRY:-0}
MODEL=${EDGE0_MODEL:-$WORK/s35-8}
HEADS=${EDGE0_HEADS:-$MODEL/prerouter.safetensors}
TOKENS=${EDGE0_TOKENS:-32}
ROUNDS=${EDGE0_ROUNDS:-3}
STEPS=" ${EDGE0_STEPS:-synth solo batch ab solo1 base} "
AB=${EDGE0_AB:-1:16:4 8:8:2}  # B:tokens:rounds of each A/B
CACHE=${EDGE0_CACHE:-cold}  # the A/B's and solo1's page cache: cold evicts before each run
step() { [[ $STEPS == *" $1 "* ]]; }
mkdir -p "$OUT"
LOG="$OUT/log.txt"
START=$(date +%s)
say() { echo "[t+$(($(date +%s) - START))s] $*" | tee -a "$LOG"; }

PY=${PY:-python3}
if [ "$DRY" != 1 ]; then
    "$PY" -c "import mlx.core as mx; assert mx.cuda.is_available()" 2>>"$LOG" ||
        { say "MLX's CUDA backend is not available: install mlx[cuda] (README, Setup)"; exit 3; }
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$LOG"
fi
export PYTHONPATH=$PWD:$BASEDIR${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1

[ -n "$BASE" ] || { say "no base commit found (EDGE0_BASE)"; exit 4; }
say "base $BASE into $BASEDIR as edge0_eval_base"
mkdir -p "$BASEDIR"
git archive "$BASE" edge0_eval | tar -x -C "$BASEDIR" || exit 4
mv "$BASEDIR/edge0_eval" "$BASEDIR/edge0_eval_base"
grep -rl edge0_eval "$BASEDIR/edge0_eval_base" | xargs sed -i 's/\bedge0_eval\b/edge0_eval_base/g'

if step synth && [ "$DRY" != 1 ]; then
    say "synth"
    timeout 90 "$PY" -m edge0_eval make-synthetic "$MODEL" --shape 35b --layers 8 \
        >"$OUT/synth.log" 2>&1 || { tail "$OUT/synth.log"; exit 5; }
    timeout 45 "$PY" -m edge0_eval init-prerouter "$MODEL" --start-layer 1 --experts-per-token 4 \
        --out "$HEADS" >>"$OUT/synth.log" 2>&1 || { tail "$OUT/synth.log"; exit 6; }
fi
ARGS=(--experts-per-token 4 --slots-per-layer 8 --prompt-tokens 8 --prerouter "$HEADS" --profile)

if step solo; then
    say "solo, this checkout"
    timeout 120 "$PY" -m edge0_eval bench "$MODEL" --arms compute-only,reactive,prerouted \
        --repeats "$ROUNDS" --cache cold --tokens "$TOKENS" --raw-reads 256 "${ARGS[@]}" \
        --json "$OUT/solo.json" 2>&1 | tail -14 | tee -a "$LOG"
fi
if step batch; then
    say "batch, this checkout"
    timeout 90 "$PY" -m edge0_eval bench "$MODEL" --arms prerouted --batch 1,8 \
        --repeats 2 --cache cold --tokens 16 --raw-reads 256 "${ARGS[@]}" \
        --json "$OUT/batch.json" 2>&1 | tail -8 | tee -a "$LOG"
fi

ab() {  # B TOKENS ROUNDS: BASE and this checkout in one process, alternated
    timeout "${EDGE0_AB_LIMIT:-100}" "$PY" - "$MODEL" "$HEADS" "$CACHE" "$@" <<'EOF'
import importlib, json, os, sys
import numpy as np
model, heads, cache = sys.argv[1:4]
B, N, R = map(int, sys.argv[4:7])
engines = {}
for tag, pkg in (("base", "edge0_eval_base"), ("new", "edge0_eval")):
    eng = importlib.import_module(pkg + ".engine.engine")
    engines[tag] = eng.Engine.load(model, eng.EngineOptions(
        mode="prerouted", experts_per_token=4, slots_per_layer=8, prerouter_path=heads))
prompts = [[10 + 7 * r + i for i in range(8)] for r in range(B)]
for e in engines.values():  # warm-up: first-use kernels compiled, nothing measured
    e.generate_batch(prompts, max_tokens=4, stop_token_ids=set())
rows = []
for r in range(R):
    for tag in ("base", "new") if r % 2 == 0 else ("new", "base"):
        e = engines[tag]
        if cache == "cold":
            e.store.evict_page_cache()
        s = e.generate_batch(prompts, max_tokens=N + 1, stop_token_ids=set())[0].stats
        rows.append(dict(tag=tag, round=r, B=B, cache=cache, tok_s=s["batch_decode_tok_s"],
                         blocked_ms=s["blocked_load_ms_per_step"],
                         load=os.getloadavg()[0], **s["profile_ms_per_step"]))
        print(json.dumps(rows[-1]), flush=True)
for tag in engines:
    mine = [x for x in rows if x["tag"] == tag]
    med = {k: round(float(np.median([x[k] for x in mine])), 3)
           for k in ("host_ms", "host_cpu_ms", "build_ms", "eval_ms", "tok_s")}
    print(json.dumps({"tag": tag, "B": B, "rounds": len(mine), "median": med}), flush=True)
EOF
}
for spec in $AB; do
    step ab || break
    IFS=: read -r b n r <<<"$spec"
    say "ab B=$b, $n tokens, $r rounds, $CACHE"
    ab "$b" "$n" "$r" >"$OUT/ab_b$b.jsonl" 2>&1
    tail -2 "$OUT/ab_b$b.jsonl" | tee -a "$LOG"
done

step solo1 && say "solo vs a batch of one, $CACHE" && timeout "${EDGE0_SOLO1_LIMIT:-50}" \
    "$PY" - "$MODEL" "$HEADS" "$CACHE" >"$OUT/solo1.jsonl" 2>&1 <<'EOF'
import json, sys
import numpy as np
from edge0_eval import Engine, EngineOptions
model, heads, cache = sys.argv[1:4]
e = Engine.load(model, EngineOptions(mode="prerouted", experts_per_token=4, slots_per_layer=8,
                                     prerouter_path=heads))
p = [10 + i for i in range(8)]
e.generate(p, max_tokens=4, stop_token_ids=set())  # warm-up
rates = {"solo": [], "batch_of_one": []}
for r in range(6):
    for tag in ("solo", "batch_of_one") if r % 2 == 0 else ("batch_of_one", "solo"):
        if cache == "cold":
            e.store.evict_page_cache()
        if tag == "solo":
            s = e.generate(p, max_tokens=17, stop_token_ids=set()).stats
        else:
            s = e.generate_batch([p], 17, batch_size=1, stop_token_ids=set())[0].stats
        rates[tag].append(s["batch_decode_tok_s"])
        print(json.dumps({"tag": tag, "round": r, "tok_s": s["batch_decode_tok_s"]}), flush=True)
a, b = (float(np.median(rates[k])) for k in ("solo", "batch_of_one"))
print(json.dumps({"solo": a, "batch_of_one": b, "ratio": round(b / a, 3)}), flush=True)
EOF
step solo1 && tail -1 "$OUT/solo1.jsonl" | tee -a "$LOG"

if step base; then
    say "solo, base"
    timeout 90 "$PY" -m edge0_eval_base bench "$MODEL" \
        --arms compute-only,reactive,prerouted --repeats 2 --cache cold \
        --tokens "$TOKENS" --raw-reads 256 "${ARGS[@]}" --json "$OUT/solo_base.json" 2>&1 |
        tail -12 | tee -a "$LOG"
fi
say "done"
