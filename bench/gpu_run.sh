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
#    then a warm run that starts again on the same caches; with SYNC=1 the engines take
#    turns on a lock (engine_bench.py --sync-lock): they may initialize together, but
#    each one measures its requests alone;
# 3. writes everything to $OUT (results *.json, kwarm reports *.kwarm-report.json, one
#    log per run *.log, manifests *.manifest.json, profiles *.req<i>.prof, status.txt,
#    install.log, table.md with the start-cost section, chart.svg), packs it into
#    bench-results.tgz and prints the table.
#
# Environment (defaults):
#   VER=0.24.0            staged vLLM release: source $STAGED/vllm-$VER/env.sh
#   STAGED=/tmp/kwarm-gpu where the staged releases are
#   MODELS="tiny-qwen3-next tiny-deepseek-v32"   folders under bench/models/ (also the
#                         published-dimension qwen3-next-80b-a3b-4l, deepseek-v32-2l,
#                         deepseek-v32-2l-fp8, glm5-2l-fp8: give them memory with MODEL_ARGS_<name>)
#   MODEL_ARGS_<name>=""  extra engine_bench.py arguments for one model's runs, after all
#                         others (so they win): <name> is the model folder with every
#                         character other than A-Z a-z 0-9 _ turned into _, e.g.
#                         MODEL_ARGS_deepseek_v32_2l="--gpu-memory-utilization 0.45 --kv-cache-memory-bytes 8G"
#   MODES="off on"        kwarm modes
#   WARM=1                0: cold runs only; "on": the kwarm-on pipelines' warm restarts only (vLLM
#                         alone's cold start can take most of a call)
#   LEARN=1               kwarm-on cold runs learn a manifest; a third run replays it
#                         on empty caches (0: no learning, no replay run; all: KWARM_LEARN=all,
#                         the manifest also holds what kwarm's own warmup compiled)
#   REPLAY_FROM=""        a folder of manifests learned earlier, <model>-vllm$VER.manifest.json
#                         (relative to the current folder or to the repository root): a
#                         kwarm-on pipeline whose model has one there does not learn; it is
#                         copied into $OUT and the replay run replays that copy (its cold run
#                         skips the replay family, like the warm run). Other models: as LEARN
#   REPLAY_ONLY=0         1 (with REPLAY_FROM): kwarm-on pipelines that have such a manifest
#                         run the replay run only (no cold run, hence no warm run); kwarm-off
#                         pipelines run as usual
#   REPLAY_RUN=1          0: no replay run on empty caches (the manifest is still learned)
#   WARM_MANIFEST=0       1: the kwarm-on warm run reads the manifest the cold run learned and
#                         runs every family, replay included (a warm restart of a deployment
#                         that learned); 0: families only (KWARM_WARMUPS=-replay, no manifest)
#   REPLAY_BENCH=1        also time the manifest's replay, 1 thread vs all cores (0: no; a
#                         pattern such as "*qwen*": those manifests only)
#   SCENARIO=default      default | smoke | pairs (every shape followed by its repeat;
#                         BENCH_ARGS="--repeats 3": by 3, for the excess's noise) |
#                         mla-splits (decodes crossing each TRITON_MLA NUM_KV_SPLITS step, with repeats)
#   BUDGET=570            seconds for the whole script; each run's timeout is cut to fit
#   COLD_TIMEOUT=360      cap of one cold run (s)
#   GPU_UTIL=0.2          --gpu-memory-utilization of each engine
#   KV_BYTES=4G           fixed KV cache per engine: skips vLLM's memory profiling, which
#                         assumes no other process allocates on the GPU meanwhile
#   SYNC=1                every run gets --sync-lock $WORK/engines.lock: engines initialize
#                         side by side, but measure their requests one at a time, never while
#                         another engine initializes (0: no lock, everything overlaps)
#   SYNC_RUNS="*"         which runs take the SYNC lock: space-separated patterns on the run's tag,
#                         e.g. "*kwarmoff-cold *-warm" (vLLM alone's cold start, and warm restarts
#                         whose requests then run alone, after every locked start; the other runs
#                         start and measure beside them unlocked)
#   PROFILE=""            e.g. "0,1": every run gets --profile $PROFILE (those requests under
#                         cProfile: top functions in the result JSON, raw *.req<i>.prof files;
#                         their wall time includes the profiler's overhead)
#   PROFILE_RUNS="*"      which runs PROFILE applies to: a pattern on the run's tag, e.g.
#                         "*-replay" (the other runs stay unprofiled)
#   BENCH_ARGS=""         extra engine_bench.py arguments for every run
#   ON_ARGS=""            extra engine_bench.py arguments of kwarm-on runs only (after BENCH_ARGS
#                         and MODEL_ARGS_<name>), e.g. "--deepgemm-sweep", which on a kwarm-off
#                         run would build every kernel in the measuring process
#   KWARM_ENV=""          extra environment of every kwarm-on run (cold, replay, warm):
#                         space-separated VAR=VALUE, e.g. "KWARM_BUDGET=auto"; what the script
#                         sets itself (KWARM_REPORT, KWARM_MANIFEST, KWARM_LEARN*, and
#                         KWARM_WARMUPS of warm runs, REPLAY_FROM cold runs and WARMUPS) wins
#   FLOOR=0               1: after each kwarm-on cold run, a kwarm-off run on new empty caches
#                         except DeepGEMM's, which is that cold run's (DG_JIT_CACHE_DIR): vLLM's
#                         start with every DeepGEMM kernel already built, the floor that no
#                         DeepGEMM schedule can go under (tag *-kwarmoff-floor, variant
#                         "DeepGEMM built")
#   WARMUPS=""            KWARM_WARMUPS of the replay runs (e.g. "*,-caching_allocator": all
#                         families but one); empty: all families
#   LOCK=$WORK/engines.lock  the SYNC lock: give two gpu_run.sh started side by side (each
#                         with its own WORK and OUT) one LOCK, so that their engines also
#                         measure one at a time
#   INSTALL=1             0: kwarm is already installed (by a gpu_run.sh started just before)
#   OUT                   set by the device tool; else bench/results
#   WORK=/tmp/kwarm-bench caches (not returned)
#   PY=python3
set -uo pipefail
shopt -s nullglob
REPLAY_FROM=${REPLAY_FROM:-}
# REPLAY_FROM relative to the caller's folder, before the cd (else to the repository root)
if [ -n "$REPLAY_FROM" ] && [ -d "$REPLAY_FROM" ]; then REPLAY_FROM=$(cd "$REPLAY_FROM" && pwd); fi
cd "$(dirname "$0")/.." || exit 1

VER=${VER:-0.24.0}
STAGED=${STAGED:-/tmp/kwarm-gpu}
MODELS=${MODELS:-"tiny-qwen3-next tiny-deepseek-v32"}
MODES=${MODES:-"off on"}
WARM=${WARM:-1}
LEARN=${LEARN:-1}
REPLAY_BENCH=${REPLAY_BENCH:-1}
SCENARIO=${SCENARIO:-default}
BUDGET=${BUDGET:-570}
COLD_TIMEOUT=${COLD_TIMEOUT:-360}
GPU_UTIL=${GPU_UTIL:-0.2}
KV_BYTES=${KV_BYTES:-4G}
REPLAY_ONLY=${REPLAY_ONLY:-0}
REPLAY_RUN=${REPLAY_RUN:-1}
WARM_MANIFEST=${WARM_MANIFEST:-0}
SYNC=${SYNC:-1}
SYNC_RUNS=${SYNC_RUNS:-*}
PROFILE=${PROFILE:-}
PROFILE_RUNS=${PROFILE_RUNS:-*}
BENCH_ARGS=${BENCH_ARGS:-}
ON_ARGS=${ON_ARGS:-}
KWARM_ENV=${KWARM_ENV:-}
WARMUPS=${WARMUPS:-}
FLOOR=${FLOOR:-0}
INSTALL=${INSTALL:-1}
# The device tool returns at most 8 files from $OUT: everything is written to $RUN_OUT and
# packed into $OUT/bench-results.tgz at the end (table.md is also copied beside it).
FINAL_OUT=${OUT:-bench/results}
WORK=${WORK:-/tmp/kwarm-bench}
OUT=$WORK/out
PY=${PY:-python3}
LOCK=${LOCK:-$WORK/engines.lock}
DEADLINE=$(( $(date +%s) + BUDGET ))

if [ -n "$REPLAY_FROM" ]; then
  if [ ! -d "$REPLAY_FROM" ]; then echo "REPLAY_FROM=$REPLAY_FROM: no such folder"; exit 1; fi
  REPLAY_FROM=$(cd "$REPLAY_FROM" && pwd -P)
  mkdir -p "$OUT"
  case "$REPLAY_FROM/" in
    "$(cd "$OUT" && pwd -P)"/*)  # a previous call's $OUT, emptied below: keep its manifests
      rm -rf "$WORK/replay-from" && mkdir -p "$WORK/replay-from"
      cp -f "$REPLAY_FROM"/*.manifest.json "$WORK/replay-from/" 2>/dev/null
      echo "REPLAY_FROM: the manifests of $REPLAY_FROM (emptied below) copied to $WORK/replay-from"
      REPLAY_FROM=$(cd "$WORK/replay-from" && pwd -P) ;;
  esac
fi
rm -rf "$OUT"
mkdir -p "$OUT" "$WORK" "$FINAL_OUT"
FINAL_OUT=$(cd "$FINAL_OUT" && pwd)
pack() {
  tar czf "$FINAL_OUT/bench-results.tgz" -C "$OUT" . && cp -f "$OUT/table.md" "$FINAL_OUT/" 2>/dev/null
  cp -f "$OUT/chart.svg" "$FINAL_OUT/" 2>/dev/null; true
}
trap pack EXIT
rm -f "$OUT/status.txt" "$OUT/failed.txt"
# KWARM_ENV: VAR=VALUE words only (checked before anything runs)
read -ra KWARM_ENV_LIST <<<"$KWARM_ENV"
for kv in "${KWARM_ENV_LIST[@]}"; do
  if ! [[ $kv =~ ^[A-Za-z_][A-Za-z0-9_]*= ]]; then echo "KWARM_ENV: $kv is not VAR=VALUE"; exit 1; fi
done
# kwarm must be off at interpreter start: engine_bench.py sets KWARM_* itself per run.
unset KWARM_ENABLE KWARM_REPORT KWARM_WARMUPS KWARM_ENV

if [ ! -f "$STAGED/vllm-$VER/env.sh" ]; then
  echo "no staged vLLM $VER on this host ($STAGED/vllm-$VER/env.sh): stage it first (bench/README.md)"
  exit 1
fi
# shellcheck disable=SC1090
source "$STAGED/vllm-$VER/env.sh"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
# the CPUs the compiles share: threads per core say whether 16 CPUs are 16 cores or 8 with two threads each
lscpu 2>/dev/null | grep -E "^(CPU\(s\)|Thread\(s\) per core|Core\(s\) per socket|Socket\(s\)|Model name):" | tee -a "$OUT/gpu.txt"

# ------------------------------------------------------------------ install kwarm
# shellcheck source=bench/install_kwarm.sh
source bench/install_kwarm.sh
if [ "$INSTALL" = 1 ]; then install_kwarm || exit 1; fi
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
    tiny-deepseek-v3) echo "--attention-backend TRITON_MLA" ;;          # dense MLA (prefill: FlashAttention 3)
    *) echo "" ;;                                                       # MLA: FLASHMLA_SPARSE
  esac
}
# MODEL_ARGS_<name> of one model (after BENCH_ARGS, so it overrides GPU_UTIL, KV_BYTES and
# BENCH_ARGS: argparse keeps the last value)
model_extra_args() {
  local var="MODEL_ARGS_${1//[^A-Za-z0-9_]/_}"
  echo "${!var:-}"
}

# One engine run: run_one TAG CACHE_DIR LIMIT_CAP [ENV=VALUE...] -- [engine_bench args...]
run_one() {
  local tag=$1 cache=$2 cap=$3; shift 3
  local envs=() ; while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
  local left=$(( DEADLINE - $(date +%s) - 20 )) limit
  limit=$left; [ "$cap" -lt "$limit" ] && limit=$cap
  if [ "$limit" -lt 60 ]; then
    echo "$tag: skipped (${left}s left)" | tee -a "$OUT/status.txt"; return 99
  fi
  mkdir -p "$cache"
  local t0 rc extra=()
  if [ "$SYNC" = 1 ]; then
    local pat pats
    read -r -a pats <<<"$SYNC_RUNS"  # no pathname expansion of the patterns
    for pat in "${pats[@]}"; do
      # shellcheck disable=SC2053  # a pattern
      if [[ $tag == $pat ]]; then extra+=(--sync-lock "$LOCK"); break; fi
    done
  fi
  # shellcheck disable=SC2053  # a pattern
  [ -n "$PROFILE" ] && [[ $tag == $PROFILE_RUNS ]] && extra+=(--profile "$PROFILE")
  t0=$(date +%s)
  env "VLLM_CACHE_ROOT=$cache/vllm" "TORCHINDUCTOR_CACHE_DIR=$cache/inductor" "${envs[@]}" \
    timeout -k 15 "$limit" "$PY" bench/engine_bench.py "$@" "${extra[@]}" --triton-cache "$cache/triton" \
    --out "$OUT/$tag.json" >"$OUT/$tag.log" 2>&1
  rc=$?
  echo "$tag: rc=$rc in $(( $(date +%s) - t0 )) s$( [ $rc -eq 124 ] || [ $rc -eq 137 ] && echo " (timeout ${limit}s)")" \
    | tee -a "$OUT/status.txt"
  [ "$rc" -eq 0 ] || echo "$tag" >>"$OUT/failed.txt"
  return $rc
}

# kwarm off: cold, then warm on the same caches.
# kwarm on:  cold (families; with LEARN=1 it also learns this deployment's manifest), with LEARN=1
#            new empty caches replaying it (families + replay), then a warm run on the
#            cold run's caches (families only: KWARM_WARMUPS=-replay).
#            With a manifest from REPLAY_FROM: no learning, the cold run without the replay
#            family, the replay run replays the given manifest (REPLAY_ONLY=1: that run only).
pipeline() {
  local model=$1 mode=$2
  local tag=$model-vllm$VER-kwarm$mode cache=$WORK/$model-vllm$VER-kwarm$mode
  local manifest=$OUT/$model-vllm$VER.manifest.json given=0
  rm -rf "$cache" "$cache-replay" "$cache-floor"
  # shellcheck disable=SC2206,SC2207  # word splitting intended
  local args=("bench/models/$model" --kwarm "$mode" --scenario "$SCENARIO"
              --gpu-memory-utilization "$GPU_UTIL" --kv-cache-memory-bytes "$KV_BYTES"
              $(model_args "$model") $BENCH_ARGS $(model_extra_args "$model"))
  local base=("${args[@]}")  # the floor run's (kwarm off), without ON_ARGS
  # shellcheck disable=SC2206  # word splitting intended
  [ "$mode" = on ] && args+=($ON_ARGS)
  local on=() learn=() replay_env=() kenv=()
  [ -n "$WARMUPS" ] && replay_env=("KWARM_WARMUPS=$WARMUPS")
  if [ "$mode" = on ]; then
    kenv=("${KWARM_ENV_LIST[@]}")  # first in every kwarm-on run's environment: the script's own win
    if [ -n "$REPLAY_FROM" ] && [ -f "$REPLAY_FROM/${manifest##*/}" ]; then
      # the copy in $OUT travels with the results; the runs read the copy
      cp -f "$REPLAY_FROM/${manifest##*/}" "$manifest" && given=1
      echo "$tag: manifest from $REPLAY_FROM/${manifest##*/}$( [ "$REPLAY_ONLY" = 1 ] && echo ", replay run only")" \
        | tee -a "$OUT/status.txt"
    fi
    on=("KWARM_REPORT=$OUT/$tag-cold.kwarm-report.json" "KWARM_MANIFEST=$manifest")
    if [ "$given" = 1 ]; then
      on+=("KWARM_WARMUPS=-replay")  # a cold run on families only; the replay run replays
    elif [ "$LEARN" != 0 ]; then
      learn=("KWARM_LEARN=$( [ "$LEARN" = all ] && echo all || echo 1)" "KWARM_LEARN_INTERVAL=15")
    fi
  fi
  if [ "$given" = 1 ] && [ "$REPLAY_ONLY" = 1 ]; then
    run_one "$tag-replay" "$cache-replay" "$COLD_TIMEOUT" "${kenv[@]}" "KWARM_MANIFEST=$manifest" "${replay_env[@]}" \
      "KWARM_REPORT=$OUT/$tag-replay.kwarm-report.json" -- "${args[@]}" --variant replay
    return
  fi
  run_one "$tag-cold" "$cache" "$COLD_TIMEOUT" "${kenv[@]}" "${on[@]}" "${learn[@]}" -- "${args[@]}" \
    --variant "$( [ ${#learn[@]} -gt 0 ] && echo learning)" || return
  if [ "$FLOOR" = 1 ] && [ "$mode" = on ]; then
    local off_args=("${base[@]}"); off_args[2]=off  # base: model --kwarm MODE ...
    run_one "$model-vllm$VER-kwarmoff-floor" "$cache-floor" "$COLD_TIMEOUT" "DG_JIT_CACHE_DIR=$cache/vllm/deep_gemm" \
      -- "${off_args[@]}" --variant "DeepGEMM built"
  fi
  if [ "$REPLAY_RUN" = 1 ] && [ "$mode" = on ] && { [ "$given" = 1 ] || [ "$LEARN" != 0 ]; } && [ -f "$manifest" ]; then
    run_one "$tag-replay" "$cache-replay" "$COLD_TIMEOUT" "${kenv[@]}" "KWARM_MANIFEST=$manifest" "${replay_env[@]}" \
      "KWARM_REPORT=$OUT/$tag-replay.kwarm-report.json" -- "${args[@]}" --variant replay
  fi
  if [ "$WARM" = 1 ] || [ "$WARM" = "$mode" ]; then
    local warm_env=()
    if [ "$mode" = on ] && [ "$WARM_MANIFEST" = 1 ]; then  # a warm restart of a deployment that learned
      warm_env=("${kenv[@]}" "KWARM_REPORT=$OUT/$tag-warm.kwarm-report.json" "KWARM_MANIFEST=$manifest")
    elif [ "$mode" = on ]; then
      warm_env=("${kenv[@]}" "KWARM_REPORT=$OUT/$tag-warm.kwarm-report.json" "KWARM_WARMUPS=-replay")
    fi
    run_one "$tag-warm" "$cache" "$COLD_TIMEOUT" "${warm_env[@]}" -- "${args[@]}"
  fi
}

echo "== runs: models [$MODELS] x kwarm [$MODES], scenario $SCENARIO, warm=$WARM, sync=$SYNC on [$SYNC_RUNS]," \
  "kwarm env=[${KWARM_ENV_LIST[*]}], learn=$LEARN, profile=[${PROFILE}] on $PROFILE_RUNS, replay from=[${REPLAY_FROM}] only=$REPLAY_ONLY, budget ${BUDGET}s"
for model in $MODELS; do
  for mode in $MODES; do
    pipeline "$model" "$mode" &
    sleep 2  # stagger the imports a little
  done
done
wait

# Replay cost of each learned manifest, one thread vs all cores, once the engines are done
# (alone on the host, so that the two timings compare).
if [ "$REPLAY_BENCH" != 0 ]; then
  for manifest in "$OUT"/*.manifest.json; do
    # shellcheck disable=SC2053  # a pattern
    [ "$REPLAY_BENCH" = 1 ] || [[ ${manifest##*/} == $REPLAY_BENCH ]] || continue
    left=$(( DEADLINE - $(date +%s) - 30 ))
    if [ "$left" -lt 90 ]; then echo "replay bench: skipped ${manifest##*/} (${left}s left)" | tee -a "$OUT/status.txt"; continue; fi
    name=$(basename "$manifest" .manifest.json)
    timeout "$left" "$PY" bench/replay_bench.py "$manifest" --threads 1 "$(nproc)" \
      --out "$OUT/$name.replay-bench.json" >"$OUT/$name.replay-bench.log" 2>&1
    echo "replay bench $name: rc=$?" | tee -a "$OUT/status.txt"
    grep SUMMARY "$OUT/$name.replay-bench.log"
  done
fi

# ------------------------------------------------------------------------ report
# A failed or timed-out run keeps the JSON it wrote after init and after each request
# ("complete": false, shown as "cut short" in the table).
if [ -f "$OUT/failed.txt" ]; then
  while read -r run; do
    echo "== $run failed; last lines of $run.log:"
    grep -v "^INFO\|^(EngineCore" "$OUT/$run.log" | tail -25
  done <"$OUT/failed.txt"
fi
results=("$OUT"/*-cold.json "$OUT"/*-warm.json "$OUT"/*-replay.json "$OUT"/*-floor.json)
if [ ${#results[@]} -eq 0 ]; then
  echo "no results"; exit 1
fi
"$PY" bench/table.py "${results[@]}" >"$OUT/table.md"
"$PY" bench/chart.py "$OUT/chart.svg" "${results[@]}" || echo "chart.py failed (table.md is complete)"
echo
"$PY" bench/table.py --no-keys "${results[@]}"
echo "(full table with Triton keys: \$OUT/table.md)"
