#!/usr/bin/env bash
# bench/serve_run.sh across several device calls (each at most 10 minutes) on a warm GPU host:
#
#   BUDGET=1100 MODELS="tiny-qwen3-next tiny-deepseek-v32" bash bench/serve_detached.sh start
#   bash bench/serve_detached.sh wait      # in the next call, sent at once: the host is recycled
#                                          # after about 30 s without a call
#
# `start` launches serve_run.sh with setsid (every variable of serve_run.sh passes through; its
# results go to $RUN/out, its output to $RUN/run.log), so it outlives this call; `start` and
# `wait` then wait up to WAIT seconds for it to end. When it has ended, they copy its results
# (serve-results.tgz, table.md, the result JSON) and run.log into $OUT and print its last lines
# (the tables); otherwise they print the log's last lines and "still running". A second `start`
# while one runs is refused.
#
# Environment (defaults): RUN=/tmp/kwarm-detached, WAIT=560, OUT (the device call's folder),
# SERVE_RUN=bench/serve_run.sh.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
RUN=${RUN:-/tmp/kwarm-detached}
WAIT=${WAIT:-560}
SERVE_RUN=${SERVE_RUN:-bench/serve_run.sh}
case "${1:-}" in
  start)
    if [ -f "$RUN/pid" ] && [ ! -f "$RUN/rc" ]; then
      echo "serve_detached: a run is already going ($RUN); use: bash bench/serve_detached.sh wait"
      exit 1
    fi
    rm -rf "$RUN" && mkdir -p "$RUN/out"
    OUT="$RUN/out" setsid nohup bash -c 'bash "$1"; echo $? > "$2/rc"' _ "$SERVE_RUN" "$RUN" \
      >"$RUN/run.log" 2>&1 </dev/null &
    echo $! >"$RUN/pid"
    echo "serve_detached: started $SERVE_RUN (log $RUN/run.log)"
    ;;
  wait) [ -f "$RUN/pid" ] || { echo "serve_detached: nothing started in $RUN"; exit 1; } ;;
  *) echo "usage: bash bench/serve_detached.sh start|wait   (see the comment at its top)"; exit 2 ;;
esac
end=$(( $(date +%s) + WAIT ))
while [ ! -f "$RUN/rc" ] && [ "$(date +%s)" -lt "$end" ]; do sleep 2; done
if [ ! -f "$RUN/rc" ]; then
  tail -5 "$RUN/run.log"
  echo "serve_detached: still running after ${WAIT} s; next: bash bench/serve_detached.sh wait"
  exit 0
fi
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT" && cp -rf "$RUN/out/." "$OUT/" && cp -f "$RUN/run.log" "$OUT/"
fi
tail -60 "$RUN/run.log"
echo "serve_detached: serve_run ended with exit status $(cat "$RUN/rc")"
exit "$(cat "$RUN/rc")"
