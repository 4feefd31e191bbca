#!/bin/bash
# device run (2026-12-01, nvidia-h200, issue 16): the kernel cache and the
# start-up warm-up, built here (in a tree of HEAD plus these changes) with
#   make BUILD=build-ptx4 PTX_ONLY=90 STATIC_DEPS=1 all build-ptx4/check_deepepd
#   make BUILD=build-gpu4 STATIC_DEPS=1 all build-gpu4/check_deepepd
# bench/kcache.sh (PTX-only build: empty cache, warm cache, corrupt entry, the
# trainers' own JIT with the driver's cache off and warm; the SASS build), the
# kcache GPU test on the PTX-only build, then the whole GPU suite time-sliced
# on the SASS build (every daemon start now runs the warm-up child).
set -u
R=$(pwd); P=$R/build-ptx4; S=$R/build-gpu4
OUTD=${OUT:-/tmp/out}; mkdir -p $OUTD
exec > >(tee $OUTD/run.log) 2>&1
date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
echo "== missing libraries:"; ldd $P/deepepd $S/deepepd $S/check_deepepd | grep 'not found'
echo "== bench/kcache.sh"
OUT=$OUTD N=10 timeout 150 bench/kcache.sh $P $S > $OUTD/kcache.txt 2>&1
echo "== kcache.sh rc $?"; cat $OUTD/kcache.txt | grep -v "process [0-9]*:"
echo "== kcache GPU test, PTX-only build"
DEP_BUILD=$P DEP_TEST_TAGS=gpu DEP_TEST_BACKEND=cuda CK_RUN_SUITE=kcache timeout 100 $P/check_deepepd > $OUTD/check-kcache-ptx.log 2>&1
echo "== check rc $?"; grep -E "^Checks|:F:|:E:|skipped" $OUTD/check-kcache-ptx.log | head
echo "== GPU tests, SASS build, time-sliced"
DEP_BUILD=$S DEP_TEST_TAGS=gpu DEP_TEST_BACKEND=cuda timeout 220 $S/check_deepepd > $OUTD/check.log 2>&1
echo "== check rc $?"; grep -E "^Checks|:F:|:E:" $OUTD/check.log | head -30
date -u
