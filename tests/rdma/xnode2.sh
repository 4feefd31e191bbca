#!/usr/bin/env bash
# xnode2.sh — the operations of a job that spans nodes, over RDMA writes
# (issue 14): two daemons (transport: rdma) on two nodes, ranks 0-1 of a
# 4-rank job on node 1 and 2-3 on node 2 (tests/rdma/xrank.c).  Each rank
# runs rounds of every operation — layout, dispatch, combine, LL dispatch
# (FP8 in odd rounds), LL combine — on random inputs from one seed, checks
# them against the oracle and prints the digest of all it received.  The
# blocks between the nodes must have gone as RDMA writes on the data path's
# queue pairs (the daemons' logs say how many blocks, writes, posts and
# bytes, and no frame went over the TCP data connections); then the same
# job with all four ranks on node 1's daemon must give every rank the same
# digest, bit for bit.  Last, node 2's daemon and ranks are killed in the
# middle of a third job (of the first's shape and placement: it must get
# the first's exchange regions back, registrations and all): node 1's ranks fail (DEP_ERR_PEER or
# DEP_ERR_TIMEOUT) within the op timeout, and node 1's daemon carries on.
# XRANK_HIDDEN and XRANK_TOKENS (run.sh -e) make the blocks larger for
# measuring writes and posts; the one-node job then needs more than the
# barriers' minutes under emulation.  XNODE2_MIXED=1 (xnode2tcp.sh) runs
# the same with node 2 on transport: tcp and one data connection each way:
# node 1's queue pair cannot connect, so it must spend that token on TCP
# (else it would have no data connection at all), and the blocks go over
# TCP both ways.  With RDMA, each daemon's metrics count per peer what went
# as RDMA writes (deepep_peer_rdma_*_total): after the first job exactly what
# its log says the job moved, and after the third job more, never less.
# rdmavm: nodes=2 timeout=420
set -euo pipefail
. tests/rdmavm/lib.sh
B=${DEP_BUILD:?DEP_BUILD names the build directory}
ROUNDS=${XNODE2_ROUNDS:-12}
OP_MS=30000 # a call takes 0.1-0.2 s between the emulated guests
d=$(mktemp -d)
sock=$d/deepepd.sock
MIXED=${XNODE2_MIXED:-0}
if [[ $MIXED == 1 ]]; then
  xport=$([[ $RDMAVM_NODE == 1 ]] && echo auto || echo tcp) pool=1
else
  xport=rdma pool=2
fi
# XNODE2_CHUNK=N (xnode2stream.sh): the daemons stream in chunks of N rows,
# so the throughput calls' rows between the nodes go as chunks and credits.
stream=()
[[ -n ${XNODE2_CHUNK:-} ]] && stream=("stream_chunk_rows: $XNODE2_CHUNK")
peer_config "$d" "connection_pool_size: $pool" "transport: $xport" ${stream[@]+"${stream[@]}"} \
  "limits: {op_timeout_ms: $OP_MS, attach_timeout_ms: 120000}" >"$d/deepepd.yaml"
# XRANK_CFLAGS: for a sanitizer build's objects (-fsanitize=address,undefined).
cc -std=c11 -D_GNU_SOURCE ${XRANK_CFLAGS:-} -Iinclude -Iclient -Iproto -Ikernels -Itests -o "$d/xrank" tests/rdma/xrank.c \
  "$B/obj/tests/xnround.o" "$B/obj/tests/opsworld.o" "$B/obj/tests/ref.o" "$B/libdeepep-client.a" \
  -lcheck -lsubunit -lm -ldl -lpthread -lrt || fail "cannot build tests/rdma/xrank.c"
"$B/deepepd" -c "$d/deepepd.yaml" 2>>"$d/log" &
pid=$!
cleanup() { kill -9 "$pid" 2>/dev/null || true; }
# The daemon's RDMA counters for its one peer into $RDMA, "blocks writes posts bytes", each
# family's only sample an integer (deepepctl metrics), or a failure naming what is wrong.
rdma_counters() {
  local f n v out=()
  "$B/deepepctl" -s "$sock" metrics >"$d/metrics" || fail "deepepctl metrics failed"
  for f in blocks writes posts bytes; do
    n=$(grep -c "^deepep_peer_rdma_${f}_total{" "$d/metrics" || true)
    v=$(grep "^deepep_peer_rdma_${f}_total{" "$d/metrics" | awk '{print $2}')
    [[ $n == 1 && $v =~ ^[0-9]+$ ]] \
      || { grep deepep_peer_rdma "$d/metrics"; fail "deepep_peer_rdma_${f}_total: $n samples ($v)"; }
    out+=("$v")
  done
  RDMA="${out[*]}"
}
show() { echo "--- deepepd's log"; cat "$d/log"; "$B/deepepctl" -s "$sock" peers 2>&1 || true; }
if [[ $MIXED == 0 ]]; then
  rdma_data() { grep -q "data path over RDMA" "$d/log"; }
  wait_until 120 rdma_data || { show; fail "the data path's queue pair did not come up within 120 s"; }
  say "node $RDMAVM_NODE: $(grep -m1 -o 'peer .*data path over RDMA[^:]*' "$d/log")"
elif [[ $RDMAVM_NODE == 1 ]]; then
  tcp_data() { grep -q "data path over TCP: its queue pair did not connect" "$d/log"; }
  wait_until 120 tcp_data || { show; fail "node 1 did not fall back to TCP within 120 s"; }
  say "node 1: $(grep -m1 -o 'peer .*data path over TCP.*' "$d/log" | sed 's/^[^ ]* [^ ]* //')"
fi
# The pool's data connections and the control lane (credits alone), each way.
data_up() {
  "$B/deepepctl" -s "$sock" peers --json >"$d/peers.json" 2>&1 &&
    grep -qE "\"data_out\":$((pool + 1))[,}]" "$d/peers.json" &&
    grep -qE "\"data_in\":$((pool + 1))[,}]" "$d/peers.json"
}
wait_until 60 data_up ||
  { cat "$d/peers.json"; show; fail "not $pool TCP data connection(s) and the control lane each way"; }

# XNODE2_SEED (run.sh -e): the seed, for comparing two builds on the same calls.
if [[ $RDMAVM_NODE == 1 ]]; then
  echo "${XNODE2_SEED:-$(( (RANDOM << 15 | RANDOM) + 1 ))}" >"$RDMAVM_SHARED/seed"
fi
barrier seeded 120
export DEP_TEST_SEED=$(cat "$RDMAVM_SHARED/seed")
say "node $RDMAVM_NODE: seed $DEP_TEST_SEED, $ROUNDS rounds of 5 operations per rank"

# Two ranks here: global 2*(node-1) and the next, local 0 and 1 of 2.
first=$((2 * (RDMAVM_NODE - 1)))
for l in 0 1; do
  "$d/xrank" "$sock" xr-spread $((first + l)) $l 2 "$ROUNDS" >"$d/spread.$l" 2>&1 &
  eval "rank$l=\$!"
done
ok=1
for l in 0 1; do
  eval "wait \$rank$l" || ok=0
  say "node $RDMAVM_NODE: $(cat "$d/spread.$l")"
done
[[ $ok == 1 ]] || { show; fail "a rank of the job across the two nodes failed"; }
for l in 0 1; do
  grep -o 'digest 0x[0-9a-f]*' "$d/spread.$l" >"$RDMAVM_SHARED/digest.$((first + l))"
done
"$B/deepepctl" -s "$sock" peers --json >"$d/peers.json"
if [[ $MIXED == 0 ]]; then
  moved() { grep -q "job xr-spread: to node .* by RDMA:" "$d/log"; }
  wait_until 60 moved || { show; fail "the daemon did not say what it moved by RDMA for xr-spread"; }
  say "node $RDMAVM_NODE: $(grep -m1 -o 'to node .* by RDMA: .*' "$d/log")"
  grep -qE '"data_frames_out":0[,}]' "$d/peers.json" \
    || { cat "$d/peers.json"; show; fail "frames went over the TCP data connections"; }
  # The only job that sent to the peer so far: the metrics say what its log line says.
  logged=$(grep -m1 -o 'job xr-spread: to node .* by RDMA: [0-9]* blocks in [0-9]* writes over [0-9]* posts, [0-9]* bytes' "$d/log" |
           sed -E 's/.* ([0-9]+) blocks in ([0-9]+) writes over ([0-9]+) posts, ([0-9]+) bytes/\1 \2 \3 \4/') || true
  rdma_counters
  rdma_then=$RDMA
  [[ -n $logged && $rdma_then == "$logged" ]] \
    || fail "the metrics' RDMA blocks, writes, posts and bytes ($rdma_then) are not the log's ($logged)"
  say "node $RDMAVM_NODE: metrics: RDMA blocks, writes, posts, bytes to the peer: $rdma_then"
else
  grep -qE '"data_frames_out":[1-9]' "$d/peers.json" \
    || { cat "$d/peers.json"; show; fail "no frame went over the TCP data connections"; }
  say "node $RDMAVM_NODE: $(grep -o '"data_frames_out":[0-9]*' "$d/peers.json") over TCP"
fi
barrier spread-done 180

if [[ $RDMAVM_NODE == 1 ]]; then
  # The same job on this node alone: every rank's digest as across the nodes.
  for g in 0 1 2 3; do
    "$d/xrank" "$sock" xr-one $g $g 4 "$ROUNDS" >"$d/one.$g" 2>&1 &
    eval "one$g=\$!"
  done
  for g in 0 1 2 3; do
    eval "wait \$one$g" || { cat "$d/one.$g"; show; fail "rank $g of the job on one node failed"; }
    want=$(cat "$RDMAVM_SHARED/digest.$g")
    got=$(grep -o 'digest 0x[0-9a-f]*' "$d/one.$g")
    [[ "$got" == "$want" ]] || fail "rank $g: $want across the nodes, $got on one node (seed $DEP_TEST_SEED)"
  done
  say "node 1: every rank's digest on one node is the one it got across the nodes"
fi
barrier compared 180

# A third job, run until it fails: node 2's side is killed while it runs.
for l in 0 1; do
  "$d/xrank" "$sock" xr-kill $((first + l)) $l 2 1000000 >"$d/kill.$l" 2>&1 &
  eval "kr$l=\$!"
done
running() { grep -q "job xr-kill: all 4 ranks held" "$d/log"; }
wait_until 120 running || { show; fail "the third job did not start"; }
# Of xr-spread's shape and placement: it got its rings and exchange regions
# back (pool.h), with their registrations on the rdma transport, and the
# registered bytes stayed what they were (no region registered again).
grep -qE "job xr-kill: 2 of its 2 local rank\(s\)' exchange regions .* $([[ $MIXED == 0 ]] && echo 2 || echo '[0-2]') with their NIC registration" "$d/log" \
  || { show; fail "the third job did not get xr-spread's exchange regions back"; }
if [[ $MIXED == 0 ]]; then
  nic_then=$(grep -o '"nic_bytes":[0-9]*' "$d/peers.json" | head -1)
  nic_now=$("$B/deepepctl" -s "$sock" peers --json | grep -o '"nic_bytes":[0-9]*' | head -1)
  [[ -n $nic_then && $nic_then == "$nic_now" ]] \
    || { show; fail "registered bytes went from $nic_then to $nic_now for a job on reused regions"; }
  say "node $RDMAVM_NODE: xr-kill on xr-spread's regions and registrations ($nic_now)"
fi
sleep 5 # some rounds, and writes in flight
barrier kill 60
if [[ $RDMAVM_NODE == 2 ]]; then
  kill -9 "$pid" "$kr0" "$kr1" 2>/dev/null || true
  wait "$pid" "$kr0" "$kr1" 2>/dev/null || true
  say "node 2: its daemon and ranks killed"
else
  t0=$SECONDS
  for l in 0 1; do
    eval "wait \$kr$l" && { show; fail "rank $((first + l)) went on after node 2 was killed"; }
    grep -qE "DEP_ERR_(PEER|TIMEOUT)" "$d/kill.$l" || { cat "$d/kill.$l"; show; fail "rank $((first + l)) failed otherwise"; }
  done
  secs=$((SECONDS - t0))
  ((secs <= OP_MS / 1000 + 10)) || fail "node 1's ranks took $secs s to fail, past the op timeout"
  say "node 1: both ranks failed within $secs s: $(sed 's/ \[world.*//' "$d/kill.0")"
  "$B/deepepctl" -s "$sock" status >/dev/null || { show; fail "node 1's daemon does not answer"; }
  if [[ $MIXED == 0 ]]; then
    # The third job's writes add to the first's: each counter grew, none went back.
    rdma_counters
    rdma_now=$RDMA
    read -r -a a <<<"$rdma_then"
    read -r -a b <<<"$rdma_now"
    for i in 0 1 2 3; do
      ((b[i] > a[i])) || fail "RDMA counters went from $rdma_then to $rdma_now across jobs"
    done
    say "node 1: metrics: RDMA counters $rdma_then after the first job, $rdma_now after the third"
  fi
fi
barrier failed 120
kill -TERM "$pid" 2>/dev/null || true # node 2's was killed
wait "$pid" 2>/dev/null || true
# A sanitizer build (make asan's flags) says what it found in the log.
! grep -qE "Sanitizer|runtime error:" "$d/log" || { show; fail "the daemon's sanitizer found an error"; }
say "node $RDMAVM_NODE: done"
