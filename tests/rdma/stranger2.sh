#!/usr/bin/env bash
# stranger2.sh — an RDMA connection to deepepd's connection-manager port
# that does not come through an authenticated peer link (no live token in
# its private data) is rejected and logged, and the daemon carries on:
# node 1 runs deepepd with transport: rdma; node 2 runs no daemon, only
# rdma-core's rping against node 1's listen port.
# rdmavm: nodes=2 timeout=180
set -euo pipefail
. tests/rdmavm/lib.sh
B=${DEP_BUILD:?DEP_BUILD names the build directory}
command -v rping >/dev/null || fail "rping not found (Debian's rdmacm-utils; make deps installs it)"
d=$(mktemp -d)
if [[ $RDMAVM_NODE == 1 ]]; then
  # The peer (node 2) runs no daemon: it stays in backoff, which is no concern here.
  peer_config "$d" "peer_wait_ms: 0" "transport: rdma" >"$d/deepepd.yaml"
  "$B/deepepd" -c "$d/deepepd.yaml" 2>"$d/log" &
  pid=$!
  cleanup() { kill -9 "$pid" 2>/dev/null || true; }
  listening() { grep -q "rdma: peer links on rxe0, listening on" "$d/log"; }
  wait_until 60 listening || { cat "$d/log"; fail "deepepd did not listen for RDMA connections"; }
  barrier listening 90
  barrier tried 120
  grep -q "names no open offer of an authenticated peer link: rejected" "$d/log" \
    || { cat "$d/log"; fail "the stranger's connection request was not rejected and logged"; }
  "$B/deepepctl" -s "$d/deepepd.sock" status >/dev/null || { cat "$d/log"; fail "deepepd stopped answering"; }
  kill -TERM "$pid"; wait "$pid" || fail "deepepd exited $? on SIGTERM"
  pid=
  say "node 1: the stranger was rejected, deepepd carried on and stopped cleanly"
else
  barrier listening 90
  # rping carries no private data: it must be turned away, not served.
  if timeout 30 rping -c -a "$RDMAVM_PEER_IP" -p 7470 -C 1 -S 64 -V >"$d/rping" 2>&1; then
    cat "$d/rping"; fail "rping got through to deepepd's RDMA port"
  fi
  say "node 2: rping refused: $(grep -m1 -i 'reject\|error\|fail' "$d/rping" || head -1 "$d/rping")"
  barrier tried 120
fi
