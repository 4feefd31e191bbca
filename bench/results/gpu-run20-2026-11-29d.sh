#!/bin/bash
# device run 20 (2026-11-29, nvidia-h200-x4): arenas in pieces of at most pool.max_allocation
# (480 MiB) against one allocation (max_allocation 16GiB), for a shape whose arena is 906 MiB
# per GPU (-t 8192: the 8-GPU slab size at 4 ranks); ep on the split arenas; the memory
# suite's share case across 4 GPUs.
set -u
B=$(cd "$(dirname "$0")" && pwd)
O=/tmp/r20; mkdir -p $O
exec > >(tee $O/run.log) 2>&1
date -u
D=$(mktemp -d /tmp/d.XXXX)
mkd() { # name max_allocation
  printf 'socket:\n  path: %s/%s.sock\nbackend: cuda\npreallocation: false\npool:\n  size_per_device: 8GiB\n  chunk_size: 1GiB\n  host_size: 1GiB\n  max_allocation: %s\n' $D $1 $2 > $D/$1.yaml
  setsid $B/deepepd -c $D/$1.yaml > $O/deepepd-$1.log 2>&1 &
}
mkd cap 480MiB; mkd nocap 16GiB
for i in $(seq 150); do [ -S $D/cap.sock ] && [ -S $D/nocap.sock ] && $B/deepepctl -s $D/nocap.sock status >/dev/null 2>&1 && break; sleep 0.2; done
for v in nocap cap nocap cap; do
  echo "== 4 GPUs, 8192 tokens: attach, $v"
  timeout 40 $B/bench/attach -s $D/$v.sock -n 4 -g 0 -t 8192 -i 10 2>&1 | tail -2
done
echo "== 4 GPUs, 8192 tokens: ep on split arenas"
timeout 60 $B/bench/ep -s $D/cap.sock -n 4 -g 0 -m processes -t 8192 -c 50 2>&1 | tail -7
grep -h "made a block" $O/deepepd-*.log | head -4
$B/deepepctl -s $D/cap.sock status | sed -n '/devices/,$p'
pkill -f "$D/cap.yaml"; pkill -f "$D/nocap.yaml"
echo "== memory suite, share case, 4 GPUs"
env DEP_BUILD=$B DEP_TEST_TAGS=gpu DEP_TEST_BACKEND=cuda DEP_TEST_GPUS=all CK_RUN_SUITE=memory CK_RUN_CASE=share timeout 60 $B/check_deepepd > $O/check-share.log 2>&1; echo "rc $?"; grep -E "^[0-9]+%|FAIL|Error|:F:|:E:" $O/check-share.log | head -5
date -u
tar czf $OUT/r20.tgz -C /tmp r20
