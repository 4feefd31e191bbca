# lib.sh — helpers for the scenarios of tests/rdma/, sourced by each one
# inside its guest (bash).  A scenario prints what it checks, exits 0 when
# it holds, 1 when it does not (fail), 77 when it cannot run here (skip).
# It defines a function `cleanup` for what must be undone however it ends
# (a daemon to stop) rather than setting an EXIT trap, which is lib.sh's.
SCENARIO=$(basename "$0" .sh)
OTHER=$((3 - RDMAVM_NODE))

# A node that ends other than well leaves gone.<node> in the shared
# directory, so that the other node stops waiting for it at once and says
# what it saw, rather than time out.  (fail and skip leave it too, for a
# scenario that sets its own EXIT trap.)
gone() { touch "$RDMAVM_SHARED/gone.$RDMAVM_NODE" 2>/dev/null || true; }

say() { echo "$SCENARIO: $*"; }
fail() { echo "$SCENARIO: FAIL: $*" >&2; gone; exit 1; }
# check.sh reports the text after "skip: " as the reason.
skip() { echo "$SCENARIO: skip: $*"; gone; exit 77; }

lib_exit() {
  local rc=$?
  [[ $rc -eq 0 ]] || gone
  if declare -F cleanup >/dev/null; then cleanup || true; fi
  exit "$rc"
}
trap lib_exit EXIT

# wait_until SECS CMD...: run CMD (a command or a function) every 0.2 s until
# it succeeds; false when SECS pass first, or when the other node has given
# up.  CMD must not hang: it is not killed.
wait_until() {
  local end=$((SECONDS + $1)); shift
  until "$@"; do
    if [[ $RDMAVM_NODES == 2 && -e "$RDMAVM_SHARED/gone.$OTHER" ]]; then
      say "node $OTHER has failed: waiting no longer"
      return 1
    fi
    ((SECONDS < end)) || return 1
    sleep 0.2
  done
}

# barrier NAME [SECS]: this node reaches NAME, then waits until the other node
# has too (through files in $RDMAVM_SHARED, which both guests mount); with one
# guest it returns at once.
barrier() {
  [[ $RDMAVM_NODES == 2 ]] || return 0
  touch "$RDMAVM_SHARED/$1.$RDMAVM_NODE"
  wait_until "${2:-60}" test -e "$RDMAVM_SHARED/$1.$OTHER" \
    || fail "node $OTHER did not reach '$1' within ${2:-60} s"
}

# peer_config DIR [LINE...]: print a deepepd config for this node — its
# socket in DIR, the host backend with a small pool made on demand,
# listening on RDMAVM_IP:7470 with the other node's daemon as its peer, and
# a key shared by both nodes (a fixed one, since this is a test; written to
# DIR/peer.key with mode 0600, or deepepd refuses it) — then each LINE.
peer_config() {
  local d=$1; shift
  (umask 077; echo 0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef >"$d/peer.key")
  cat <<EOC
socket: {path: $d/deepepd.sock}
backend: host
pool: {host_size: 64MiB}
preallocation: false
listen: {address: $RDMAVM_IP, port: 7470}
peers: [{host: $RDMAVM_PEER_IP, port: 7470}]
peer_key_file: $d/peer.key
EOC
  [[ $# -eq 0 ]] || printf '%s\n' "$@"
}
