#!/bin/bash
# deepep_one_gpu.sh — DeepEP's own test scripts, unmodified, with all their ranks on one GPU
# (issue 26): test_intranode.py and test_low_latency.py at 2, 4 and 8 ranks through
# bench/deepep_one_gpu.py (devices and the process group's backend mapped, nothing else),
# against a cuda deepepd started before the MPS server, outside it, the ranks under MPS.
# With NODES=N (2.x's tests/legacy/test_internode.py), N cuda daemons on this machine, each
# the others' peer over loopback TCP, are N nodes: the script is started once per node as a
# launcher starts it on N hosts (WORLD_SIZE=N nodes, RANK=the node, MASTER_ADDR/PORT), each
# with $DEEPEPD_SOCKET naming its node's daemon (a node is a daemon: python/deepep/identity.py).
# Its 16 ranks fit one GPU at once with DEEPEP_KERNEL_CTAS=8 (each daemon sees only its own 8
# ranks, so each would take 16 CTAs a rank), DEEPEP_MAX_TOKENS_PER_RANK and --num-tokens small
# enough that both daemons' pools and the ranks' torch fit the GPU's memory (BENCHMARKS.md).
# Logs (each script's output, with its printed bandwidths) under $OUT.
# Usage, from the repository root: bench/deepep_one_gpu.sh BUILD_DIR DEEPEP_TESTS_DIR
#   DEEPEP_TESTS_DIR: DeepEP's tests/ at the commit to check (567632d; the machine has no
#   network: carry it), holding test_intranode.py, test_low_latency.py and utils.py; or
#   DeepEP 2.x's tests/legacy/, whose scripts import their helpers from deep_ep.utils
#   (deepepd's, python/deep_ep_compat/utils/) and need no utils.py beside them.
# Knobs: RANKS ("2 4 8": processes a node), SCRIPTS ("test_intranode.py test_low_latency.py"),
#   NODES (1), RUN_S (300) seconds a script may run, EXTRA_ARGS passed to every script, POOL
#   (16GiB) each daemon's pool and HOST_POOL (1GiB) its pinned host memory (a job across
#   nodes takes its exchange regions there): the rest of the GPU is the ranks' own.
#   BACKEND (cuda) the daemons' backend, CHUNK_ROWS (0: whole blocks) the daemons'
#   stream_chunk_rows (a job across nodes then streams, a dispatch row once per node).
set -u
R=$(pwd); B=$(cd "${1:?BUILD_DIR}" && pwd); T=$(cd "${2:?DEEPEP_TESTS_DIR}" && pwd)
OUTD=${OUT:-/tmp/out}; mkdir -p "$OUTD"
exec > >(tee "$OUTD/deepep-one-gpu.log") 2>&1
date -u; nvidia-smi --query-gpu=name,uuid,driver_version,memory.total --format=csv,noheader
PY=$(command -v python3)
$PY -c "import sys, torch; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)"
export DEEPEP_CLIENT_LIB=$B/libdeepep-client.so.0
D=$(mktemp -d /tmp/d1g.XXXX)
NODES=${NODES:-1}
"$B"/deepepctl genkey "$D/key" >/dev/null
DPIDS=
for i in $(seq 0 $((NODES - 1))); do
  peers=
  for k in $(seq 0 $((NODES - 1))); do
    [ $k = $i ] || peers="$peers${peers:+, }{host: 127.0.0.1, port: $((18471 + k))}"
  done
  net=
  [ $NODES -gt 1 ] && net="listen: {address: 127.0.0.1, port: $((18471 + i))}
peers: [$peers]
peer_key_file: $D/key
peer_wait_ms: 0
"
  printf 'socket:\n  path: %s/n%s.sock\nbackend: %s\npool:\n  size_per_device: %s\n  chunk_size: 1GiB\n  host_size: %s\nstream_chunk_rows: %s\n%s' \
    "$D" $i "${BACKEND:-cuda}" "${POOL:-16GiB}" "${HOST_POOL:-1GiB}" "${CHUNK_ROWS:-0}" "$net" \
    > "$D/n$i.yaml"
  setsid "$B"/deepepd -c "$D/n$i.yaml" > "$OUTD/deepepd-n$i.log" 2>&1 &
  DPIDS="$DPIDS $!"
done
for i in $(seq 0 $((NODES - 1))); do
  for t in $(seq 300); do
    "$B"/deepepctl -s "$D/n$i.sock" status >/dev/null 2>&1 &&
      [ "$("$B"/deepepctl -s "$D/n$i.sock" peers 2>/dev/null | grep -cw up)" -ge $((NODES - 1)) ] && break
    sleep 0.2
  done
  "$B"/deepepctl -s "$D/n$i.sock" status | head -6
  [ $NODES -gt 1 ] && "$B"/deepepctl -s "$D/n$i.sock" peers
done
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
mkdir -p /tmp/mps /tmp/mpslog; nvidia-cuda-mps-control -d && echo "== MPS started"
cd "$T"
for s in ${SCRIPTS:-test_intranode.py test_low_latency.py}; do
  for n in ${RANKS:-2 4 8}; do
    echo "== $s --num-processes $n, $NODES node(s)"
    P=
    for i in $(seq 0 $((NODES - 1))); do
      if [ $NODES -gt 1 ]; then
        set -- env WORLD_SIZE=$NODES RANK=$i MASTER_ADDR=127.0.0.1
      else
        set -- env -u WORLD_SIZE -u RANK
      fi
      "$@" MASTER_PORT=$((8361 + n)) DEEPEPD_SOCKET=$D/n$i.sock timeout ${RUN_S:-300} \
        $PY "$R/bench/deepep_one_gpu.py" "$s" --num-processes "$n" ${EXTRA_ARGS:-} \
        > "$OUTD/${s%.py}-$n-n$i.log" 2>&1 &
      P="$P $!"
    done
    for p in $P; do wait $p; echo "== $s $n ranks a node: pid $p rc $?"; done
    for i in $(seq 0 $((NODES - 1))); do
      grep -iE "passed|error|assert|GB/s|us" "$OUTD/${s%.py}-$n-n$i.log" | tail -12
    done
  done
done
cd "$R"
echo quit | nvidia-cuda-mps-control; sleep 1; echo "== MPS stopped"
for i in $(seq 0 $((NODES - 1))); do "$B"/deepepctl -s "$D/n$i.sock" status | head -12; done
kill -TERM $DPIDS; for p in $DPIDS; do wait $p; echo "== deepepd $p exit $?"; done
