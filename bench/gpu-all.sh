#!/bin/bash
# gpu-all.sh — one GPU pass for the open issues in one command (DEVICE.md),
# in order of what each issue still lacks, every step under its own timeout
# and skipped (saying so) once the pass's budget cannot hold it:
#   cudaops   one node: check_cuda_ops under MPS (every op against the oracle;
#             0.4.0's int64 received ids and handles in lent device memory)
#   xnode     issue 14: check_xnode's gpu case under MPS (jobs over daemons
#             sharing the GPU against the oracle; a lost node)  [gpu-xnode.sh]
#   ep        issue 14: bench/ep across two cuda daemons and on one, loopback
#             TCP round trips                                   [gpu-xnode.sh]
#   doctor    issue 15: the doctor's GPU checks (check_doctor's gpu case;
#             DEP_PTX_BUILD names a PTX-only build for the kernel-cache part)
#   pytest    issue 17: the Python suite on CUDA tensors under MPS (the CUDA
#             graph captures included)
#   restart   issue 17: bench/py_restart.py, 8 rank processes under MPS (a trainer's
#             restart to its first dispatch; NCCL's init and first all_to_all beside it)
#   pyover    issue 17: bench/py_overhead.py --device cuda under MPS
#   hostwarm  the host backend's first calls with and without its warm-up
#   elastic   issue 25: bench/elastic, 8 rank processes, one daemon and 4 + 4 over two,
#             host backend and cuda under MPS (a rank SIGKILLed, a replacement
#             rejoining, a restart beside)                    [gpu-xnode.sh]
# Logs under $OUT, one file per step (the device tool brings back only a few
# files: the console output says what each step found).  Daemons stay outside MPS.
# Build here first:
#   make BUILD=build-gpu STATIC_DEPS=1 all build-gpu/check_deepepd
#   make BUILD=build-ptx PTX_ONLY=90 STATIC_DEPS=1 all      (the doctor's PTX part)
#   a pure-Python pytest in build-gpu/pylib where the GPU machine has none
# Usage there, from the repository root: bench/gpu-all.sh [BUILD_DIR]
# Knobs: STEPS (default "cudaops xnode ep doctor pytest restart pyover hostwarm"), BUDGET (seconds, 400),
# PYTEST_SECS (the pytest step's limit, 240; a test past 60 s dumps its stacks), PYTEST_FILES
# (python/tests), CUDAOPS_SECS (the cuda_ops suite's limit, 120).
set -u
R=$(pwd)
B=$(cd "${1:-build-gpu}" && pwd) || exit 2
OUTD=${OUT:-/tmp/dep-out}
mkdir -p "$OUTD"
exec > >(tee "$OUTD/gpu-all.log") 2>&1
T0=$SECONDS BUDGET=${BUDGET:-400}
date -u; nvidia-smi --query-gpu=name,uuid,driver_version,memory.total,compute_mode --format=csv,noheader
echo "== missing libraries (none expected):"; ldd "$B"/deepepd "$B"/check_deepepd "$B"/libdeepep-client.so.0 | grep 'not found'

# fits SECS: whether SECS more seconds fit in the budget; says so when not.
fits() {
  local left=$((BUDGET - (SECONDS - T0)))
  ((left >= $1)) && return 0
  echo "== SKIPPED $2: ${left} s of the pass's budget left, the step needs up to $1 s"
  return 1
}
. "$(dirname "${BASH_SOURCE[0]}")/mps.sh"
# cuda_daemon LOG: a cuda deepepd on a socket in a new directory $D, outside MPS (started
# before it: DEVICE.md), its stderr in $OUTD/LOG; returns once it answers.
cuda_daemon() {
  D=$(mktemp -d /tmp/dep-ga.XXXX)
  printf 'socket:\n  path: %s/d.sock\nbackend: cuda\npool:\n  size_per_device: 16GiB\n  chunk_size: 1GiB\n  host_size: 1GiB\n' "$D" > "$D/d.yaml"
  env -u CUDA_MPS_PIPE_DIRECTORY -u CUDA_MPS_LOG_DIRECTORY setsid "$B"/deepepd -c "$D/d.yaml" > "$OUTD/$1" 2>&1 &
  for i in $(seq 150); do "$B"/deepepctl -s "$D/d.sock" status >/dev/null 2>&1 && break; sleep 0.2; done
}
PY=$(command -v python3)
PP=$R/python
$PY -c "import pytest" 2>/dev/null || PP=$R/python:$B/pylib

for s in ${STEPS:-cudaops xnode ep doctor pytest restart pyover hostwarm}; do
  t=$SECONDS
  case $s in
  cudaops)
    fits $((${CUDAOPS_SECS:-120} + 10)) cudaops || continue
    mps_on
    echo "== cudaops: CK_RUN_SUITE=cuda_ops (gpu-tagged), MPS"
    env DEP_BUILD="$B" DEP_TEST_TAGS=gpu DEP_TEST_BACKEND=cuda CK_RUN_SUITE=cuda_ops \
      CK_VERBOSITY=verbose timeout ${CUDAOPS_SECS:-120} "$B"/check_deepepd > "$OUTD/cudaops-gpu.log" 2>&1
    echo "== cudaops rc $?"; grep -E "Checks:|:F:|:E:" "$OUTD/cudaops-gpu.log" | tail -30
    mps_off ;;
  xnode) fits 130 xnode && OUT=$OUTD STEPS=xnode SECS=120 bench/gpu-xnode.sh "$B" ;;
  ep) fits 110 ep && OUT=$OUTD STEPS=ep EP_CALLS=50 bench/gpu-xnode.sh "$B" ;;
  doctor)
    fits 100 doctor || continue
    echo "== doctor: CK_RUN_SUITE=doctor (gpu-tagged)"
    env DEP_BUILD="$B" ${DEP_PTX_BUILD:+DEP_PTX_BUILD="$DEP_PTX_BUILD"} DEP_TEST_TAGS=gpu \
      DEP_TEST_BACKEND=cuda CK_RUN_SUITE=doctor CK_VERBOSITY=verbose timeout 90 "$B"/check_deepepd \
      > "$OUTD/doctor-gpu.log" 2>&1
    echo "== doctor rc $?"; grep -E "Checks:|:F:|:E:|skipped|\(in part\)" "$OUTD/doctor-gpu.log" | cut -c1-300 | tail -30 ;;
  pytest)
    fits $((${PYTEST_SECS:-240} + 10)) pytest || continue
    cuda_daemon pytest-deepepd.log
    mps_on
    echo "== pytest: python/tests on CUDA tensors, MPS"
    DEEPEP_CLIENT_LIB=$B/libdeepep-client.so.0 DEP_BUILD=$B DEP_TEST_BACKEND=cuda DEP_TEST_SOCKET=$D/d.sock \
      PYTHONPATH=$PP timeout ${PYTEST_SECS:-240} $PY -m pytest -p no:cacheprovider -rs -v \
      -o faulthandler_timeout=60 ${PYTEST_FILES:-python/tests} > "$OUTD/pytest-cuda-mps.log" 2>&1
    rc=$?
    echo "== pytest rc $rc$([ $rc = 124 ] && echo " (timed out after ${PYTEST_SECS:-240} s; the log's end:)")"
    grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed" "$OUTD/pytest-cuda-mps.log" | tail -20
    [ $rc = 124 ] && tail -25 "$OUTD/pytest-cuda-mps.log"
    mps_off
    pkill -TERM -f "deepepd -c $D/" ;;
  restart)
    fits 160 restart || continue
    cuda_daemon restart-deepepd.log
    mps_on
    echo "== restart: bench/py_restart.py, 8 processes, MPS"
    DEEPEP_CLIENT_LIB=$B/libdeepep-client.so.0 PYTHONPATH=$R/python timeout 150 $PY bench/py_restart.py \
      -s "$D/d.sock" -n 8 -r ${RESTART_RUNS:-3} -o "$OUTD/py-restart.csv" 2>&1 | tee "$OUTD/py-restart.txt"
    echo "== restart rc ${PIPESTATUS[0]}"
    mps_off
    pkill -TERM -f "deepepd -c $D/" ;;
  pyover)
    fits 100 pyover || continue
    mps_on
    echo "== pyover: bench/py_overhead.py --device cuda, MPS"
    DEP_BUILD=$B PYTHONPATH=$PP timeout 90 $PY bench/py_overhead.py --device cuda \
      -o "$OUTD/py-overhead-cuda.csv" 2>&1 | tee "$OUTD/py-overhead-cuda.txt"
    echo "== pyover rc ${PIPESTATUS[0]}"
    mps_off ;;
  elastic) fits 500 elastic && OUT=$OUTD STEPS=elastic bench/gpu-xnode.sh "$B" ;;
  hostwarm) fits 80 hostwarm && OUT=$OUTD STEPS=hostwarm HW_TOKENS=128 bench/gpu-xnode.sh "$B" ;;
  *) echo "== unknown step $s" ;;
  esac
  echo "== step $s: $((SECONDS - t)) s"
done
echo "== pass: $((SECONDS - T0)) s"; date -u
# The device tool brings back only a few files: every step's log in one archive.
T=$(mktemp /tmp/gpu-all-logs.XXXXXX)
(cd "$OUTD" && tar czf "$T" --exclude logs.tgz --exclude gpu-all.log . && mv "$T" logs.tgz &&
  echo "== logs: $OUTD/logs.tgz")
