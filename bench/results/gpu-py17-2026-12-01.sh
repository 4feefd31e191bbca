#!/bin/bash
# Issue 17's C API additions on one H200 (HEAD 6c4b3ea + the GPU test of them in
# tests/check_cuda_ops.c): the cuda_ops suite (every kernel against the oracle, the new
# throughput_extensions_match_the_oracle: FP8 dispatch, num_worst_tokens, expert_alignment,
# cached mode, a weighted combine) under MPS, then the Python suite on CUDA tensors under MPS
# (bench/py_gpu.sh's first part: the new FP8/cached/worst tests in jobs of 1, 2, 4 and 8 and
# the worst-case throughput pair in a CUDA graph replayed 100 times).
# Built here: make BUILD=build-gpu-pyx STATIC_DEPS=1 WERROR=1 all build-gpu-pyx/check_deepepd
set -u
R=$(pwd); B=$R/build-gpu-pyx; OUTD=${OUT:-/tmp/out}; mkdir -p "$OUTD"
exec > >(tee "$OUTD/gpu-py17.log") 2>&1
date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
ldd "$B"/deepepd "$B"/check_deepepd "$B"/libdeepep-client.so.0 | grep 'not found'
export DEEPEP_CLIENT_LIB=$B/libdeepep-client.so.0 DEP_BUILD=$B CUDA_VISIBLE_DEVICES=0
D=$(mktemp -d /tmp/pyg.XXXX)
printf 'socket:\n  path: %s/d.sock\nbackend: cuda\npool:\n  size_per_device: 16GiB\n  chunk_size: 1GiB\n  host_size: 1GiB\n' "$D" > "$D/d.yaml"
setsid "$B"/deepepd -c "$D/d.yaml" > "$OUTD/deepepd.log" 2>&1 &
DPID=$!
for i in $(seq 150); do [ -S "$D/d.sock" ] && "$B"/deepepctl -s "$D/d.sock" status >/dev/null 2>&1 && break; sleep 0.2; done
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
mkdir -p /tmp/mps /tmp/mpslog; nvidia-cuda-mps-control -d && echo "== MPS started"
echo "== check_deepepd, suite cuda_ops, MPS"
DEP_TEST_TAGS=gpu DEP_TEST_BACKEND=cuda CK_RUN_SUITE=cuda_ops timeout 100 "$B"/check_deepepd \
  > "$OUTD/check-cuda-ops.log" 2>&1
echo "== check rc $?"; grep -E "^Checks|:F:|:E:|extensions" "$OUTD/check-cuda-ops.log" | head -30
echo "== pytest, cuda backend, MPS"
DEP_TEST_BACKEND=cuda DEP_TEST_SOCKET=$D/d.sock PYTHONPATH=$R/python timeout 140 \
  python3 -m pytest -p no:cacheprovider -rs -v python/tests > "$OUTD/pytest-cuda-mps.log" 2>&1
echo "== pytest rc $?"; grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed" "$OUTD/pytest-cuda-mps.log" | tail -30
echo quit | nvidia-cuda-mps-control; sleep 1
kill -TERM $DPID; wait $DPID; echo "== deepepd exit $?"
date -u
