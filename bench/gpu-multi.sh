#!/bin/bash
# gpu-multi.sh — one whole pass on a machine with several GPUs (issue 5,
# DEVICE.md): the GPU tests with one rank per GPU, bench/attach and bench/ep
# across GPUs, and NCCL's all_to_all_single moving the same bytes per rank in
# the same run (bench/nccl_a2a.py), and the driver's own cost of mapping the
# peers' memory (bench/vmm_map -g).  Logs under $OUT, one file per step.
# Build here first with: make BUILD=build-gpu STATIC_DEPS=1 all build-gpu/check_deepepd
# Usage there: bench/gpu-multi.sh [BUILD_DIR]
# Knobs: OUT (default /tmp/dep-out); RANKS (rank counts, default 2,4,8 up to the
# GPU count); SKIP_TESTS=1 (no GPU tests); PYTHON (default python3).
# Every step runs under timeout and a failing step does not stop the pass.
# One rank per GPU, so no MPS.
set -u
B=$(cd "${1:-build-gpu}" && pwd) || exit 2
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-/tmp/dep-out}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu-multi.log") 2>&1

# step NAME SECONDS CMD...: CMD under timeout, its output in $OUT/NAME.log too.
step() {
  local name=$1 secs=$2 rc
  shift 2
  echo "== $name: $*"
  timeout "$secs" "$@" 2>&1 | tee "$OUT/$name.log"
  rc=${PIPESTATUS[0]}
  if [ "$rc" = 124 ]; then
    echo "== $name rc $rc (timed out after ${secs}s)"
  else
    echo "== $name rc $rc"
  fi
}

# has_gpu_flag PROG: PROG's usage offers -g (which GPUs the ranks use).
has_gpu_flag() {
  "$1" -h 2>&1 | grep -q -e '-g'
}

D=$(mktemp -d /tmp/dep-multi.XXXXXX)
WARM_PID="" COLD_PID=""

# start_daemon NAME WARMUP: a cuda daemon on $D/NAME.sock, its pid in
# DAEMON_PID (not printed: a daemon started inside $(...) would keep the
# substitution open and not be this shell's child to wait for).
start_daemon() {
  cat > "$D/$1.yaml" <<YAML
socket:
  path: $D/$1.sock
backend: cuda
pool:
  size_per_device: 16GiB
  host_size: 1GiB
  chunk_size: 1GiB
kernel_warmup: $2
YAML
  "$B"/deepepd -c "$D/$1.yaml" 2> "$OUT/deepepd-$1.log" &
  DAEMON_PID=$!
}

# wait_ready PID SOCK: up to 60 s for the daemon to answer status.
wait_ready() {
  local _
  for _ in $(seq 300); do
    kill -0 "$1" 2>/dev/null || { echo "== deepepd $1 exited before it was ready"; return 1; }
    [ -S "$2" ] && "$B"/deepepctl -s "$2" status >/dev/null 2>&1 && return 0
    sleep 0.2
  done
  echo "== deepepd $1 not ready on $2 after 60 s"
  return 1
}

# Daemons this script started are stopped however it ends.
cleanup() {
  local p
  for p in $WARM_PID $COLD_PID; do kill -TERM "$p" 2>/dev/null; done
  rm -rf "$D"
}
trap cleanup EXIT

# ---- a. the machine ----------------------------------------------------------
date -u
nvidia-smi --query-gpu=index,name,uuid,driver_version,memory.total --format=csv
step gpus 30 nvidia-smi -L
step topo 30 nvidia-smi topo -m
echo "== missing libraries (none expected):"
ldd "$B"/deepepd "$B"/deepepctl "$B"/check_deepepd "$B"/bench/attach "$B"/bench/ep \
  | grep 'not found' | tee "$OUT/ldd-missing.log"
NG=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
LIST=""
for n in 2 4 8; do
  [ "$n" -le "$NG" ] && LIST=${LIST:+$LIST,}$n
done
LIST=${RANKS:-$LIST}
echo "== $NG GPUs; rank counts: ${LIST:-none}"

# ---- b. GPU tests, rank r on GPU r % NG --------------------------------------
if [ "${SKIP_TESTS:-0}" = 1 ]; then
  echo "== check skipped (SKIP_TESTS=1)"
else
  step check 300 env DEP_BUILD="$B" DEP_TEST_TAGS=gpu DEP_TEST_BACKEND=cuda \
    DEP_TEST_GPUS=all "$B"/check_deepepd
fi

if [ -z "$LIST" ]; then
  echo "== fewer than 2 GPUs: nothing to run across GPUs"
  exit 0
fi

# ---- c. deepepd across GPUs: attach, then dispatch/combine -------------------
# Two daemons, as for the single-GPU figures in BENCHMARKS.md: bench/ep times
# first calls against both, with kernel warm-up on and off.
start_daemon warm true
WARM_PID=$DAEMON_PID
start_daemon cold false
COLD_PID=$DAEMON_PID
if wait_ready "$WARM_PID" "$D/warm.sock" && wait_ready "$COLD_PID" "$D/cold.sock"; then
  # -g 0: rank r on GPU r (every GPU); a build without -g cannot spread ranks.
  if has_gpu_flag "$B"/bench/attach; then
    step attach 200 "$B"/bench/attach -s "$D/warm.sock" -n "$LIST" -g 0 -i 20
    # Ranks starting 20 ms apart, as a restart's processes do (-d).
    step attach-stagger 200 "$B"/bench/attach -s "$D/warm.sock" -n "$LIST" -g 0 -i 10 -d 20
  else
    echo "== attach skipped: $B/bench/attach has no -g; rebuild from a tree that has it"
  fi
  if has_gpu_flag "$B"/bench/ep; then
    step ep 300 "$B"/bench/ep -s "$D/warm.sock" -S "$D/cold.sock" -n "$LIST" -g 0 \
      -m processes -o "$OUT/ep-multi.csv"
    # First calls again, each op's outputs rewritten just before (-T): the
    # library's own first-call cost, without the first walk of the caller's pages.
    step ep-retouch 200 "$B"/bench/ep -s "$D/warm.sock" -n "$LIST" -g 0 -m processes -F -T
  else
    echo "== ep skipped: $B/bench/ep has no -g; rebuild from a tree that has it"
  fi
else
  echo "== attach and ep skipped: a daemon did not start (see $OUT/deepepd-*.log)"
fi

# ---- c2. the driver's floor for attach across GPUs (no daemon) ----------------
# One arena per GPU mapped by one process per GPU: as is, and with every peer
# GPU mapped once before the clock (-w), so that attach's map phase can be
# read against what the driver charges per (process, peer GPU) pair.
if [ -x "$B"/bench/vmm_map ]; then
  NMAX=${LIST##*,}
  step vmm 120 "$B"/bench/vmm_map -g "$NMAX" -s 450 -i 8
  step vmm-warm 120 "$B"/bench/vmm_map -g "$NMAX" -s 450 -i 8 -w
fi

# ---- d. NCCL's all-to-all, same bytes per rank, same GPUs ---------------------
step nccl 300 "$PYTHON" "$HERE/nccl_a2a.py" -n "$LIST" -o "$OUT/nccl.csv"

# ---- e. the daemons' view, then stop them --------------------------------------
for name in warm cold; do
  if [ "$name" = warm ]; then pid=$WARM_PID; else pid=$COLD_PID; fi
  step "status-$name" 30 "$B"/deepepctl -s "$D/$name.sock" status
  kill -TERM "$pid" 2>/dev/null
  wait "$pid"
  echo "== deepepd $name exit $?"
done
WARM_PID="" COLD_PID=""
