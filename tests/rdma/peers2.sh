#!/usr/bin/env bash
# peers2.sh — two deepepd on two nodes become each other's peers: each
# listens on its own address with the other in `peers`, both with one
# peer_key_file, and each sees the other up with every connection of its
# pool, outbound and inbound, on the expected transport; then both stop
# cleanly.
# rdmavm: nodes=2 timeout=180
set -euo pipefail
. tests/rdmavm/lib.sh
B=${DEP_BUILD:?DEP_BUILD names the build directory}
POOL=2
d=$(mktemp -d)
sock=$d/deepepd.sock

# TRANSPORT: what the peers must be connected over (rdma; TRANSPORT=X in the
# environment asks for X instead).
TRANSPORT=${TRANSPORT:-rdma}
peer_config "$d" "connection_pool_size: $POOL" "transport: $TRANSPORT" >"$d/deepepd.yaml"
"$B/deepepd" --check-config "$d/deepepd.yaml" || fail "the config is refused"
say "node $RDMAVM_NODE: peer $RDMAVM_PEER_IP, transport $TRANSPORT"

"$B/deepepd" -c "$d/deepepd.yaml" 2>"$d/log" &
pid=$!
cleanup() { [[ -z $pid ]] || kill "$pid" 2>/dev/null; }
show() { echo "--- deepepd's log"; cat "$d/log"; echo "--- deepepctl peers --json"; cat "$d/peers.json" 2>/dev/null; }

# Up: the peer (the other node's daemon, by its hostname) with all POOL
# connections of ours and all POOL of its own, authenticated, on TRANSPORT
# (over rdma, a queue pair up on each connection).
up() {
  "$B/deepepctl" -s "$sock" peers --json >"$d/peers.json" 2>&1 || return 1
  local want
  for want in '"auth":"peer_key_file"' "\"address\":\"$RDMAVM_PEER_IP:7470\"" \
    "\"node\":\"node$((3 - RDMAVM_NODE))\"" '"state":"up"' "\"transport\":\"$TRANSPORT\"" \
    "\"conns_up\":$POOL," "\"conns_total\":$POOL," "\"inbound_up\":$POOL," \
    $([[ $TRANSPORT == rdma ]] && echo "\"qps_up\":$POOL,"); do
    grep -qF "$want" "$d/peers.json" || return 1
  done
}
wait_until 60 up || { show; fail "the peer is not up with $POOL+$POOL connections on $TRANSPORT within 60 s"; }
"$B/deepepctl" -s "$sock" peers

# Neither stops before both have seen the other up.
barrier peers-up
kill -TERM "$pid"
rc=0; wait "$pid" || rc=$?
pid=
[[ $rc -eq 0 ]] || { show; fail "deepepd exited $rc on SIGTERM (want 0)"; }
say "node $RDMAVM_NODE: peer up over $TRANSPORT, deepepd stopped cleanly"
