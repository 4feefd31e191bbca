#!/bin/bash
# device run 25 (2026-12-01, nvidia-h200): the final build (build-r25) and
# the floors of attach on one GPU in the same run, alternated twice, under
# MPS: deepepd's attach of 1 and 8 rank processes; what the driver takes to
# give 8 processes the job's memory and the kernels (vmm_map -m) and a
# host-visible page each (vmm_map -H: the error record's cheapest form).
set -u
R=$(pwd); N=$R/build-r25
OUTD=${OUT:-/tmp/out}; mkdir -p $OUTD
exec > >(tee $OUTD/run25.log) 2>&1
date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
echo "== GPU tests, final build, time-sliced"
DEP_BUILD=$N DEP_TEST_TAGS=gpu DEP_TEST_BACKEND=cuda timeout 200 $N/check_deepepd > $OUTD/check.log 2>&1
echo "== check rc $?"; grep -E "Checks|:F:|:E:" $OUTD/check.log | head -20
D=$(mktemp -d /tmp/d.XXXX)
printf 'socket:\n  path: %s/on.sock\nbackend: cuda\npool:\n  size_per_device: 24GiB\n  chunk_size: 1GiB\n  host_size: 1GiB\n' $D > $D/on.yaml
setsid $N/deepepd -c $D/on.yaml > $OUTD/deepepd.log 2>&1 &
for i in $(seq 150); do [ -S $D/on.sock ] && $N/deepepctl -s $D/on.sock status >/dev/null 2>&1 && break; sleep 0.2; done
export CUDA_VISIBLE_DEVICES=0
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog; mkdir -p /tmp/mps /tmp/mpslog; nvidia-cuda-mps-control -d
for pass in 1 2; do
  echo "== pass $pass: attach (MPS)"
  timeout 60 $N/bench/attach -s $D/on.sock -n 1,8 -i 20 2>&1 | tail -3
  echo "== pass $pass: 8 ranks started 20 ms apart"
  timeout 60 $N/bench/attach -s $D/on.sock -n 8 -d 20 -i 10 2>&1 | tail -1
  echo "== pass $pass: floor, memory and kernels (vmm_map -n 8 -s 904 -m)"
  timeout 60 $N/bench/vmm_map -n 8 -s 904 -i 15 -m 2>&1 | tail -1
  echo "== pass $pass: floor, a host-visible page (vmm_map -H -n 8)"
  timeout 60 $N/bench/vmm_map -H -n 8 -i 16 2>&1 | tail -2
done
echo quit | nvidia-cuda-mps-control; sleep 1
pkill -f "$D/on.yaml"
date -u
