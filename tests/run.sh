#!/usr/bin/env bash
# Sets up the test environment from scratch and runs the tests (the README's test command).
#
#   bash tests/run.sh [pytest args...]
#
# - .venv/ : Python venv with the real vllm==0.24.0 (CPU import; about 9 GB, a few minutes
#   the first time), pytest, and kwarm-ext installed from this tree (reinstalled every run).
# - .rel/vllm-<ver>/ : the Python files of other vLLM releases (0.20.0 0.22.0 0.26.0 0.28.0
#   0.33.0 0.34.0) for the release-matrix tests, which put one of them first on PYTHONPATH.
# KWARM_TEST_VENV overrides the venv location; KWARM_TEST_RELEASES the release list.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${KWARM_TEST_VENV:-.venv}
PY=${PYTHON:-python3}
RELEASES=${KWARM_TEST_RELEASES:-0.20.0 0.22.0 0.26.0 0.28.0 0.33.0 0.34.0}

# pip, without this machine's "Location ... is ignored" noise; pip's own status is kept (pipefail).
pip_() { "$VENV/bin/pip" "$@" 2>&1 | { grep -v "^WARNING: Location" || true; }; }

if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import vllm, pytest" 2>/dev/null; then
  echo "== creating $VENV with vllm==0.24.0 (a few minutes the first time)"
  "$PY" -m venv "$VENV"
  pip_ install -q --upgrade pip "setuptools>=77,<82" wheel
  pip_ install -q "vllm==0.24.0" pytest pytest-xdist gguf
fi
"$VENV/bin/python" -c "import xdist, setuptools, sys; sys.exit(int(setuptools.__version__.split('.')[0]) < 77)" 2>/dev/null \
  || pip_ install -q pytest-xdist "setuptools>=77,<82"
echo "== installing kwarm-ext from this tree"
pip_ install -q --no-deps --force-reinstall --no-build-isolation .
pip_ install -q wrapt
# Ray, for the test that starts a real local Ray cluster (tests/test_ray_workers.py)
"$VENV/bin/python" -c "import ray" 2>/dev/null || pip_ install -q "ray>=2.40"

for ver in $RELEASES; do
  dest=.rel/vllm-$ver
  [ -f "$dest/.complete" ] && continue
  echo "== fetching vLLM $ver's Python files into $dest"
  rm -rf "$dest" && mkdir -p "$dest/.whl"
  pip_ download -q --no-deps -d "$dest/.whl" "vllm==$ver"
  "$VENV/bin/python" - "$dest" <<'PY'
import glob, sys, zipfile
dest = sys.argv[1]
with zipfile.ZipFile(glob.glob(f"{dest}/.whl/vllm-*.whl")[0]) as zf:
    zf.extractall(dest, [n for n in zf.namelist() if n.endswith((".py", ".json")) or ".dist-info/" in n])
PY
  rm -rf "$dest/.whl"
  # Extra modules an import of this release asks for beyond 0.24.0's dependencies.
  case "$ver" in
    0.33.*) pip_ install -q --no-deps --target "$dest" "humming-kernels==0.1.19" orjson ;;
    0.34.*) pip_ install -q --no-deps --target "$dest" orjson ;;  # its API server's JSON
  esac
  touch "$dest/.complete"
done

# FlashInfer 0.7.2 (what `pip install vllm` 0.33 resolves to) and the CuTe DSL it compiles with, for the
# tests that compile its SM90 GDN prefill kernels on the CPU (tests/test_early_gdn.py), put first on
# PYTHONPATH by those tests only.
fi_dest=.rel/flashinfer-0.7.2
if [ ! -f "$fi_dest/.complete" ]; then
  echo "== fetching FlashInfer 0.7.2 and nvidia-cutlass-dsl 4.8.0 into $fi_dest"
  rm -rf "$fi_dest"
  pip_ install -q --no-deps --target "$fi_dest" flashinfer-python==0.7.2.post1 nvidia-cutlass-dsl==4.8.0 \
    nvidia-cutlass-dsl-libs-base==4.8.0 nvidia-cutlass-dsl-libs-core==4.8.0 nvidia-cutlass-dsl-libs-cu13==4.8.0
  touch "$fi_dest/.complete"
fi

echo "== pytest"
export CUDA_VISIBLE_DEVICES=""
# everything above is installed: a missing vLLM, Triton, FlashInfer or Ray (or release) fails, not skips
export KWARM_TEST_REQUIRE=${KWARM_TEST_REQUIRE:-1}
export HUMMING_DISABLE_PARALLEL_BUILD=1   # vLLM 0.33's import would build humming's launcher in the background
# the pytest script, not `python -m pytest`: the latter puts this folder first on sys.path, and
# the source kwarm_ext (without kwarm_ext.kernels) would shadow the installed one.
# Two workers, each test module on one of them (its per-release vLLM runs start once); the runs
# fork from one server per vLLM release (tests/forkserver.py, shared by the workers;
# KWARM_TEST_FORKSERVER=0: a fresh interpreter each). How long the whole suite takes: README,
# "The two commands" (the one place that number is kept).
# KWARM_TEST_WORKERS=0: one process.
exec "$VENV/bin/pytest" -q -p no:cacheprovider -n "${KWARM_TEST_WORKERS:-2}" --dist loadfile "$@"
