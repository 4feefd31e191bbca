#!/bin/bash
# deepep_one_gpu.sh — DeepEP's own test scripts, unmodified, with all their ranks on one GPU
# (issue 26): test_intranode.py and test_low_latency.py at 2, 4 and 8 ranks through
# bench/deepep_one_gpu.py (devices and the process group's backend mapped, nothing else),
# against a cuda deepepd started before the MPS server, outside it, the ranks under MPS.
# Logs (each script's output, with its printed bandwidths) under $OUT.
# Usage, from the repository root: bench/deepep_one_gpu.sh BUILD_DIR DEEPEP_TESTS_DIR
#   DEEPEP_TESTS_DIR: DeepEP's tests/ at the commit to check (567632d; the machine has no
#   network: carry it), holding test_intranode.py, test_low_latency.py and utils.py; or
#   DeepEP 2.x's tests/legacy/, whose scripts import their helpers from deep_ep.utils
#   (deepepd's, python/deep_ep_compat/utils/) and need no utils.py beside them.
# Knobs: RANKS ("2 4 8"), SCRIPTS ("test_intranode.py test_low_latency.py"), RUN_S (300)
#   seconds a script may run, EXTRA_ARGS passed to every script, POOL (16GiB) the
#   daemon's pool: the rest of the GPU is the ranks' own (torch allocates beside it).
set -u
R=$(pwd); B=$(cd "${1:?BUILD_DIR}" && pwd); T=$(cd "${2:?DEEPEP_TESTS_DIR}" && pwd)
OUTD=${OUT:-/tmp/out}; mkdir -p "$OUTD"
exec > >(tee "$OUTD/deepep-one-gpu.log") 2>&1
date -u; nvidia-smi --query-gpu=name,uuid,driver_version,memory.total --format=csv,noheader
PY=$(command -v python3)
$PY -c "import sys, torch; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)"
export DEEPEP_CLIENT_LIB=$B/libdeepep-client.so.0
D=$(mktemp -d /tmp/d1g.XXXX)
printf 'socket:\n  path: %s/d.sock\nbackend: cuda\npool:\n  size_per_device: %s\n  chunk_size: 1GiB\n  host_size: 1GiB\n' \
  "$D" "${POOL:-16GiB}" > "$D/d.yaml"
setsid "$B"/deepepd -c "$D/d.yaml" > "$OUTD/deepepd.log" 2>&1 &
DPID=$!
for i in $(seq 150); do [ -S "$D/d.sock" ] && "$B"/deepepctl -s "$D/d.sock" status >/dev/null 2>&1 && break; sleep 0.2; done
"$B"/deepepctl -s "$D/d.sock" status | head -6
export DEEPEPD_SOCKET=$D/d.sock
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
mkdir -p /tmp/mps /tmp/mpslog; nvidia-cuda-mps-control -d && echo "== MPS started"
cd "$T"
for s in ${SCRIPTS:-test_intranode.py test_low_latency.py}; do
  for n in ${RANKS:-2 4 8}; do
    echo "== $s --num-processes $n"
    env -u WORLD_SIZE -u RANK MASTER_PORT=$((8361 + n)) timeout ${RUN_S:-300} $PY "$R/bench/deepep_one_gpu.py" "$s" \
      --num-processes "$n" ${EXTRA_ARGS:-} > "$OUTD/${s%.py}-$n.log" 2>&1
    echo "== $s $n ranks: rc $?"; grep -iE "passed|error|assert|GB/s|us" "$OUTD/${s%.py}-$n.log" | tail -12
  done
done
cd "$R"
echo quit | nvidia-cuda-mps-control; sleep 1; echo "== MPS stopped"
"$B"/deepepctl -s "$D/d.sock" status | head -12
kill -TERM $DPID; wait $DPID; echo "== deepepd exit $?"
