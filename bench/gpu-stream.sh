#!/bin/bash
# gpu-stream.sh — the GPU pass for the cuda backend's streamed throughput calls (issue 27),
# in one command (DEVICE.md):
#   tests   check_cuda_ops under MPS, case by case: stream (the channels), then the cases that
#           run whole blocks (oracle, faults, masks, split), each under its own timeout
#   ep      bench/ep under MPS against two cuda daemons on the GPU, one lending whole blocks and
#           one streaming in chunks of CHUNK rows, alternated twice (2, 4 and 8 rank processes)
# Usage there, from the repository root: bench/gpu-stream.sh [BUILD_DIR]
# Knobs: STEPS ("tests ep"), CASES ("stream oracle faults masks split"), TEST_SECS (200 a case),
# CHUNK (16), EP_TOKENS (128), EP_HIDDEN (unset: ep's default), EP_CALLS (100).
# Logs under $OUT; daemons stay outside MPS and are ended by their pids.
set -u
B=$(cd "${1:-build-gpu}" && pwd) || exit 2
OUTD=${OUT:-/tmp/dep-out}
mkdir -p "$OUTD"
exec > >(tee "$OUTD/gpu-stream.log") 2>&1
date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
. "$(dirname "${BASH_SOURCE[0]}")/mps.sh"
PIDS=
# daemon NAME CHUNK: a cuda deepepd at $D/NAME.sock streaming in chunks of CHUNK rows (0: whole
# blocks), outside MPS; returns once it answers.
daemon() {
  printf 'socket:\n  path: %s/%s.sock\nbackend: cuda\npool:\n  size_per_device: 16GiB\n  chunk_size: 1GiB\n  host_size: 1GiB\nstream_chunk_rows: %s\n' \
    "$D" "$1" "$2" > "$D/$1.yaml"
  env -u CUDA_MPS_PIPE_DIRECTORY -u CUDA_MPS_LOG_DIRECTORY "$B"/deepepd -c "$D/$1.yaml" \
    > "$OUTD/$1-deepepd.log" 2>&1 &
  PIDS="$PIDS $!"
  for i in $(seq 150); do "$B"/deepepctl -s "$D/$1.sock" status >/dev/null 2>&1 && break; sleep 0.2; done
}
for s in ${STEPS:-tests ep}; do
  t=$SECONDS
  case $s in
  tests)
    mps_on
    for c in ${CASES:-stream oracle faults masks split}; do
      env DEP_BUILD="$B" DEP_TEST_TAGS=gpu DEP_TEST_BACKEND=cuda CK_RUN_SUITE=cuda_ops CK_RUN_CASE=$c \
        CK_VERBOSITY=verbose timeout ${TEST_SECS:-200} "$B"/check_deepepd > "$OUTD/cuda_ops-$c.log" 2>&1
      echo "== cuda_ops/$c rc $?"
      grep -E "Checks:|:F:|:E:" "$OUTD/cuda_ops-$c.log" | cut -c1-600 | tail -20
    done
    grep -h "cuda_ops stream:" "$OUTD/cuda_ops-stream.log" | tail -50
    mps_off ;;
  ep)
    D=$(mktemp -d /tmp/dep-gs.XXXXXX)
    daemon whole 0
    daemon chunks "${CHUNK:-16}"
    mps_on
    for round in 1 2; do
      for d in whole chunks; do
        echo "== ep round $round: $d (stream_chunk_rows $(grep stream_chunk_rows "$D/$d.yaml"))"
        timeout 150 "$B"/bench/ep -s "$D/$d.sock" -n 2,4,8 -m processes -p tp -t "${EP_TOKENS:-128}" \
          ${EP_HIDDEN:+-H $EP_HIDDEN} -c "${EP_CALLS:-100}" 2>&1 | tee "$OUTD/ep-$d-$round.txt"
      done
    done
    mps_off
    "$B"/deepepctl -s "$D/chunks.sock" status 2>&1 | head -30
    kill -TERM $PIDS 2>/dev/null; wait ;;
  *) echo "== unknown step $s" ;;
  esac
  echo "== step $s: $((SECONDS - t)) s"
done
date -u
