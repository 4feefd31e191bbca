#!/bin/bash
# device run 28 (2026-12-01, nvidia-h200, sixth session): after run 27 the
# daemon identifies a rank's process when it joins instead of at the
# rendezvous (run 27's 8-rank attach was 2-6 % above the old build's).
# build-gpu (as in run 27, at the commit that does this) against build-old
# (8934f37): the memory suite on cuda, then attach of 1 and 8 ranks under
# MPS, old and new alternated three times.
set -u
R=$(pwd); N=$R/build-gpu; O=$R/build-old
OUTD=${OUT:-/tmp/out}; mkdir -p $OUTD
exec > >(tee $OUTD/run28.log) 2>&1
date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
echo "== memory suite, cuda, time-sliced"
DEP_BUILD=$N DEP_TEST_TAGS=gpu DEP_TEST_BACKEND=cuda CK_RUN_SUITE=memory timeout 150 $N/check_deepepd > $OUTD/check-memory.log 2>&1
echo "== check rc $?"; grep -E "^Checks|:F:|:E:" $OUTD/check-memory.log | head
D=$(mktemp -d /tmp/d.XXXX)
mkd() { # name build
  printf 'socket:\n  path: %s/%s.sock\nbackend: cuda\npool:\n  size_per_device: 24GiB\n  chunk_size: 1GiB\n  host_size: 1GiB\n' $D $1 > $D/$1.yaml
  setsid $2/deepepd -c $D/$1.yaml > $OUTD/deepepd-$1.log 2>&1 &
  for i in $(seq 300); do [ -S $D/$1.sock ] && st=$($2/deepepctl -s $D/$1.sock status 2>/dev/null) && ! grep -q starting <<<"$st" && break; sleep 0.2; done
}
export CUDA_VISIBLE_DEVICES=0
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog; mkdir -p /tmp/mps /tmp/mpslog; nvidia-cuda-mps-control -d
mkd old $O; mkd new $N
for pass in 1 2 3; do
  for b in old new; do
    B=$O; [ $b = new ] && B=$N
    echo "== pass $pass, $b: attach 1 and 8 (MPS)"
    timeout 60 $B/bench/attach -s $D/$b.sock -n 1,8 -i 20 2>&1 | tail -2
  done
done
pkill -f "$D/old.yaml"; pkill -f "$D/new.yaml"
echo quit | nvidia-cuda-mps-control; sleep 1
date -u
