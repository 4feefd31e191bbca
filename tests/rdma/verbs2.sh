#!/usr/bin/env bash
# verbs2.sh — the two guests' wire carries RDMA, with rdma-core's own tools
# and no project code: rping (rdma_cm, RC, SEND and RDMA READ/WRITE, data
# verified) and ibv_rc_pingpong in event mode (raw verbs, RC SEND/RECV).
# When this fails, the harness is broken, not the daemon.
# Node 1 serves and says so (a barrier) once its listener is up; node 2
# connects.  Every try node 2 makes prints its own output, so that a failure
# is never hidden behind a later try's.
# rdmavm: nodes=2 timeout=300
set -euo pipefail
. tests/rdmavm/lib.sh
command -v rping >/dev/null || fail "rping not found (Debian's rdmacm-utils; make deps installs it)"
command -v ibv_rc_pingpong >/dev/null || fail "ibv_rc_pingpong not found (Debian's ibverbs-utils)"
command -v rdma >/dev/null || fail "rdma not found (Debian's iproute2)"
log=$(mktemp)
server=
cleanup() { [[ -z $server ]] || kill "$server" 2>/dev/null || true; }

# try N SECS CMD...: run CMD up to N times, each within SECS, printing how
# each try ended and a failed one's output; true at the first that succeeds
# (its output left in $log).  A try that
# reports corrupted data ends it at once: that is the wire failing, not
# a set-up to repeat.
try() {
  local n=$1 secs=$2 i rc t; shift 2
  for ((i = 1; i <= n; i++)); do
    t=$SECONDS rc=0
    timeout "$secs" "$@" >"$log" 2>&1 || rc=$?
    say "try $i of $n: $1 exited $rc after $((SECONDS - t)) s$([[ $rc == 124 ]] && echo " (timed out)")"
    [[ $rc -ne 0 ]] || return 0
    sed 's/^/  /' "$log"
    ! grep -qi 'mismatch' "$log" || fail "$1 reported corrupted data"
    sleep 1
  done
  return 1
}

# rping: 50 verified round trips of 1 KiB.  The server is persistent (-P), so
# that a client's try that fails can be followed by another; node 1 stops it
# once node 2 has had its 50 (node 2 reaches rping-done only then).
listening() { rdma res show cm_id state LISTEN 2>/dev/null | grep -q "comm rping"; }
if [[ $RDMAVM_NODE == 1 ]]; then
  rping -s -P -a "$RDMAVM_IP" -S 1024 -V >"$log.server" 2>&1 &
  server=$!
  wait_until 30 listening || fail "rping's listener did not come up within 30 s"
  barrier rping-listening
  barrier rping-done 240
  kill -0 "$server" 2>/dev/null || { cat "$log.server"; fail "the rping server died"; }
  kill "$server"; wait "$server" 2>/dev/null || true; server=
  ! grep -qi 'mismatch' "$log.server" || { cat "$log.server"; fail "rping's server saw corrupted data"; }
else
  barrier rping-listening
  ok=0
  try 3 60 rping -c -a "$RDMAVM_PEER_IP" -C 50 -S 1024 -V -v || ok=$?
  [[ $ok -eq 0 ]] || fail "rping to $RDMAVM_PEER_IP did not succeed in 3 tries"
  n=$(grep -c 'ping data: rdma-ping-' "$log" || true)
  [[ $n -eq 50 ]] || fail "rping made $n verified round trips, not 50"
  barrier rping-done
fi
say "rping: 50 verified round trips between $RDMAVM_IP and $RDMAVM_PEER_IP"

# ibv_rc_pingpong: 200 round trips of 4 KiB, waiting on completion events
# (busy polling on rxe costs a scheduler tick per message).  Its server takes
# one client and exits; node 2 connects once node 1's TCP port for the
# exchange of addresses (18515) listens.
pp=(ibv_rc_pingpong -d "$RDMAVM_DEV" -g "$RDMAVM_GID_INDEX" -e -n 200 -s 4096)
pp_listening() { ss -ltn 2>/dev/null | grep -q ':18515 '; }
if [[ $RDMAVM_NODE == 1 ]]; then
  "${pp[@]}" >"$log" 2>&1 &
  server=$!
  wait_until 30 pp_listening || { cat "$log"; fail "ibv_rc_pingpong's server did not listen within 30 s"; }
  barrier pp-listening
  rc=0; timeout 90 tail --pid="$server" -f /dev/null || rc=$?
  [[ $rc -eq 0 ]] || { cat "$log"; fail "ibv_rc_pingpong's server did not finish within 90 s"; }
  rc=0; wait "$server" || rc=$?; server=
  cat "$log"
  [[ $rc -eq 0 ]] || fail "ibv_rc_pingpong's server exited $rc"
else
  barrier pp-listening
  try 1 90 "${pp[@]}" "$RDMAVM_PEER_IP" || fail "ibv_rc_pingpong to $RDMAVM_PEER_IP failed"
  cat "$log"
fi
say "ibv_rc_pingpong: 200 round trips of 4 KiB"
