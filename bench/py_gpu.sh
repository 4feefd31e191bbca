#!/bin/bash
# py_gpu.sh — issue 17's GPU pass in one command (DEVICE.md): the Python suite on CUDA
# tensors (python/tests with DEP_TEST_BACKEND=cuda: every method in jobs of 1, 2, 4 and 8
# rank processes, the cuda tests, the CUDA-graph replays) under MPS, then bench/py_restart.py
# (8 rank processes under MPS, and NCCL's init and first all_to_all_single beside it), then
# the cuda tests of worlds 1 and 2 once time-sliced (no MPS: nothing deadlocks there).
# The daemon (cuda backend) is started before the MPS server, outside it.  Logs under $OUT.
# Build here first (a clean worktree of HEAD):
#   make BUILD=build-gpu5 STATIC_DEPS=1 all build-gpu5/check_deepepd
# and, for a machine without pytest, Debian's pure-Python pytest in BUILD/pylib.
# Usage there, from the repository root: bench/py_gpu.sh [BUILD_DIR]
# Knobs: RESTART_RUNS (3) runs of py_restart with the barrier, NOBARRIER_RUNS (0) without.
set -u
R=$(pwd); B=$(cd "${1:-build-gpu5}" && pwd)
OUTD=${OUT:-/tmp/out}; mkdir -p "$OUTD"
exec > >(tee "$OUTD/py-gpu.log") 2>&1
date -u; nvidia-smi --query-gpu=name,uuid,driver_version,memory.total --format=csv,noheader
PY=$(command -v python3); echo "== python: $PY"
$PY -c "import sys, torch; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'gpu', torch.cuda.is_available())"
$PY -c "import numpy; print('numpy', numpy.__version__)" || echo "== NO NUMPY: the suite's reference cannot run"
PP=$R/python
if $PY -c "import pytest; print('pytest', pytest.__version__)"; then
  PYTEST=(-m pytest)
else
  echo "== no pytest here: Debian's 7.2.1 from $B/pylib"; PP=$R/python:$B/pylib
  PYTEST=(-m pytest --assert=plain -W ignore::DeprecationWarning)
fi
echo "== missing libraries (none expected):"; ldd "$B"/deepepd "$B"/libdeepep-client.so.0 | grep 'not found'
export DEEPEP_CLIENT_LIB=$B/libdeepep-client.so.0 DEP_BUILD=$B CUDA_VISIBLE_DEVICES=0
D=$(mktemp -d /tmp/pyg.XXXX)
printf 'socket:\n  path: %s/d.sock\nbackend: cuda\npool:\n  size_per_device: 16GiB\n  chunk_size: 1GiB\n  host_size: 1GiB\n' "$D" > "$D/d.yaml"
setsid "$B"/deepepd -c "$D/d.yaml" > "$OUTD/deepepd.log" 2>&1 &
DPID=$!
for i in $(seq 150); do [ -S "$D/d.sock" ] && "$B"/deepepctl -s "$D/d.sock" status >/dev/null 2>&1 && break; sleep 0.2; done
"$B"/deepepctl -s "$D/d.sock" status | head -8
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
mkdir -p /tmp/mps /tmp/mpslog; nvidia-cuda-mps-control -d && echo "== MPS started"
echo "== pytest, cuda backend, MPS"
DEP_TEST_BACKEND=cuda DEP_TEST_SOCKET=$D/d.sock PYTHONPATH=$PP timeout ${PYTEST_S:-200} \
  $PY "${PYTEST[@]}" -p no:cacheprovider -rs -v python/tests > "$OUTD/pytest-cuda-mps.log" 2>&1
echo "== pytest rc $?"; grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed" "$OUTD/pytest-cuda-mps.log" | tail -30
echo "== bench/py_restart.py, 8 processes, MPS"
PYTHONPATH=$R/python timeout ${RESTART_S:-150} $PY bench/py_restart.py -s "$D/d.sock" -n 8 \
  -r ${RESTART_RUNS:-3} -o "$OUTD/py-restart.csv" 2>&1 | tee "$OUTD/py-restart.txt"
echo "== py_restart rc ${PIPESTATUS[0]}"
if [ "${NOBARRIER_RUNS:-0}" -gt 0 ]; then
  echo "== bench/py_restart.py --no-barrier, 8 processes, MPS"
  PYTHONPATH=$R/python timeout ${RESTART_S:-150} $PY bench/py_restart.py -s "$D/d.sock" -n 8 \
    -r $NOBARRIER_RUNS --no-barrier --no-nccl -o "$OUTD/py-restart-nobarrier.csv" 2>&1 \
    | tee "$OUTD/py-restart-nobarrier.txt"
  echo "== py_restart --no-barrier rc ${PIPESTATUS[0]}"
fi
echo quit | nvidia-cuda-mps-control; sleep 1; echo "== MPS stopped"
echo "== pytest, cuda backend, time-sliced: test_cuda.py, worlds 1 and 2"
DEP_TEST_BACKEND=cuda DEP_TEST_SOCKET=$D/d.sock PYTHONPATH=$PP timeout ${SLICED_S:-90} \
  $PY "${PYTEST[@]}" -p no:cacheprovider -rs -v python/tests/test_cuda.py -k "not 8" \
  > "$OUTD/pytest-cuda-timesliced.log" 2>&1
echo "== pytest rc $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUTD/pytest-cuda-timesliced.log" | tail -8
"$B"/deepepctl -s "$D/d.sock" status | head -12
kill -TERM $DPID; wait $DPID; echo "== deepepd exit $?"
date -u
