#!/usr/bin/env bash
# verbs2.sh — the two guests' wire carries RDMA, with rdma-core's own tools
# and no project code: rping (rdma_cm, RC, SEND and RDMA READ/WRITE, data
# verified) and ibv_rc_pingpong in event mode (raw verbs, RC SEND/RECV).
# When this fails, the harness is broken, not the daemon.
# Node 1 serves, node 2 connects, retrying until node 1 listens.
# rdmavm: nodes=2 timeout=180
set -euo pipefail
. tests/rdmavm/lib.sh
command -v rping >/dev/null || fail "rping not found (Debian's rdmacm-utils; make deps installs it)"
command -v ibv_rc_pingpong >/dev/null || fail "ibv_rc_pingpong not found (Debian's ibverbs-utils)"
log=$(mktemp)

# A client retries while the server is not there yet; any try that gets
# through and then fails ends the scenario (the server has gone).
client() {
  local end=$((SECONDS + 60))
  until timeout 60 "$@" >"$log" 2>&1; do
    ((SECONDS < end)) || { cat "$log"; fail "$1 to $RDMAVM_PEER_IP did not succeed within 60 s"; }
    sleep 0.5
  done
  cat "$log"
}

# rping: 50 verified round trips of 1 KiB.
if [[ $RDMAVM_NODE == 1 ]]; then
  timeout 90 rping -s -a "$RDMAVM_IP" -C 50 -S 1024 -V || fail "rping server failed"
else
  client rping -c -a "$RDMAVM_PEER_IP" -C 50 -S 1024 -V
fi
say "rping: 50 verified round trips between $RDMAVM_IP and $RDMAVM_PEER_IP"

# ibv_rc_pingpong: 200 round trips of 4 KiB, waiting on completion events
# (busy polling on rxe costs a scheduler tick per message).
pp=(ibv_rc_pingpong -d "$RDMAVM_DEV" -g "$RDMAVM_GID_INDEX" -e -n 200 -s 4096)
if [[ $RDMAVM_NODE == 1 ]]; then
  timeout 90 "${pp[@]}" || fail "ibv_rc_pingpong server failed"
else
  client "${pp[@]}" "$RDMAVM_PEER_IP"
fi
say "ibv_rc_pingpong: 200 round trips of 4 KiB"
