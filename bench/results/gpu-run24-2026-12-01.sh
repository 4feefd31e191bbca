#!/bin/bash
# device run 24 (2026-12-01, nvidia-h200): where the error record's host page
# could come from (bench/vmm_map -H: lent by another process as a host-NUMA
# cuMemCreate granule, or pinned by cuMemHostRegister as today), 1-8
# processes at once, time-sliced and under MPS.  build-h holds bench/vmm_map
# of the commit that adds -H.
set -u
OUTD=${OUT:-/tmp/out}; mkdir -p $OUTD
exec > >(tee $OUTD/run24.log) 2>&1
date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
echo "== time-sliced"; timeout 90 build-h/vmm_map -H -n 8 -i 16
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog; mkdir -p /tmp/mps /tmp/mpslog; nvidia-cuda-mps-control -d
echo "== MPS"; timeout 90 build-h/vmm_map -H -n 8 -i 16
echo quit | nvidia-cuda-mps-control; sleep 1; date -u
