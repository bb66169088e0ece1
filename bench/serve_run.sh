#!/usr/bin/env bash
# The serving benchmark on the GPU host, in ONE device call (10-minute limit), from the
# repository root of the working-tree copy:
#
#   VER=0.33.0-flashinfer MODELS="tiny-qwen3-next tiny-deepseek-v32" bash bench/serve_run.sh
#
# Installs kwarm from this tree, then runs bench/serve_bench.py for every model side by side
# (each: `vllm serve` and `kwarm run -- vllm serve` on their own empty caches, a cold start and a
# warm restart when the budget allows; every model's servers start together, requests are measured
# one model at a time through a shared lock), and writes to $OUT: serve-results.tgz (result JSON,
# server logs, probe events, install.log), table.md and the result JSON of each model.
#
# Environment (defaults):
#   VER=0.33.0-flashinfer  staged release: source $STAGED/vllm-$VER/env.sh
#   STAGED=/tmp/kwarm-gpu
#   MODELS="tiny-qwen3-next tiny-deepseek-v32"   folders under bench/models/
#   MODEL_ARGS_<name>=""   extra serve_bench.py arguments of one model (<name>: the folder with every
#                          character but A-Z a-z 0-9 _ turned into _), e.g.
#                          MODEL_ARGS_deepseek_v32_2l="--gpu-util 0.3 --kv-bytes 8G"
#   BENCH_ARGS=""          extra serve_bench.py arguments of every model (e.g. "--restarts 0")
#   VARIANTS=""            "name=ARGS|name=ARGS|...": instead of the models side by side, the first of
#                          MODELS once per variant, side by side, each with its own serve_bench.py ARGS
#                          and results under $OUT/<name>/ (an A/B of kwarm's parts), e.g.
#                          VARIANTS="kwarm=--servers kwarm|no-eager-gemm=--servers kwarm --kwarm-env KWARM_WARMUPS=-eager_gemm"
#                          Requests wait for every variant's start (--sync-lock): a variant that starts
#                          slowly (plain `vllm serve` builds FlashInfer's sampler after its profile run)
#                          holds back the others' requests; four kwarm variants of tiny Qwen3-Next, each
#                          building FlashInfer's sampler at once, were ready in 235-242 s (H100). With
#                          "--share-flashinfer-cache $WORK/fi" in BENCH_ARGS the sampler builds once for all.
#                          Six servers on one host spread a kind's repeats more widely than the gaps between
#                          variants: for a steady-state comparison, run two servers (plain and kwarm) and
#                          SERVE_PROBE_STATS, then bench/step_times.py
#   SEQUENTIAL=0           1: one model after another, each with the budget left (two servers on the GPU
#                          at a time: published dimensions, where four servers do not fit or start slowly)
#   SERVE_PROBE_STATS=""   e.g. 5: every server process writes its thread CPU, garbage collections and engine
#                          step times every 5 s (bench/serve_probe/; SERVE_PROBE_PROFILE likewise passes through)
#   BUDGET=560             seconds for the whole script
#   WORK=/tmp/kwarm-serve  caches and model copies (not returned)
set -uo pipefail
shopt -s nullglob
cd "$(dirname "$0")/.." || exit 1
VER=${VER:-0.33.0-flashinfer}
STAGED=${STAGED:-/tmp/kwarm-gpu}
MODELS=${MODELS:-"tiny-qwen3-next tiny-deepseek-v32"}
BENCH_ARGS=${BENCH_ARGS:-}
BUDGET=${BUDGET:-560}
SEQUENTIAL=${SEQUENTIAL:-0}
WORK=${WORK:-/tmp/kwarm-serve}
FINAL_OUT=${OUT:-bench/results/serve}
OUT=$WORK/out
PY=${PY:-python3}
START=$(date +%s)
rm -rf "$WORK" && mkdir -p "$OUT" "$FINAL_OUT"
FINAL_OUT=$(cd "$FINAL_OUT" && pwd)
pack() {
  tar czf "$FINAL_OUT/serve-results.tgz" -C "$OUT" . 2>/dev/null
  cp -f "$OUT"/table.md "$OUT"/*.serve.json "$FINAL_OUT/" 2>/dev/null
  for d in "$OUT"/*/; do  # VARIANTS' results
    set -- "$d"*.serve.json
    [ $# -gt 0 ] && mkdir -p "$FINAL_OUT/$(basename "$d")" && cp -f "$@" "$FINAL_OUT/$(basename "$d")/"
  done; true
}
trap pack EXIT
unset KWARM_ENABLE KWARM_REPORT KWARM_WARMUPS KWARM_MANIFEST KWARM_LEARN

if [ ! -f "$STAGED/vllm-$VER/env.sh" ]; then
  echo "no staged vLLM $VER on this host ($STAGED/vllm-$VER/env.sh): stage it first (bench/README.md)"
  exit 1
fi
# shellcheck disable=SC1090
source "$STAGED/vllm-$VER/env.sh"
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}   # FlashInfer's JIT builds with the host's nvcc
nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
{ echo "CUDA_HOME=$CUDA_HOME"; command -v nvcc ninja; nvcc --version 2>/dev/null | tail -1; } | tee -a "$OUT/gpu.txt"
# shellcheck source=bench/install_kwarm.sh
source bench/install_kwarm.sh
install_kwarm || exit 1

i=0
pids=()
# bench LOG MODEL OUT WORK ARGS...: one serve_bench.py in the background on the next port pair, with
# the budget left and the shared request lock
bench() {
  local log=$1 m=$2 out=$3 work=$4 left
  shift 4
  left=$(( BUDGET - ($(date +%s) - START) - 25 ))
  (cd /tmp && PYTHONUNBUFFERED=1 "$PY" "$OLDPWD/bench/serve_bench.py" "$OLDPWD/bench/models/$m" --out "$out" \
     --work "$work" --port $((8100 + 10 * i)) --sync-lock "$WORK/requests.lock" --budget "$left" "$@") >"$log" 2>&1 &
  pids+=($!)
  i=$((i + 1))
}
if [ -n "${VARIANTS:-}" ]; then
  m=${MODELS%% *}
  IFS='|' read -ra variants <<< "$VARIANTS"
  for v in "${variants[@]}"; do
    name=${v%%=*}; vargs=${v#*=}
    mkdir -p "$OUT/$name"
    set -f  # words only: KWARM_WARMUPS=-* is a value, not a pattern (nullglob would drop it)
    # shellcheck disable=SC2086
    bench "$OUT/$name.bench.log" "$m" "$OUT/$name" "$WORK/runs-$name" $BENCH_ARGS $vargs
    set +f
  done
  for p in "${pids[@]}"; do wait "$p"; done
  for v in "${variants[@]}"; do
    name=${v%%=*}
    echo "== $name"; grep -E "ready in|NOT READY|Traceback|Error" "$OUT/$name.bench.log" | head -10
    (cd /tmp && "$PY" "$OLDPWD/bench/serve_bench.py" --table "$OUT/$name"/*.serve.json) >"$OUT/$name/table.md" 2>&1
    { echo "## variant $name: ${v#*=}"; cat "$OUT/$name/table.md"; } >>"$OUT/table.md"
  done
  cat "$OUT/table.md"
  echo "serve_run: $(( $(date +%s) - START )) s"
  exit 0
fi
for m in $MODELS; do
  var="MODEL_ARGS_${m//[^A-Za-z0-9_]/_}"
  set -f
  # shellcheck disable=SC2086
  bench "$OUT/$m.bench.log" "$m" "$OUT" "$WORK/runs" $BENCH_ARGS ${!var:-}
  set +f
  if [ "$SEQUENTIAL" = 1 ]; then wait "$!"; fi
done
for p in "${pids[@]}"; do wait "$p"; done
for m in $MODELS; do echo "== $m"; grep -E "ready in|NOT READY|no .* restart|Traceback|Error" "$OUT/$m.bench.log" | head -20; done
(cd /tmp && "$PY" "$OLDPWD/bench/serve_bench.py" --table "$OUT"/*.serve.json) >"$OUT/table.md" 2>&1
cat "$OUT/table.md"
echo "serve_run: $(( $(date +%s) - START )) s"
