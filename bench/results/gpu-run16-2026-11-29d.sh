#!/bin/bash
# device run 16 (2026-11-29, nvidia-h200-x4): the client's setup as one device block
# (new) against the committed build (old, run 12), across 4 GPUs and on one GPU under
# MPS; setup sub-steps from a traced build; the cuda_ops suite across 4 GPUs.
set -u
B=$(cd "$(dirname "$0")" && pwd); R=$(cd "$B/.." && pwd); N=$B/new
O=/tmp/r16; mkdir -p $O
exec > >(tee $O/run.log) 2>&1
date -u
D=$(mktemp -d /tmp/d.XXXX)
mkd() { # name size warmup
  printf 'socket:\n  path: %s/%s.sock\nbackend: cuda\npool:\n  size_per_device: %s\n  chunk_size: 1GiB\n  host_size: 1GiB\nkernel_warmup: %s\n' $D $1 $2 $3 > $D/$1.yaml
  setsid $N/deepepd -c $D/$1.yaml > $O/deepepd-$1.log 2>&1 &
  for i in $(seq 150); do [ -S $D/$1.sock ] && $N/deepepctl -s $D/$1.sock status >/dev/null 2>&1 && break; sleep 0.2; done
}
T="DEP_BUILD=$N DEP_TEST_TAGS=gpu DEP_TEST_BACKEND=cuda"
echo "== 4 GPUs: cuda_ops suite (new)"
env $T DEP_TEST_GPUS=all CK_RUN_SUITE=cuda_ops timeout 200 $N/check_deepepd > $O/check-4gpu-cuops.log 2>&1; echo "rc $?"; grep -E "^[0-9]+%|FAIL|Error" $O/check-4gpu-cuops.log | head
mkd on 24GiB true; mkd off 16GiB false
for v in old new old new; do
  echo "== 4 GPUs: attach $v"
  timeout 60 $B/$v/bench/attach -s $D/on.sock -n 2,4 -g 0 -i 20 2>&1 | tail -3
done
echo "== 4 GPUs: ep new, default CTAs then 132"
timeout 90 $N/bench/ep -s $D/on.sock -S $D/off.sock -n 4 -g 0 -m processes -o $O/ep-4gpu.csv 2>&1 | tail -8
DEEPEP_KERNEL_CTAS=132 timeout 90 $N/bench/ep -s $D/on.sock -S $D/off.sock -n 4 -g 0 -m processes -o $O/ep-4gpu-132.csv 2>&1 | tail -7
export CUDA_VISIBLE_DEVICES=0
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog; mkdir -p /tmp/mps /tmp/mpslog; nvidia-cuda-mps-control -d
for v in old new old new; do
  echo "== one GPU (MPS): attach $v"
  timeout 60 $B/$v/bench/attach -s $D/on.sock -n 1,8 -i 20 2>&1 | tail -3
done
echo "== one GPU (MPS): traced setup"
DEP_TRACE_SETUP=1 timeout 60 $B/trace/bench/attach -s $D/on.sock -n 1,8 -i 5 > $O/trace.log 2>&1
grep trace $O/trace.log | tail -12
echo quit | nvidia-cuda-mps-control; sleep 1
pkill -f "$D/on.yaml"; pkill -f "$D/off.yaml"
date -u
tar czf $OUT/r16.tgz -C /tmp r16
