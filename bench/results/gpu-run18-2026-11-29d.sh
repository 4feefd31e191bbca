#!/bin/bash
# device run 18 (2026-11-29, nvidia-h200-x4): the fourth session's final build.
# bench/gpu-multi.sh over 2 and 4 GPUs (GPU tests, attach, ep, NCCL), the driver's
# mapping floor (vmm_map -g 4), then one GPU under MPS: attach 1-8 ranks, ep 8 ranks.
set -u
B=$(cd "$(dirname "$0")" && pwd); R=$(cd "$B/.." && pwd)
O=/tmp/r18; mkdir -p $O
OUT_FINAL=$OUT
OUT=$O/multi RANKS=2,4 timeout 400 $R/bench/gpu-multi.sh $B > /dev/null 2>&1
exec > >(tee $O/run.log) 2>&1
grep -E "^== |Checks|^[0-9] +[0-9]|^ranks" $O/multi/gpu-multi.log | grep -v "^== .* rc 0" | head -60
echo "== 4 GPUs: the driver's mapping floor"
timeout 60 $B/bench/vmm_map -g 4 -s 450 -i 10
D=$(mktemp -d /tmp/d.XXXX)
printf 'socket:\n  path: %s/on.sock\nbackend: cuda\npool:\n  size_per_device: 24GiB\n  chunk_size: 1GiB\n  host_size: 1GiB\nkernel_warmup: true\n' $D > $D/on.yaml
printf 'socket:\n  path: %s/off.sock\nbackend: cuda\npool:\n  size_per_device: 16GiB\n  chunk_size: 1GiB\n  host_size: 1GiB\nkernel_warmup: false\n' $D > $D/off.yaml
for n in on off; do setsid $B/deepepd -c $D/$n.yaml > $O/deepepd-$n.log 2>&1 & done
for i in $(seq 150); do [ -S $D/on.sock ] && [ -S $D/off.sock ] && $B/deepepctl -s $D/off.sock status >/dev/null 2>&1 && break; sleep 0.2; done
export CUDA_VISIBLE_DEVICES=0
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog; mkdir -p /tmp/mps /tmp/mpslog; nvidia-cuda-mps-control -d
echo "== one GPU (MPS): attach"
timeout 90 $B/bench/attach -s $D/on.sock -n 1,2,4,8 -i 20 2>&1 | tail -5
echo "== one GPU (MPS): ep processes 8 ranks"
timeout 120 $B/bench/ep -s $D/on.sock -S $D/off.sock -n 8 -m processes -o $O/ep-1gpu-8.csv 2>&1 | tail -8
echo quit | nvidia-cuda-mps-control; sleep 1
pkill -f "$D/on.yaml"; pkill -f "$D/off.yaml"
date -u
tar czf $OUT_FINAL/r18.tgz -C /tmp r18
