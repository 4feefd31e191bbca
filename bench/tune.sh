#!/bin/bash
# tune.sh — adaptive_optimization against the default SM budget (issue 16), on
# the GPU machine: bench/ep's shape at 8, 4 and 2 ranks (RANKS) as processes on
# GPU 0 under MPS.  One daemon with adaptive_optimization
# on ("on"), one with it off ("off", the default budget), same pools.  Round 1:
# one world per rank count on "on" (each a new key: the default, queued), then
# the daemon measures the keys while idle (its log says what it chose).
# Round 2: "on" (the table's choice) and "off" alternated twice per rank count.
# Build here first with: make BUILD=build-gpu STATIC_DEPS=1 all
# Usage there: bench/tune.sh BUILD_DIR (logs under $OUT)
set -u
B=$(cd "$1" && pwd)
OUT=${OUT:-/tmp/dep-out}
mkdir -p "$OUT"
exec > >(tee "$OUT/tune.log") 2>&1
date -u; nvidia-smi --query-gpu=name,uuid,driver_version --format=csv,noheader
ldd "$B"/deepepd "$B"/bench/ep | grep 'not found'
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
nvidia-cuda-mps-control -d && echo "MPS started"
D=$(mktemp -d); mkdir -m 0755 "$D/cache"
for n in on off; do
cat > "$D/$n.yaml" <<YAML
socket:
  path: $D/$n.sock
backend: cuda
pool:
  size_per_device: 24GiB
  host_size: 1GiB
  chunk_size: 1GiB
kernel_warmup: true
kernel_cache_dir: $D/cache
adaptive_optimization: $([ $n = on ] && echo true || echo false)
YAML
done
# The daemons outside MPS (DEVICE.md); so is the measurement child (ranks as threads).
env -u CUDA_MPS_PIPE_DIRECTORY "$B"/deepepd -c "$D/on.yaml" 2> "$OUT/deepepd-on.log" &
P1=$!
env -u CUDA_MPS_PIPE_DIRECTORY "$B"/deepepd -c "$D/off.yaml" 2> "$OUT/deepepd-off.log" &
P2=$!
ready() { # SOCK: until its status answers and no longer says starting (60 s at most)
  local i o
  for i in $(seq 300); do
    o=$("$B"/deepepctl -s "$1" status 2>/dev/null) && ! grep -qi starting <<<"$o" && return 0
    sleep 0.2
  done
}
ready "$D/on.sock"; ready "$D/off.sock"
ep() { # SOCK N TAG
  echo "== $3 n $2"
  timeout 90 "$B"/bench/ep -s "$D/$1.sock" -n $2 -m processes -c 60 -w 5 -r 3 | grep -E '^[248] '
}
T0=$(date +%s)
RANKS=${RANKS:-8 4 2}
NKEYS=$(wc -w <<<"$RANKS")
for n in $RANKS; do ep on $n first; done
# Until every key is measured (or 150 s).
for i in $(seq 150); do
  [ "$(grep -c 'CTAs per rank' "$OUT/deepepd-on.log")" -ge "$NKEYS" ] && break
  grep -q 'failed after' "$OUT/deepepd-on.log" && break
  sleep 1
done
echo "== measured after $(( $(date +%s) - T0 )) s:"; grep 'tuning' "$OUT/deepepd-on.log"
ls -l "$D/cache"
for pass in 1 2; do
  for n in $RANKS; do ep on $n "on pass $pass"; ep off $n "off pass $pass"; done
done
grep 'tuning' "$OUT/deepepd-on.log" | tail -5
# What deepepctl stats says each rank of the last "on" worlds ran with, and why.
"$B"/deepepctl -s "$D/on.sock" stats | sed -n '/^ranks:/,/^pools:/p'
"$B"/deepepctl -s "$D/off.sock" stats | sed -n '/^ranks:/,/^pools:/p' | head -4
# A restart reads the table back.
kill -TERM $P1; wait $P1
env -u CUDA_MPS_PIPE_DIRECTORY "$B"/deepepd -c "$D/on.yaml" 2> "$OUT/deepepd-on2.log" &
P1=$!
ready "$D/on.sock"
grep 'tuning table' "$OUT/deepepd-on2.log"
kill -TERM $P1 $P2; wait $P1 $P2; echo "== deepepd exit $?"
echo quit | nvidia-cuda-mps-control
date -u
