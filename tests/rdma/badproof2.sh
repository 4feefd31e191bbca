#!/usr/bin/env bash
# badproof2.sh — an RDMA queue pair, a link's or the data path's, is
# opened by a proof of the peer key, not by its token alone: two daemons
# (transport: rdma, one link each way) on two nodes; node 2's link queue
# pair and its first data queue pair into node 1 are each preceded by a
# connection request with the right token (a live XPORT's or DATA_OFFER's)
# and a wrong proof: one made without the key for the link, one made for
# the other direction for the data path ($DEEPEPD_TEST_RDMA_BAD_PROOFS).
# Node 1 must reject both and say so, and leave the offers open: node 2's
# own requests with the same tokens then open the queue pairs, the link is
# up over RDMA, and the data path is over RDMA both ways.
# rdmavm: nodes=2 timeout=180
set -euo pipefail
. tests/rdmavm/lib.sh
B=${DEP_BUILD:?DEP_BUILD names the build directory}
d=$(mktemp -d)
sock=$d/deepepd.sock
peer_config "$d" "connection_pool_size: 1" "transport: rdma" >"$d/deepepd.yaml"
if [[ $RDMAVM_NODE == 2 ]]; then
  export DEEPEPD_TEST_RDMA_BAD_PROOFS=1
fi
"$B/deepepd" -c "$d/deepepd.yaml" 2>"$d/log" &
pid=$!
cleanup() { [[ -z $pid ]] || kill -9 "$pid" 2>/dev/null || true; }
show() { echo "--- deepepd's log"; cat "$d/log"; "$B/deepepctl" -s "$sock" peers 2>&1 || true; }

# Up, or (node 2) a wrong proof taken, which the checks below then name.
rdma_data() { grep -qE "data path over RDMA|with a wrong proof .* was accepted" "$d/log"; }
wait_until 120 rdma_data || { show; fail "the data path's queue pair did not come up within 120 s"; }
! grep -q "with a wrong proof .* was accepted" "$d/log" || { show; fail "node 1 accepted a wrong proof"; }
link_up() {
  "$B/deepepctl" -s "$sock" peers --json >"$d/peers.json" 2>&1 &&
    grep -qF '"state":"up","transport":"rdma"' "$d/peers.json" && grep -qF '"qps_up":1,' "$d/peers.json"
}
wait_until 60 link_up || { cat "$d/peers.json"; show; fail "the link is not up over RDMA"; }
! grep -q "data path over TCP" "$d/log" || { show; fail "the data path fell back to TCP"; }
if [[ $RDMAVM_NODE == 1 ]]; then
  refused() { grep -q "RDMA data queue pair request(s) that named a token offered to it but did not prove the peer key are rejected" "$d/log"; }
  wait_until 30 refused || { show; fail "the data queue pair's request with a wrong proof was not rejected and logged"; }
  grep -q "connection request(s) that named a link's open offer but did not prove the peer key are rejected" "$d/log" \
    || { show; fail "the link's request with a wrong proof was not rejected and logged"; }
  ! grep -q "names no open offer" "$d/log" \
    || { show; fail "a request was refused as naming no open offer: the wrong proof spent the offer, or the real one came late"; }
  say "node 1: $(grep -m1 -o 'rdma: .*did not prove the peer key are rejected' "$d/log")"
  say "node 1: $(grep -m1 -o 'peer .*did not prove the peer key are rejected' "$d/log")"
else
  grep -q "the RDMA data queue pair with a wrong proof .* did not connect (the peer rejected" "$d/log" \
    || { show; fail "the data queue pair's request with a wrong proof was not rejected by node 1"; }
  grep -q "a link's connection request with a wrong proof .* was rejected; sending ours" "$d/log" \
    || { show; fail "the link's request with a wrong proof was not rejected by node 1"; }
  # Its own queue pair, opened after the rejection with the same token, is the one that came up.
  sed -n '/opening ours with the same token/,$p' "$d/log" | grep -q "data path over RDMA" \
    || { show; fail "the data path's queue pair did not come up after the wrong proof was rejected"; }
  say "node 2: the wrong proofs were rejected, the same tokens then opened the queue pairs"
fi
barrier checked 120
kill -TERM "$pid"
rc=0; wait "$pid" || rc=$?
pid=
[[ $rc -eq 0 ]] || { show; fail "deepepd exited $rc on SIGTERM (want 0)"; }
! grep -qE "Sanitizer|runtime error:" "$d/log" || { show; fail "the daemon's sanitizer found an error"; }
say "node $RDMAVM_NODE: done"
