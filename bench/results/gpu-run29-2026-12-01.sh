#!/bin/bash
# device run 29 (2026-12-01, nvidia-h200, sixth session): the session's last
# code (the link reshape, lending out of job.c, the peer layer and
# multi-node membership), built here with
#   make BUILD=build-gpu STATIC_DEPS=1 all build-gpu/check_deepepd
# the GPU tests on the cuda backend, time-sliced, then cuda_ops under MPS.
set -u
R=$(pwd); N=$R/build-gpu
OUTD=${OUT:-/tmp/out}; mkdir -p $OUTD
exec > >(tee $OUTD/run29.log) 2>&1
date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
echo "== missing libraries:"; ldd $N/deepepd $N/check_deepepd | grep 'not found'
echo "== GPU tests, time-sliced"
DEP_BUILD=$N DEP_TEST_TAGS=gpu DEP_TEST_BACKEND=cuda timeout 240 $N/check_deepepd > $OUTD/check.log 2>&1
echo "== check rc $?"; grep -E "^Checks|:F:|:E:|DEP_ERR_PEER" $OUTD/check.log | head -30
export CUDA_VISIBLE_DEVICES=0
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog; mkdir -p /tmp/mps /tmp/mpslog; nvidia-cuda-mps-control -d
echo "== cuda_ops under MPS"
DEP_BUILD=$N DEP_TEST_TAGS=gpu DEP_TEST_BACKEND=cuda CK_RUN_SUITE=cuda_ops timeout 150 $N/check_deepepd > $OUTD/check-mps.log 2>&1
echo "== check rc $?"; grep -E "^Checks|:F:|:E:" $OUTD/check-mps.log | head -20
echo quit | nvidia-cuda-mps-control; sleep 1
date -u
