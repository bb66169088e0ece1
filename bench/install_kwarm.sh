# install_kwarm: installs kwarm from the repository root for $PY (default python3) on the GPU host,
# into site-packages where it can (the .pth door then fires), else with --target $WORK/kwarm-site
# put first on PYTHONPATH. Logs to $OUT/install.log. Sourced by gpu_run.sh and serve_run.sh.
install_kwarm() {
  local log=$OUT/install.log PY=${PY:-python3} pipargs=(--no-deps --no-index --no-build-isolation --force-reinstall)
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
