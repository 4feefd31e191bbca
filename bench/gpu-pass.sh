#!/bin/bash
# gpu-pass.sh — one whole pass on the GPU machine (DEVICE.md): the GPU tests
# and the attach benchmark on the cuda backend, logs under $OUT.
# Build here first with: make BUILD=build-gpu STATIC_DEPS=1 all build-gpu/check_deepepd
# Usage there: bench/gpu-pass.sh [BUILD_DIR]
set -u
B=$(cd "${1:-build-gpu}" && pwd)
OUT=${OUT:-/tmp/dep-out}
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu-pass.log") 2>&1
date -u; nvidia-smi --query-gpu=name,uuid,driver_version,memory.total --format=csv
echo "== missing libraries:"; ldd "$B"/deepepd "$B"/check_deepepd "$B"/bench/attach | grep 'not found'
echo "== make check-gpu (GPU-tagged tests, cuda backend)"
DEP_BUILD=$B DEP_TEST_TAGS=gpu DEP_TEST_BACKEND=cuda timeout 300 "$B"/check_deepepd
echo "== check rc $?"
# One daemon per chunk size: fewer, larger chunks mean fewer imports and maps
# per attach; the table shows what that is worth.
for CHUNK in ${CHUNKS:-64MiB 256MiB 1GiB}; do
D=$(mktemp -d)
cat > "$D/c.yaml" <<YAML
socket:
  path: $D/d.sock
backend: cuda
pool:
  size_per_device: 16GiB
  host_size: $CHUNK
  chunk_size: $CHUNK
YAML
"$B"/deepepd -c "$D/c.yaml" 2> "$OUT/deepepd-cuda-$CHUNK.log" &
DPID=$!
for i in $(seq 100); do [ -S "$D/d.sock" ] && "$B"/deepepctl -s "$D/d.sock" status >/dev/null 2>&1 && break; sleep 0.2; done
echo "== bench/attach, cuda backend, pool.chunk_size $CHUNK"
timeout 200 "$B"/bench/attach -s "$D/d.sock" -n ${RANKS:-1,2,4,8} -i 20 | tee "$OUT/attach-cuda-$CHUNK.txt"
"$B"/deepepctl -s "$D/d.sock" status
kill -TERM $DPID; wait $DPID; echo "== deepepd exit $?"
done
