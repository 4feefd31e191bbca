#!/bin/bash
# device run 17 (2026-11-29, nvidia-h200-x4): the error record pinned with
# cuMemHostRegister (new) against cuMemHostAlloc (DEP_EXP_HOSTALLOC=1, traced build),
# eager against lazy module loading; GPU tests of the new build on one GPU (MPS).
set -u
B=$(cd "$(dirname "$0")" && pwd); N=$B/new
O=/tmp/r17; mkdir -p $O
exec > >(tee $O/run.log) 2>&1
date -u
D=$(mktemp -d /tmp/d.XXXX)
mkd() { # name size warmup
  printf 'socket:\n  path: %s/%s.sock\nbackend: cuda\npool:\n  size_per_device: %s\n  chunk_size: 1GiB\n  host_size: 1GiB\nkernel_warmup: %s\n' $D $1 $2 $3 > $D/$1.yaml
  setsid $N/deepepd -c $D/$1.yaml > $O/deepepd-$1.log 2>&1 &
  for i in $(seq 150); do [ -S $D/$1.sock ] && $N/deepepctl -s $D/$1.sock status >/dev/null 2>&1 && break; sleep 0.2; done
}
T="DEP_BUILD=$N DEP_TEST_TAGS=gpu DEP_TEST_BACKEND=cuda"
mkd on 24GiB true
echo "== 4 GPUs: attach new"
timeout 60 $N/bench/attach -s $D/on.sock -n 2,4 -g 0 -i 20 2>&1 | tail -3
export CUDA_VISIBLE_DEVICES=0
echo "== one GPU (no MPS): memory suite (new)"
env $T CK_RUN_SUITE=memory timeout 150 $N/check_deepepd > $O/check-1gpu-mem.log 2>&1; echo "rc $?"; grep -E "^[0-9]+%|FAIL|Error" $O/check-1gpu-mem.log | head -5
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog; mkdir -p /tmp/mps /tmp/mpslog; nvidia-cuda-mps-control -d
echo "== one GPU (MPS): attach new"
timeout 90 $N/bench/attach -s $D/on.sock -n 1,2,4,8 -i 20 2>&1 | tail -5
for e in "X=1" "DEP_EXP_HOSTALLOC=1" "CUDA_MODULE_LOADING=EAGER" "CUDA_MODULE_LOADING=LAZY"; do
  echo "== one GPU (MPS): traced, $e"
  env $e DEP_TRACE_SETUP=1 timeout 60 $B/trace/bench/attach -s $D/on.sock -n 1,8 -i 10 > $O/trace-$e.log 2>&1
  tail -3 $O/trace-$e.log | cut -c1-80
  grep trace $O/trace-$e.log | awk '{for(i=4;i<NF;i+=2){s[$i]+=$(i+1);n[$i]++}} END{for(k in s) printf "%s %.3f  ", k, s[k]/n[k]; print ""}'
done
echo "== one GPU (MPS): cuda_ops suite (new)"
env $T CK_RUN_SUITE=cuda_ops timeout 200 $N/check_deepepd > $O/check-1gpu-cuops.log 2>&1; echo "rc $?"; grep -E "^[0-9]+%|FAIL|Error" $O/check-1gpu-cuops.log | head -5
echo quit | nvidia-cuda-mps-control; sleep 1
pkill -f "$D/on.yaml"
date -u
tar czf $OUT/r17.tgz -C /tmp r17
