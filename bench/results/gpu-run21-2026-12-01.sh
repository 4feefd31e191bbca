#!/bin/bash
# device run 21 (2026-12-01, nvidia-h200): the client's set-up on a thread of
# its own beside the map (build-r21) against the build before it (build-base,
# commit 80cb379: set-up, then map), alternated twice against one daemon, one
# GPU under MPS; the GPU tests on the new build (time-sliced); vmm_map (the
# driver's own floor for mapping the 8-rank arena, in the same run); bench/ep.
# Run from the repository root with build-r21 and build-base carried.
set -u
R=$(pwd); N=$R/build-r21
OUTD=${OUT:-/tmp/out}; mkdir -p $OUTD
exec > >(tee $OUTD/run21.log) 2>&1
date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
echo "== missing libraries (none expected):"
ldd $N/deepepd $N/check_deepepd $N/bench/attach $R/build-base/bench/attach | grep 'not found'
echo "== GPU tests, new build, time-sliced"
DEP_BUILD=$N DEP_TEST_TAGS=gpu DEP_TEST_BACKEND=cuda timeout 200 $N/check_deepepd > $OUTD/check.log 2>&1
echo "== check rc $?"; grep -E "Checks|:F:|:E:" $OUTD/check.log | head -20
D=$(mktemp -d /tmp/d.XXXX)
printf 'socket:\n  path: %s/on.sock\nbackend: cuda\npool:\n  size_per_device: 24GiB\n  chunk_size: 1GiB\n  host_size: 1GiB\n' $D > $D/on.yaml
setsid $N/deepepd -c $D/on.yaml > $OUTD/deepepd.log 2>&1 &
for i in $(seq 150); do [ -S $D/on.sock ] && $N/deepepctl -s $D/on.sock status >/dev/null 2>&1 && break; sleep 0.2; done
export CUDA_VISIBLE_DEVICES=0
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog; mkdir -p /tmp/mps /tmp/mpslog; nvidia-cuda-mps-control -d
for pass in 1 2; do for b in base r21; do
  echo "== one GPU (MPS): attach, build-$b, pass $pass"
  timeout 60 $R/build-$b/bench/attach -s $D/on.sock -n 1,2,4,8 -i 20 2>&1 | tail -5
done; done
echo "== the driver floor: vmm_map, 8 processes, 902 MiB slabs (MPS)"
timeout 120 $N/bench/vmm_map -n 8 -s 902 -i 15 2>&1 | tail -12
echo "== one GPU (MPS): ep processes 8 ranks, new build"
timeout 150 $N/bench/ep -s $D/on.sock -n 8 -m processes -o $OUTD/ep-1gpu-8.csv 2>&1 | tail -8
echo quit | nvidia-cuda-mps-control; sleep 1
$N/deepepctl -s $D/on.sock status
pkill -f "$D/on.yaml"
date -u
