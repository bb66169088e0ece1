#!/usr/bin/env bash
# More warm restarts on the caches that a bench/gpu_run.sh call left on the same host (same
# WORK, same VER), in ONE device call, from the repository root:
#
#   MODELS="qwen3-next-80b-a3b-4l deepseek-v32-2l" VARIANTS="on on-cuda_graphs off" \
#     SCENARIO=pairs VER=0.24.0 bash bench/restarts.sh
#
# A variant is one engine start on a pipeline's caches:
#   off            the kwarm-off pipeline's caches, kwarm off
#   on             the kwarm-on pipeline's caches and the manifest its cold run learned, every family
#   on-<family>    the same without one family (KWARM_WARMUPS=-<family>)
# One model's variants run one after another (ROUNDS times over); models run side by side and
# measure their requests one at a time (--sync-lock). Results, logs and kwarm reports go to
# $OUT/restarts.tgz (tag <model>-vllm<VER>-<variant>-r<round>); the table is printed.
#
# Environment (defaults): VER=0.24.0, STAGED=/tmp/kwarm-gpu, WORK=/tmp/kwarm-bench, MODELS (the
# two tiny models), VARIANTS="on off", ROUNDS=1, SCENARIO=pairs, GPU_UTIL=0.2, KV_BYTES=4G,
# CUDA_PROFILE="" (e.g. "0,1": those requests under torch.profiler, engine_bench --cuda-profile)
# for the variants matching CUDA_PROFILE_RUNS="*", PROFILE="" (e.g. "0,1": those requests under
# cProfile, engine_bench --profile; raw stats beside the results) for the same variants, BUDGET=570 (seconds for the whole script),
# BENCH_ARGS="" (extra engine_bench.py arguments, e.g. "--max-num-batched-tokens 8192"), INSTALL=0 (1: install kwarm from this tree first, as gpu_run.sh does), PY=python3.
set -uo pipefail
shopt -s nullglob
cd "$(dirname "$0")/.." || exit 1

VER=${VER:-0.24.0}
STAGED=${STAGED:-/tmp/kwarm-gpu}
WORK=${WORK:-/tmp/kwarm-bench}
MODELS=${MODELS:-"tiny-qwen3-next tiny-deepseek-v32"}
VARIANTS=${VARIANTS:-"on off"}
ROUNDS=${ROUNDS:-1}
SCENARIO=${SCENARIO:-pairs}
GPU_UTIL=${GPU_UTIL:-0.2}
KV_BYTES=${KV_BYTES:-4G}
CUDA_PROFILE=${CUDA_PROFILE:-}
CUDA_PROFILE_RUNS=${CUDA_PROFILE_RUNS:-*}
PROFILE=${PROFILE:-}
BENCH_ARGS=${BENCH_ARGS:-}
BUDGET=${BUDGET:-570}
INSTALL=${INSTALL:-0}
PY=${PY:-python3}
FINAL_OUT=${OUT:-bench/results}
RUN_OUT=$WORK/restarts
DEADLINE=$(( $(date +%s) + BUDGET ))
unset KWARM_ENABLE KWARM_REPORT KWARM_WARMUPS KWARM_MANIFEST

if [ ! -f "$STAGED/vllm-$VER/env.sh" ]; then
  echo "no staged vLLM $VER on this host ($STAGED/vllm-$VER/env.sh): stage it first (bench/README.md)"; exit 1
fi
# shellcheck disable=SC1090
source "$STAGED/vllm-$VER/env.sh"
if [ "$INSTALL" = 1 ]; then
  "$PY" -m pip install --no-deps --no-index --no-build-isolation --force-reinstall . >/dev/null 2>&1 \
    || "$PY" -m pip install --no-deps --no-index --no-build-isolation --force-reinstall --break-system-packages . \
    >/dev/null 2>&1 || { echo "kwarm: install FAILED"; exit 1; }
fi
rm -rf "$RUN_OUT" && mkdir -p "$RUN_OUT" "$FINAL_OUT"
FINAL_OUT=$(cd "$FINAL_OUT" && pwd)
trap 'tar czf "$FINAL_OUT/restarts.tgz" -C "$RUN_OUT" .' EXIT

restart() {  # restart MODEL VARIANT ROUND
  local model=$1 variant=$2 round=$3 mode=on envs=() extra=()
  local tag=$model-vllm$VER-$variant-r$round
  case $variant in
    off) mode=off ;;
    on) ;;
    on-*) envs+=("KWARM_WARMUPS=-${variant#on-}") ;;
    *) echo "$tag: unknown variant $variant (off | on | on-<family>)"; return 1 ;;
  esac
  local cache=$WORK/$model-vllm$VER-kwarm$mode manifest=$WORK/out/$model-vllm$VER.manifest.json
  if [ ! -d "$cache/triton" ]; then echo "$tag: no caches at $cache (run bench/gpu_run.sh first)"; return 1; fi
  if [ "$mode" = on ]; then
    envs+=("KWARM_REPORT=$RUN_OUT/$tag.kwarm-report.json")
    [ -f "$manifest" ] && envs+=("KWARM_MANIFEST=$manifest")
  fi
  case $model in *qwen3-next*|*qwen3-5*) extra+=(--attention-backend TRITON_ATTN) ;; esac
  # shellcheck disable=SC2206  # words on purpose
  [ -n "$BENCH_ARGS" ] && extra+=($BENCH_ARGS)
  # shellcheck disable=SC2053  # a pattern
  [ -n "$CUDA_PROFILE" ] && [[ $variant == $CUDA_PROFILE_RUNS ]] && extra+=(--cuda-profile "$CUDA_PROFILE")
  # shellcheck disable=SC2053  # a pattern
  [ -n "$PROFILE" ] && [[ $variant == $CUDA_PROFILE_RUNS ]] && extra+=(--profile "$PROFILE")
  local left=$(( DEADLINE - $(date +%s) - 15 ))
  if [ "$left" -lt 60 ]; then echo "$tag: skipped (${left}s left)"; return 99; fi
  local t0=$(date +%s) rc
  env "VLLM_CACHE_ROOT=$cache/vllm" "TORCHINDUCTOR_CACHE_DIR=$cache/inductor" "${envs[@]}" \
    timeout -k 15 "$left" "$PY" bench/engine_bench.py "bench/models/$model" --kwarm "$mode" \
    --scenario "$SCENARIO" --gpu-memory-utilization "$GPU_UTIL" --kv-cache-memory-bytes "$KV_BYTES" \
    --variant "$variant-r$round" --sync-lock "$WORK/engines.lock" --triton-cache "$cache/triton" \
    "${extra[@]}" --out "$RUN_OUT/$tag.json" >"$RUN_OUT/$tag.log" 2>&1
  rc=$?
  echo "$tag: rc=$rc in $(( $(date +%s) - t0 )) s"
  [ "$rc" -eq 0 ] || grep -v "^INFO\|^(EngineCore" "$RUN_OUT/$tag.log" | tail -15
}

echo "== restarts: models [$MODELS] x variants [$VARIANTS] x $ROUNDS rounds, scenario $SCENARIO"
for model in $MODELS; do
  (
    for round in $(seq 1 "$ROUNDS"); do
      for variant in $VARIANTS; do restart "$model" "$variant" "$round"; done
    done
  ) &
  sleep 2
done
wait
results=("$RUN_OUT"/*.json)
results=("${results[@]/*kwarm-report.json/}")
[ ${#results[@]} -gt 0 ] && "$PY" bench/table.py --start-cost ${results[@]}
for log in "$RUN_OUT"/*.log; do grep -B1 "cuda profile" "$log" | sed "s|^|${log##*/}: |"; done
"$PY" - "${results[@]}" <<'PY'
import json, sys
for path in sys.argv[1:]:
    if not path:
        continue
    r = json.load(open(path))
    pairs = " ".join(f"{p['excess_s'] * 1000:6.1f}" for p in r.get("excess_pairs") or [])
    print(f"{r['model'][:22]:22} {r.get('variant') or '':18} init {r.get('init_s') or 0:6.1f} s  kwarm "
          f"{r.get('kwarm_warmup_s') or 0:5.2f} s  JIT {r.get('total_jit')}  first/steady "
          f"{r.get('first_steady_ratio') or 0:5.2f}  excess {1000 * (r.get('excess_s') or 0):6.1f} ms: {pairs}")
PY
