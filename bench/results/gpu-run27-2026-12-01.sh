#!/bin/bash
# device run 27 (2026-12-01, nvidia-h200, sixth session): the hardening
# issue's build (build-gpu, made here with
#   make BUILD=build-gpu STATIC_DEPS=1 all build-gpu/check_deepepd)
# against the build before the session (build-old: deepepd, deepepctl, the
# library and bench/{attach,ep} of 8934f37, the same way), on one H200:
#   1. the GPU tests on the cuda backend, time-sliced (the new ones: a rank
#      whose process ends fails its peer through the daemon's write into the
#      device slab; the abort words written by hand; the memory suite with
#      held memory), then the cuda_ops suite under MPS;
#   2. low-latency and throughput dispatch/combine, old and new alternated
#      twice under MPS: the abort polling must not move the steady state;
#   3. attach of 1 and 8 ranks, old and new alternated twice: the held file
#      and the holders must not move it either.
# Two calls, each under the device's 10 minutes: PART=tests, then PART=bench.
set -u
PART=${PART:-tests}
R=$(pwd); N=$R/build-gpu; O=$R/build-old
OUTD=${OUT:-/tmp/out}; mkdir -p $OUTD
exec > >(tee $OUTD/run27-$PART.log) 2>&1
date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
echo "== missing libraries:"; ldd $N/deepepd $N/check_deepepd $O/deepepd | grep 'not found'
if [ $PART = tests ]; then
echo "== GPU tests, new build, time-sliced"
DEP_BUILD=$N DEP_TEST_TAGS=gpu DEP_TEST_BACKEND=cuda timeout 240 $N/check_deepepd > $OUTD/check.log 2>&1
echo "== check rc $?"; grep -E "^Checks|:F:|:E:|DEP_ERR_PEER" $OUTD/check.log | head -30
fi
D=$(mktemp -d /tmp/d.XXXX)
mkd() { # name build
  printf 'socket:\n  path: %s/%s.sock\nbackend: cuda\npool:\n  size_per_device: 24GiB\n  chunk_size: 1GiB\n  host_size: 1GiB\n' $D $1 > $D/$1.yaml
  setsid $2/deepepd -c $D/$1.yaml > $OUTD/deepepd-$1.log 2>&1 &
  # ready: status answers (the old build only once its pools are made), and not "starting"
  for i in $(seq 300); do [ -S $D/$1.sock ] && st=$($2/deepepctl -s $D/$1.sock status 2>/dev/null) && ! grep -q starting <<<"$st" && break; sleep 0.2; done
}
export CUDA_VISIBLE_DEVICES=0
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog; mkdir -p /tmp/mps /tmp/mpslog; nvidia-cuda-mps-control -d
if [ $PART = tests ]; then
echo "== cuda_ops suite under MPS, new build"
DEP_BUILD=$N DEP_TEST_TAGS=gpu DEP_TEST_BACKEND=cuda CK_RUN_SUITE=cuda_ops timeout 150 $N/check_deepepd > $OUTD/check-mps.log 2>&1
echo "== check rc $?"; grep -E "^Checks|:F:|:E:|DEP_ERR_PEER" $OUTD/check-mps.log | head -20
else
echo "== cuda_ops faults under MPS, new build (the test fix after the tests part)"
DEP_BUILD=$N DEP_TEST_TAGS=gpu DEP_TEST_BACKEND=cuda CK_RUN_SUITE=cuda_ops CK_RUN_CASE=faults timeout 100 $N/check_deepepd > $OUTD/check-faults.log 2>&1
echo "== check rc $?"; grep -E "^Checks|:F:|:E:|DEP_ERR_PEER" $OUTD/check-faults.log | head -20
mkd old $O; mkd new $N
for pass in 1 2; do
  for b in old new; do
    B=$O; [ $b = new ] && B=$N
    echo "== pass $pass, $b: ep, 2 and 8 rank processes (MPS)"
    timeout 100 $B/bench/ep -s $D/$b.sock -n 2,8 -m processes -c 100 2>&1 | tail -12
    echo "== pass $pass, $b: attach 1 and 8 (MPS)"
    timeout 60 $B/bench/attach -s $D/$b.sock -n 1,8 -i 20 2>&1 | tail -3
  done
done
$N/deepepctl -s $D/new.sock status
pkill -f "$D/old.yaml"; pkill -f "$D/new.yaml"
fi
echo quit | nvidia-cuda-mps-control; sleep 1
date -u
