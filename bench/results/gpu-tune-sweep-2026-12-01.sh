#!/bin/bash
# The SM budget by hand (issue 16, before adaptive tuning existed): bench/ep's
# shape at 2, 4 and 8 ranks as processes on GPU 0 under MPS, with
# DEEPEP_KERNEL_CTAS at several values and unset (the default), one daemon.
# Usage there: bash bench/results/gpu-tune-sweep-2026-12-01.sh BUILD_DIR
set -u
B=$(cd "$1" && pwd)
OUT=${OUT:-/tmp/dep-out}
mkdir -p "$OUT"
exec > >(tee "$OUT/tune-sweep.log") 2>&1
date -u; nvidia-smi --query-gpu=name,uuid,driver_version --format=csv,noheader
ldd "$B"/deepepd "$B"/bench/ep | grep 'not found'
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
nvidia-cuda-mps-control -d && echo "MPS started"
D=$(mktemp -d)
cat > "$D/c.yaml" <<YAML
socket:
  path: $D/d.sock
backend: cuda
pool:
  size_per_device: 24GiB
  host_size: 1GiB
  chunk_size: 1GiB
kernel_warmup: true
YAML
# The daemon outside MPS (DEVICE.md: memory it makes maps in MPS clients).
env -u CUDA_MPS_PIPE_DIRECTORY "$B"/deepepd -c "$D/c.yaml" 2> "$OUT/deepepd-sweep.log" &
DPID=$!
for i in $(seq 300); do "$B"/deepepctl -s "$D/d.sock" status >/dev/null 2>&1 && break; sleep 0.2; done
run() { # N CTAS
  echo "== n $1 ctas ${2:-default}"
  if [ -n "$2" ]; then
    DEEPEP_KERNEL_CTAS=$2 timeout 60 "$B"/bench/ep -s "$D/d.sock" -n $1 -m processes -c 60 -w 5 -r 3
  else
    timeout 60 "$B"/bench/ep -s "$D/d.sock" -n $1 -m processes -c 60 -w 5 -r 3
  fi
}
run 8 ""; run 8 8; run 8 24; run 8 32; run 8 ""
run 4 ""; run 4 16; run 4 48; run 4 64; run 4 ""
run 2 ""; run 2 32; run 2 96; run 2 132; run 2 ""
kill -TERM $DPID; wait $DPID; echo "== deepepd exit $?"
echo quit | nvidia-cuda-mps-control
date -u
