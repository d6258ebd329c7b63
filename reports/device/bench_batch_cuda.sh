#!/usr/bin/env bash
# Batched decode and the prefill A/B on a CUDA device (issue #17), for the `device` tool.
#
# Prepare here first: `bash reports/device/fetch_wheels.sh` (wheels into the git-ignored
# .whl/). Then two device calls back to back (the machine stays warm ~30 s between them; a call
# carries at most 64 MiB, the CUDA wheel alone is ~90 MB):
#   run(command="bash reports/device/bench_batch_cuda.sh stash", carry=[".whl/part1"], timeout_s=120)
#   run(command="bash reports/device/bench_batch_cuda.sh run",   carry=[".whl/part2"], timeout_s=560)
# If the second call lands on a fresh machine the parts do not join: it says so and stops.
#
# `run` installs mlx + mlx-cuda-13 + mlx-lm into /tmp/site, builds the 35B shape with 8 layers
# (random weights, 3.62 GB experts) and untrained prerouter heads, then runs, each step under
# its own time limit so one hang cannot take the rest (about 8 minutes in all):
#   (P) prefill A/B, warm, one process, arms interleaved: mlx-lm vs the engine, resident
#   (R) --batch 1,4,8, resident / reactive / prerouted, real reads (cold where fadvise evicts)
#   (E) --batch 1,4,8, reactive / prerouted, storage EMULATED at the balanced point of B = 1
# Every JSON and the log land in $OUT. Dry check on a CPU machine with tiny sizes:
#   EDGE0_DRY=1 EDGE0_MODEL=/path/to/converted-tiny bash reports/device/bench_batch_cuda.sh run
set -uo pipefail
MODE=${1:-run}
OUT=${OUT:-/tmp/edge0-device-out}
STASH=/tmp/edge0-wheels
MODEL=${EDGE0_MODEL:-/tmp/edge0-s35-8}
DRY=${EDGE0_DRY:-0}
TOKENS=${EDGE0_TOKENS:-32}
PROMPT=${EDGE0_PROMPT_TOKENS:-64}
PREFILL_PROMPT=${EDGE0_PREFILL_PROMPT_TOKENS:-512}
K=${EDGE0_TOP_K:-4}
mkdir -p "$OUT"
LOG="$OUT/log.txt"

say() { echo "[$(date -u +%H:%M:%S)] $*" | tee -a "$LOG"; }

if [ "$MODE" = stash ]; then
    mkdir -p "$STASH" && cp .whl/part1/* "$STASH"/ && ls -la "$STASH" | tee -a "$LOG"
    exit 0
fi
[ "$MODE" = run ] || { echo "usage: $0 stash|run" >&2; exit 2; }

if [ "$DRY" = 1 ]; then
    PY=${PY:-python3}
    say "dry run: no install, model $MODEL, python $PY"
else
    PY=python3
    if ! ls "$STASH"/*.part00 >/dev/null 2>&1; then
        say "no stashed part 1 in $STASH: this is a fresh machine; run the stash call again, then this one at once"
        exit 3
    fi
    cp .whl/part2/*.part* "$STASH"/
    wheel=$(ls "$STASH"/*.part00); wheel=${wheel%.part00}
    cat "$STASH"/$(basename "$wheel").part* > "$wheel"
    (cd "$STASH" && sha256sum -c "$OLDPWD/.whl/part2/SHA256") | tee -a "$LOG" || exit 4
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site "$wheel" .whl/part2/*.whl 2>&1 | tail -5 | tee -a "$LOG"
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
E0() { "$PY" -m edge0_eval "$@"; }

"$PY" - <<'EOF' 2>&1 | tee -a "$LOG"
import mlx.core as mx, mlx_lm
print("mlx", mx.__version__, "mlx-lm", mlx_lm.__version__, "device", mx.default_device(),
      "info", mx.device_info())
a = mx.random.normal((256, 256)); print("matmul ok:", float((a @ a).sum()) == float((a @ a).sum()))
w = mx.random.normal((512, 2048)); q = mx.quantize(w, group_size=64, bits=4)
x = mx.random.normal((8, 2048))
print("int4 quantized_matmul ok:", mx.quantized_matmul(x, *q, transpose=True, group_size=64, bits=4).shape)
EOF

step() {   # step NAME LIMIT_S ARGS...: one bench under its own limit; its JSON into $OUT
    local name=$1 limit=$2; shift 2
    say "step $name: edge0-eval $*"
    timeout "$limit" "$PY" -m edge0_eval "$@" --json "$OUT/$name.json" 2>&1 | tee -a "$LOG"
    say "step $name: exit ${PIPESTATUS[0]}"
}

if [ ! -f "$MODEL/experts.index.json" ]; then
    say "building the 35B shape, 8 layers, into $MODEL"
    timeout 150 "$PY" -m edge0_eval make-synthetic "$MODEL" --shape 35b --layers 8 2>&1 \
        | tail -2 | tee -a "$LOG"
fi
if [ ! -f "$MODEL/prerouter.safetensors" ]; then
    START=1
    timeout 90 "$PY" -m edge0_eval init-prerouter "$MODEL" --start-layer "$START" --top-k "$K" \
        --width "${EDGE0_HEAD_WIDTH:-512}" --out "$MODEL/prerouter.safetensors" 2>&1 \
        | tail -2 | tee -a "$LOG"
fi

step prefill_ab 120 bench "$MODEL" --arms mlx-lm,resident --repeats 3 --cache warm \
    --top-k "$K" --tokens 8 --prompt-tokens "$PREFILL_PROMPT" --raw-reads 0
step batch_real 150 bench "$MODEL" --arms resident,reactive,prerouted --batch 1,4,8 \
    --repeats 2 --cache cold --top-k "$K" --tokens "$TOKENS" --prompt-tokens "$PROMPT" \
    --raw-reads 256 --profile
step batch_emulated 150 bench "$MODEL" --arms reactive,prerouted --batch 1,4,8 \
    --repeats 1 --cache cold --top-k "$K" --tokens "$TOKENS" --prompt-tokens "$PROMPT" \
    --raw-reads 0 --emulate-balanced
say "done"
