#!/bin/bash
# device run 22 (2026-12-01, nvidia-h200): the slab's private area (protocol
# 2: the library's operation memory and the warm-up's handle lent in the
# slab, no cuMemAlloc at attach; build-r22, commit 3a536de + vmm_map -m/-q)
# against the build before it (build-base, commit 80cb379, with its own
# daemon: the protocols differ), alternated twice, one GPU under MPS, and
# once time-sliced; the driver's floor for the 8-rank arena with and without
# the kernels' module load (vmm_map -m); whether the driver maps part of an
# allocation (vmm_map -q); the GPU tests and bench/ep on the new build.
# Run from the repository root with build-r22 and build-base carried.
set -u
R=$(pwd); N=$R/build-r22; B=$R/build-base
OUTD=${OUT:-/tmp/out}; mkdir -p $OUTD
exec > >(tee $OUTD/run22.log) 2>&1
date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
echo "== missing libraries (none expected):"
ldd $N/deepepd $N/check_deepepd $N/bench/attach $B/bench/attach $B/deepepd | grep 'not found'
echo "== GPU tests, new build, time-sliced"
DEP_BUILD=$N DEP_TEST_TAGS=gpu DEP_TEST_BACKEND=cuda timeout 200 $N/check_deepepd > $OUTD/check.log 2>&1
echo "== check rc $?"; grep -E "Checks|:F:|:E:" $OUTD/check.log | head -20
echo "== partial maps"; timeout 30 $N/bench/vmm_map -q
D=$(mktemp -d /tmp/d.XXXX)
for b in base r22; do
printf 'socket:\n  path: %s/%s.sock\nbackend: cuda\npool:\n  size_per_device: 24GiB\n  chunk_size: 1GiB\n  host_size: 1GiB\n' $D $b > $D/$b.yaml
done
setsid $B/deepepd -c $D/base.yaml > $OUTD/deepepd-base.log 2>&1 &
setsid $N/deepepd -c $D/r22.yaml > $OUTD/deepepd-r22.log 2>&1 &
for i in $(seq 150); do [ -S $D/base.sock ] && [ -S $D/r22.sock ] && $N/deepepctl -s $D/r22.sock status >/dev/null 2>&1 && $B/deepepctl -s $D/base.sock status >/dev/null 2>&1 && break; sleep 0.2; done
export CUDA_VISIBLE_DEVICES=0
for b in base r22; do
  echo "== one GPU, time-sliced: attach, build-$b"
  timeout 60 $R/build-$b/bench/attach -s $D/$b.sock -n 1,8 -i 10 2>&1 | tail -3
done
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog; mkdir -p /tmp/mps /tmp/mpslog; nvidia-cuda-mps-control -d
for pass in 1 2; do for b in base r22; do
  echo "== one GPU (MPS): attach, build-$b, pass $pass"
  timeout 60 $R/build-$b/bench/attach -s $D/$b.sock -n 1,2,4,8 -i 20 2>&1 | tail -5
done; done
echo "== one GPU (MPS): attach, build-r22, 8 ranks started 20 ms apart"
timeout 60 $N/bench/attach -s $D/r22.sock -n 8 -d 20 -i 10 2>&1 | tail -2
echo "== the driver's floor, 8 processes, 904 MiB slabs (MPS): map, then map and load the kernels"
timeout 60 $N/bench/vmm_map -n 8 -s 904 -i 15 2>&1 | tail -3
timeout 60 $N/bench/vmm_map -n 8 -s 904 -i 15 -m 2>&1 | tail -3
echo "== one GPU (MPS): ep processes 8 ranks, new build"
timeout 150 $N/bench/ep -s $D/r22.sock -n 8 -m processes -o $OUTD/ep-1gpu-8.csv 2>&1 | tail -8
echo quit | nvidia-cuda-mps-control; sleep 1
$N/deepepctl -s $D/r22.sock status
pkill -f "$D/base.yaml"; pkill -f "$D/r22.yaml"
date -u
