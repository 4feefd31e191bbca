#!/bin/bash
# device run 23 (2026-12-01, nvidia-h200): the session's final build
# (build-r23, commit 32967a2: the slab's private area, dep_client_free's
# order, the primary context given back).  The GPU tests; the leak test once
# more against a test binary whose library never gives the primary context
# back (build-broken, made for this run only: it must fail); then one GPU
# under MPS: attach 1-8 ranks, 8 ranks 20 ms apart, and the driver's floor
# (map, and map with the kernels' module load) in the same run.
# Run from the repository root with build-r23 and build-broken carried.
set -u
R=$(pwd); N=$R/build-r23
OUTD=${OUT:-/tmp/out}; mkdir -p $OUTD
exec > >(tee $OUTD/run23.log) 2>&1
date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
echo "== missing libraries (none expected):"
ldd $N/deepepd $N/check_deepepd $N/bench/attach $R/build-broken/check_deepepd | grep 'not found'
echo "== GPU tests, final build, time-sliced"
DEP_BUILD=$N DEP_TEST_TAGS=gpu DEP_TEST_BACKEND=cuda timeout 200 $N/check_deepepd > $OUTD/check.log 2>&1
echo "== check rc $?"; grep -E "Checks|:F:|:E:" $OUTD/check.log | head -20
echo "== the leak test against a library that keeps the primary context (must fail)"
DEP_BUILD=$N DEP_TEST_TAGS=gpu DEP_TEST_BACKEND=cuda CK_RUN_SUITE=memory CK_RUN_CASE=leaks timeout 120 $R/build-broken/check_deepepd 2>&1 | grep -E "Checks|:F:|:E:|primary"
D=$(mktemp -d /tmp/d.XXXX)
printf 'socket:\n  path: %s/on.sock\nbackend: cuda\npool:\n  size_per_device: 24GiB\n  chunk_size: 1GiB\n  host_size: 1GiB\n' $D > $D/on.yaml
setsid $N/deepepd -c $D/on.yaml > $OUTD/deepepd.log 2>&1 &
for i in $(seq 150); do [ -S $D/on.sock ] && $N/deepepctl -s $D/on.sock status >/dev/null 2>&1 && break; sleep 0.2; done
export CUDA_VISIBLE_DEVICES=0
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog; mkdir -p /tmp/mps /tmp/mpslog; nvidia-cuda-mps-control -d
for pass in 1 2; do
  echo "== one GPU (MPS): attach, pass $pass"
  timeout 60 $N/bench/attach -s $D/on.sock -n 1,2,4,8 -i 20 2>&1 | tail -5
  echo "== one GPU (MPS): 8 ranks started 20 ms apart, pass $pass"
  timeout 60 $N/bench/attach -s $D/on.sock -n 8 -d 20 -i 10 2>&1 | tail -1
  echo "== the driver's floor, 8 processes, 904 MiB slabs (MPS): map; map and load the kernels, pass $pass"
  timeout 60 $N/bench/vmm_map -n 8 -s 904 -i 15 2>&1 | tail -1
  timeout 60 $N/bench/vmm_map -n 8 -s 904 -i 15 -m 2>&1 | tail -1
done
echo quit | nvidia-cuda-mps-control; sleep 1
$N/deepepctl -s $D/on.sock status
pkill -f "$D/on.yaml"
date -u
