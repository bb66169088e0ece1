#!/usr/bin/env bash
# The engine benchmark on the GPU host, in ONE device call (10-minute limit), from the
# repository root of the working-tree copy:
#
#   VER=0.24.0 bash bench/gpu_run.sh
#
# 1. installs kwarm from this tree for the host's python3 (site-packages; else --target
#    + PYTHONPATH, where the .pth door does not fire and the plugin / the bench's own
#    kwarm_ext.activate("bench") cover it);
# 2. runs one pipeline per (model, kwarm mode), all in parallel on the one GPU: a cold
#    run (its own empty TRITON_CACHE_DIR, VLLM_CACHE_ROOT and TORCHINDUCTOR_CACHE_DIR),
#    then a warm run that starts again on the same caches;
# 3. writes everything to $OUT (results *.json, kwarm reports *.kwarm-report.json, one
#    log per run *.log, status.txt, install.log, table.md) and prints the table.
#
# Environment (defaults):
#   VER=0.24.0            staged vLLM release: source /tmp/kwarm-gpu/vllm-$VER/env.sh
#   MODELS="tiny-qwen3-next tiny-deepseek-v32"   folders under bench/models/
#   MODES="off on"        kwarm modes
#   WARM=1                0: cold runs only
#   SCENARIO=default      default | smoke
#   BUDGET=570            seconds for the whole script; each run's timeout is cut to fit
#   COLD_TIMEOUT=360      cap of one cold run (s)
#   GPU_UTIL=0.2          --gpu-memory-utilization of each engine
#   KV_BYTES=4G           fixed KV cache per engine: skips vLLM's memory profiling, which
#                         assumes no other process allocates on the GPU meanwhile
#   BENCH_ARGS=""         extra engine_bench.py arguments for every run
#   OUT                   set by the device tool; else bench/results
#   WORK=/tmp/kwarm-bench caches (not returned)
#   PY=python3
set -uo pipefail
shopt -s nullglob
cd "$(dirname "$0")/.."

VER=${VER:-0.24.0}
MODELS=${MODELS:-"tiny-qwen3-next tiny-deepseek-v32"}
MODES=${MODES:-"off on"}
WARM=${WARM:-1}
SCENARIO=${SCENARIO:-default}
BUDGET=${BUDGET:-570}
COLD_TIMEOUT=${COLD_TIMEOUT:-360}
GPU_UTIL=${GPU_UTIL:-0.2}
KV_BYTES=${KV_BYTES:-4G}
BENCH_ARGS=${BENCH_ARGS:-}
# The device tool returns at most 8 files from $OUT: everything is written to $RUN_OUT and
# packed into $OUT/bench-results.tgz at the end (table.md is also copied beside it).
FINAL_OUT=${OUT:-bench/results}
WORK=${WORK:-/tmp/kwarm-bench}
OUT=$WORK/out
PY=${PY:-python3}
DEADLINE=$(( $(date +%s) + BUDGET ))

rm -rf "$OUT"
mkdir -p "$OUT" "$WORK" "$FINAL_OUT"
FINAL_OUT=$(cd "$FINAL_OUT" && pwd)
pack() { tar czf "$FINAL_OUT/bench-results.tgz" -C "$OUT" . && cp -f "$OUT/table.md" "$FINAL_OUT/" 2>/dev/null; true; }
trap pack EXIT
rm -f "$OUT/status.txt" "$OUT/failed.txt"
# kwarm must be off at interpreter start: engine_bench.py sets KWARM_* itself per run.
unset KWARM_ENABLE KWARM_REPORT KWARM_WARMUPS

if [ ! -f "/tmp/kwarm-gpu/vllm-$VER/env.sh" ]; then
  echo "no staged vLLM $VER on this host (/tmp/kwarm-gpu/vllm-$VER/env.sh): see shared/gpu-kit/README.md"
  exit 1
fi
# shellcheck disable=SC1090
source "/tmp/kwarm-gpu/vllm-$VER/env.sh"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"

# ------------------------------------------------------------------ install kwarm
install_kwarm() {
  local log=$OUT/install.log pipargs=(--no-deps --no-index --no-build-isolation --force-reinstall)
  if "$PY" -m pip install "${pipargs[@]}" . >"$log" 2>&1; then
    echo "kwarm: installed into site-packages"; return 0
  fi
  if "$PY" -m pip install "${pipargs[@]}" --break-system-packages . >>"$log" 2>&1; then
    echo "kwarm: installed into site-packages (--break-system-packages)"; return 0
  fi
  rm -rf "$WORK/kwarm-site"
  if "$PY" -m pip install "${pipargs[@]}" --target "$WORK/kwarm-site" . >>"$log" 2>&1; then
    export PYTHONPATH="$WORK/kwarm-site${PYTHONPATH:+:$PYTHONPATH}"
    echo "kwarm: installed with --target $WORK/kwarm-site (no .pth door; plugin + bench activate)"; return 0
  fi
  echo "kwarm: install FAILED"; tail -20 "$log"; return 1
}
install_kwarm || exit 1
# From /tmp, so that the installed copy is imported, not this tree's.
(cd /tmp && "$PY" -c "
import importlib.metadata as md, kwarm_ext
print('kwarm', kwarm_ext.__version__, kwarm_ext.__file__)
print('vllm.general_plugins:', sorted(e.name for e in md.entry_points(group='vllm.general_plugins')))
") 2>&1 | tee -a "$OUT/install.log"

# ---------------------------------------------------------------------- the runs
model_args() {
  case $1 in
    *qwen3-next*|*qwen3-5*) echo "--attention-backend TRITON_ATTN" ;;  # no flash-attn binaries staged
    *) echo "" ;;                                                       # MLA: FLASHMLA_SPARSE
  esac
}

pipeline() {
  local model=$1 mode=$2
  local tag=$model-vllm$VER-kwarm$mode cache=$WORK/$model-vllm$VER-kwarm$mode
  rm -rf "$cache" && mkdir -p "$cache"
  # shellcheck disable=SC2046,SC2086
  local args=("bench/models/$model" --kwarm "$mode" --scenario "$SCENARIO"
              --gpu-memory-utilization "$GPU_UTIL" --kv-cache-memory-bytes "$KV_BYTES"
              $(model_args "$model") $BENCH_ARGS --triton-cache "$cache/triton")
  local phase rc=0
  for phase in cold warm; do
    if [ "$phase" = warm ] && { [ "$WARM" != 1 ] || [ "$rc" -ne 0 ]; }; then
      break
    fi
    local left=$(( DEADLINE - $(date +%s) - 20 )) limit
    limit=$left
    if [ "$phase" = cold ] && [ "$COLD_TIMEOUT" -lt "$limit" ]; then limit=$COLD_TIMEOUT; fi
    if [ "$limit" -lt 60 ]; then
      echo "$tag-$phase: skipped (${left}s left)" | tee -a "$OUT/status.txt"; break
    fi
    local envs=("VLLM_CACHE_ROOT=$cache/vllm" "TORCHINDUCTOR_CACHE_DIR=$cache/inductor")
    [ "$mode" = on ] && envs+=("KWARM_REPORT=$OUT/$tag-$phase.kwarm-report.json")
    local t0
    t0=$(date +%s)
    env "${envs[@]}" timeout -k 15 "$limit" "$PY" bench/engine_bench.py "${args[@]}" \
      --out "$OUT/$tag-$phase.json" >"$OUT/$tag-$phase.log" 2>&1
    rc=$?
    echo "$tag-$phase: rc=$rc in $(( $(date +%s) - t0 )) s$( [ $rc -eq 124 ] || [ $rc -eq 137 ] && echo " (timeout ${limit}s)")" \
      | tee -a "$OUT/status.txt"
    [ "$rc" -eq 0 ] || echo "$tag-$phase" >>"$OUT/failed.txt"
  done
}

echo "== runs: models [$MODELS] x kwarm [$MODES], scenario $SCENARIO, warm=$WARM, budget ${BUDGET}s"
for model in $MODELS; do
  for mode in $MODES; do
    pipeline "$model" "$mode" &
    sleep 2  # stagger the imports a little
  done
done
wait

# ------------------------------------------------------------------------ report
# A failed or timed-out run keeps the JSON it wrote after init and after each request
# ("complete": false, shown as "cut short" in the table).
if [ -f "$OUT/failed.txt" ]; then
  while read -r run; do
    echo "== $run failed; last lines of $run.log:"
    grep -v "^INFO\|^(EngineCore" "$OUT/$run.log" | tail -25
  done <"$OUT/failed.txt"
fi
results=("$OUT"/*-cold.json "$OUT"/*-warm.json)
if [ ${#results[@]} -eq 0 ]; then
  echo "no results"; exit 1
fi
"$PY" bench/table.py "${results[@]}" >"$OUT/table.md"
echo
"$PY" bench/table.py --no-keys "${results[@]}"
echo "(full table with Triton keys: \$OUT/table.md)"
