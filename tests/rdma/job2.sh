#!/usr/bin/env bash
# job2.sh — a multi-node job over RDMA queue pairs: two daemons (transport:
# rdma) on two nodes, one rank of a 2-rank job on each.  Each daemon lends
# its rank's arena and makes its exchange region, registers the region with
# rxe, announces its window (the NIC's address and rkey of the region) in
# MEMBERSHIP, and both ranks attach
# with no bootstrap of their own.  Then node 1's rank dies: node 2's daemon
# learns it over the peer link and says so; node 1's daemon is killed:
# node 2's loses its queue pairs and reconnects when it is back.
# rdmavm: nodes=2 timeout=240
set -euo pipefail
. tests/rdmavm/lib.sh
B=${DEP_BUILD:?DEP_BUILD names the build directory}
d=$(mktemp -d)
sock=$d/deepepd.sock
peer_config "$d" "connection_pool_size: 1" "transport: rdma" "log_level: debug" >"$d/deepepd.yaml"
cc -std=c11 -D_GNU_SOURCE -Iinclude -o "$d/rank" tests/rdma/rank.c -L"$B" -ldeepep-client \
  -Wl,-rpath,"$B" || fail "cannot build tests/rdma/rank.c"
start() {
  "$B/deepepd" -c "$d/deepepd.yaml" 2>>"$d/log" &
  pid=$!
}
start
cleanup() { kill -9 "$pid" 2>/dev/null || true; }
show() { echo "--- deepepd's log"; cat "$d/log"; "$B/deepepctl" -s "$sock" peers 2>&1 || true; }
rdma_up() {
  "$B/deepepctl" -s "$sock" peers --json >"$d/peers.json" 2>&1 &&
    grep -qF '"state":"up","transport":"rdma"' "$d/peers.json"
}
wait_until 90 rdma_up || { show; fail "the peer is not up over rdma within 90 s"; }
barrier peers-up 90

# One rank each: rank r = node - 1, holding the job until its stdin closes.
mkfifo "$d/hold"
"$d/rank" "$sock" job-rdma $((RDMAVM_NODE - 1)) 2 0 1 <"$d/hold" >"$d/rank.out" 2>&1 &
exec 3>"$d/hold"
got() { grep -q . "$d/rank.out" 2>/dev/null; }
wait_until 60 got || { show; fail "the rank did not attach within 60 s"; }
grep -q "^attached in" "$d/rank.out" || { cat "$d/rank.out"; show; fail "the rank's attach failed"; }
say "node $RDMAVM_NODE: $(cat "$d/rank.out")"
grep -qE "registered an exchange region of .* with rxe0" "$d/log" \
  || { show; fail "the exchange region was not registered with rxe0"; }
grep -qE "job job-rdma: node .* holds 1 of its 2 ranks \(1 window\(s\), 1 registered with its NIC\)" "$d/log" \
  || { show; fail "the peer's MEMBERSHIP did not carry a registered window"; }
"$B/deepepctl" -s "$sock" peers --json | grep -qE '"nic_bytes":[1-9]' || { show; fail "peers shows no registered bytes"; }
barrier attached 90

if [[ $RDMAVM_NODE == 1 ]]; then
  exec 3>&-              # the rank leaves (its stdin closes, it exits)
  barrier rank-gone 90
  barrier seen 90
  kill -9 "$pid"; wait "$pid" 2>/dev/null || true
  barrier killed 90
  barrier back-wait 90
  start                  # back: the other node reconnects, over rdma again
  wait_until 90 rdma_up || { show; fail "not up over rdma again after the restart"; }
  barrier again 120
else
  barrier rank-gone 90
  seen() { grep -q "job job-rdma: rank 0 .* on a peer node\|job-rdma.*rank 0" "$d/log"; }
  wait_until 30 seen || { show; fail "node 1's rank leaving was not reported here"; }
  say "node 2: $(grep -m1 "job-rdma.*rank 0" "$d/log" | sed 's/^[^ ]* //')"
  barrier seen 90
  barrier killed 90
  lost() { grep -qE "peer 10\.77\.0\.1:7470.*(lost|queue pair|closed)" "$d/log"; }
  wait_until 30 lost || { show; fail "the loss of node 1's daemon was not seen"; }
  barrier back-wait 90
  wait_until 120 rdma_up || { show; fail "not up over rdma again after node 1's restart"; }
  say "node 2: reconnected over rdma: $(grep -o '"reconnects":[0-9]*' "$d/peers.json")"
  barrier again 120
fi
exec 3>&- 2>/dev/null || true
kill -TERM "$pid"; wait "$pid" 2>/dev/null || true
say "node $RDMAVM_NODE: done"
