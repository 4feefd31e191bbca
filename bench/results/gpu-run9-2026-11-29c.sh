#!/bin/bash
# device run 9 (2026-11-29, nvidia-h200-x2): the third session's whole pass, run as
# build-run9/run.sh from a directory holding deepepd, deepepctl, check_deepepd,
# libdeepep-client.so* and bench/{attach,ep} built with
#   make BUILD=build-gpu STATIC_DEPS=1 all build-gpu/check_deepepd
# (its host attach step used pool.host_size 1GiB, too small for 4 ranks: rerun on the dev machine)
set -u
B=$(cd "$(dirname "$0")" && pwd); R=$(cd "$B/.." && pwd)
O=/tmp/r9; mkdir -p $O
exec > >(tee $O/run.log) 2>&1
date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nvidia-smi topo -m | head -4
D=$(mktemp -d /tmp/d.XXXX)
mkd() { # name size warmup chunk [backend]
  printf 'socket:\n  path: %s/%s.sock\nbackend: %s\npool:\n  size_per_device: %s\n  chunk_size: %s\n  host_size: %s\nkernel_warmup: %s\n' $D $1 ${5:-cuda} $2 $4 $4 $3 > $D/$1.yaml
  setsid $B/deepepd -c $D/$1.yaml > $O/deepepd-$1.log 2>&1 &
  for i in $(seq 150); do [ -S $D/$1.sock ] && $B/deepepctl -s $D/$1.sock status >/dev/null 2>&1 && break; sleep 0.2; done
}
stop() { for s in "$@"; do $B/deepepctl -s $D/$s.sock status > $O/status-$s.txt 2>&1; pkill -f "$D/$s.yaml"; done; sleep 1; }
T="DEP_BUILD=$B DEP_TEST_TAGS=gpu DEP_TEST_BACKEND=cuda"
echo "== two GPUs: full GPU suite (DEP_TEST_GPUS=all, no MPS)"
env $T DEP_TEST_GPUS=all timeout 200 $B/check_deepepd > $O/check-2gpu.log 2>&1; echo "rc $?"; grep -E "^[0-9]+%|FAIL|Error" $O/check-2gpu.log | head
mkd won 16GiB true 1GiB; mkd woff 16GiB false 1GiB
echo "== two GPUs: attach"
timeout 60 $B/bench/attach -s $D/won.sock -n 2 -g 0 -i 20 2>&1 | tail -3 | tee $O/attach-2gpu.txt
echo "== two GPUs: ep"
timeout 120 $B/bench/ep -s $D/won.sock -S $D/woff.sock -n 2 -g 0 -m processes -o $O/ep-2gpu.csv 2>&1 | tail -14 | tee $O/ep-2gpu.txt
echo "== two GPUs: nccl"
timeout 150 python3 $R/bench/nccl_a2a.py -n 2 -o $O/nccl-2gpu.csv 2>&1 | tail -12 | tee $O/nccl-2gpu.txt
stop won woff
export CUDA_VISIBLE_DEVICES=0
echo "== one GPU: memory suite (no MPS)"
env $T CK_RUN_SUITE=memory timeout 150 $B/check_deepepd > $O/check-1gpu-mem.log 2>&1; echo "rc $?"; grep -E "^[0-9]+%|FAIL|Error" $O/check-1gpu-mem.log | head
echo "== one GPU: cuda_ops (no MPS: processes time-slice, so this ran out of time; see run 10)"
env $T CUDA_DEVICE_MAX_CONNECTIONS=32 CK_RUN_SUITE=cuda_ops timeout 150 $B/check_deepepd > $O/check-1gpu-nomps.log 2>&1; echo "rc $?"
mkd on 48GiB true 1GiB; mkd off 16GiB false 1GiB; mkd host 1GiB true 1GiB host
echo "== one GPU: ep threads (no MPS)"
CUDA_DEVICE_MAX_CONNECTIONS=32 timeout 100 $B/bench/ep -s $D/on.sock -S $D/off.sock -n 2,4,8 -m threads -o $O/ep-1gpu-thr.csv 2>&1 | tail -19 | tee $O/ep-1gpu-thr.txt
echo "== host backend: attach 1,2,4,8"
timeout 60 $B/bench/attach -s $D/host.sock -n 1,2,4,8 -i 20 2>&1 | tail -6 | tee $O/attach-host.txt
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog; mkdir -p /tmp/mps /tmp/mpslog; nvidia-cuda-mps-control -d
echo "== one GPU: cuda_ops (MPS)"
env $T CK_RUN_SUITE=cuda_ops timeout 150 $B/check_deepepd > $O/check-1gpu.log 2>&1; echo "rc $?"; grep -E "^[0-9]+%|FAIL|Error" $O/check-1gpu.log | head
echo "== one GPU: attach 1,2,4,8 (MPS)"
timeout 90 $B/bench/attach -s $D/on.sock -n 1,2,4,8 -i 20 2>&1 | tail -6 | tee $O/attach-1gpu.txt
echo "== one GPU: ep processes (MPS)"
timeout 150 $B/bench/ep -s $D/on.sock -S $D/off.sock -n 2,4,8 -m processes -o $O/ep-1gpu-proc.csv 2>&1 | tail -24 | tee $O/ep-1gpu-proc.txt
echo quit | nvidia-cuda-mps-control; sleep 1
stop on off host
date -u
tar czf $OUT/r9.tgz -C /tmp r9
