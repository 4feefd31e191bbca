#!/bin/bash
# kcache.sh — the kernel cache on a GPU machine, in one run (issue 16):
# a PTX-only build's daemon with an empty cache (it compiles at start), with
# the cache warm (a restart), with a corrupt entry (rebuilt), and its
# trainers without the daemon's compile (the driver's JIT in every process,
# its own cache cold and warm); then a SASS build's attach for comparison.
# Build here first:
#   make BUILD=build-ptx PTX_ONLY=90 STATIC_DEPS=1 all build-ptx/check_deepepd
#   make BUILD=build-gpu4 STATIC_DEPS=1 all build-gpu4/check_deepepd
# Usage there: bench/kcache.sh PTX_BUILD [SASS_BUILD]   (logs under $OUT)
set -u
P=$(cd "$1" && pwd)
S=${2:+$(cd "$2" && pwd)}
OUT=${OUT:-/tmp/dep-out}
N=${N:-10}
mkdir -p "$OUT"
W=$(mktemp -d)
CACHE=$W/cache
mkdir -m 0755 "$CACHE"

# Start B/deepepd with kernel_cache_dir $CACHE; prints how long it took to be
# ready (status no longer "starting"), its log in $OUT/$2.log.
start() {
  local B=$1 name=$2
  cat > "$W/c.yaml" <<YAML
socket:
  path: $W/d.sock
backend: cuda
pool:
  size_per_device: 2GiB
kernel_cache_dir: $CACHE
YAML
  local t0=$(date +%s%N)
  "$B"/deepepd -c "$W/c.yaml" 2> "$OUT/$name.log" &
  DPID=$!
  for i in $(seq 600); do
    st=$("$B"/deepepctl -s "$W/d.sock" --json status 2>/dev/null | grep -o '"state": *"[a-z]*"')
    case "$st" in *ready*) break;; esac
    kill -0 $DPID 2>/dev/null || { echo "== deepepd $name exited"; cat "$OUT/$name.log"; return 1; }
    sleep 0.05
  done
  echo "== $name: daemon ready in $(( ($(date +%s%N) - t0) / 1000000 )) ms"
  grep -E "kernel cache|kernels:|warm-up" "$OUT/$name.log"
}
stop() { kill -TERM $DPID; wait $DPID; echo "== deepepd exit $?"; }

date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
echo "== PTX-only build: $P"

# 1. Empty cache: the daemon compiles once at start (the driver's own JIT
#    cache off, so that it is a real compile), every trainer gets the cubin.
CUDA_CACHE_DISABLE=1 start "$P" ptx-cold || exit 1
ls -l "$CACHE"
CUDA_CACHE_DISABLE=1 "$P"/bench/kcache -s "$W/d.sock" -i "$N" -l "ptx, daemon's compile (cache was empty at start)"
# 2. No daemon compile: each trainer process compiles the PTX (driver cache off).
DEEPEP_OWN_KERNELS=1 CUDA_CACHE_DISABLE=1 "$P"/bench/kcache -s "$W/d.sock" -i 3 -l "ptx, own JIT, driver cache off"
# 3. The same with the driver's per-user JIT cache (warmed by the first process).
export CUDA_CACHE_PATH=$W/nvcache
DEEPEP_OWN_KERNELS=1 "$P"/bench/kcache -s "$W/d.sock" -i "$N" -l "ptx, own JIT, driver cache warm after the first"
unset CUDA_CACHE_PATH
stop

# 4. Restart with the cache warm: no compile.
CUDA_CACHE_DISABLE=1 start "$P" ptx-warm || exit 1
CUDA_CACHE_DISABLE=1 "$P"/bench/kcache -s "$W/d.sock" -i "$N" -l "ptx, daemon's compile (cache warm at start)"
stop

# 5. A corrupt entry: detected, rebuilt, lent.
E=$(ls "$CACHE"/*.kcache)
printf '\xff' | dd of="$E" bs=1 seek=200 conv=notrunc 2>/dev/null
CUDA_CACHE_DISABLE=1 start "$P" ptx-corrupt || exit 1
grep -q "compiling it again" "$OUT/ptx-corrupt.log" && echo "== corrupt entry: rebuilt" || echo "== corrupt entry: NOT rebuilt"
CUDA_CACHE_DISABLE=1 "$P"/bench/kcache -s "$W/d.sock" -i 3 -l "ptx, after the rebuild"
stop

# 6. The SASS build, the target: within 10 % of its attach.
if [ -n "$S" ]; then
  CUDA_CACHE_DISABLE=1 start "$S" sass || exit 1
  CUDA_CACHE_DISABLE=1 "$S"/bench/kcache -s "$W/d.sock" -i "$N" -l "sass build"
  stop
fi
rm -rf "$W"
