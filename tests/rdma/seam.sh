#!/usr/bin/env bash
# seam.sh — the daemon's dlopen seam to rdma-core (daemon/rdmadrv.c) where
# there is a real RDMA device: the rdma Check suite passes with none of its
# tests skipped (but those tagged gpu, left out), and a deepepd started here finds the guest's rxe device.
# On the host (no device) that suite passes by its zero-device branch; here
# a probe that finds no device is a failure.
# rdmavm: nodes=1 timeout=180
set -euo pipefail
. tests/rdmavm/lib.sh
B=${DEP_BUILD:?DEP_BUILD names the build directory}

# The harness made the device; if verbs cannot see it, nothing below means anything.
ibv_devices | grep -qw "$RDMAVM_DEV" || fail "ibv_devices does not list $RDMAVM_DEV"

# Without its GPU-tagged tests (there is no GPU here), nothing may skip.
say "CK_RUN_SUITE=rdma DEP_TEST_SKIP=gpu $B/check_deepepd"
out=$(CK_RUN_SUITE=rdma DEP_TEST_SKIP=gpu CK_VERBOSITY=verbose "$B/check_deepepd" 2>&1) \
  || { echo "$out"; fail "the rdma suite failed"; }
echo "$out"
grep -q 'Skipped: 0,' <<<"$out" || fail "the rdma suite skipped tests, which must all run here"

# The probe as the daemon runs it at start: it logs each device it opened.
d=$(mktemp -d)
cat >"$d/deepepd.yaml" <<EOF
socket: {path: $d/deepepd.sock}
backend: host
pool: {host_size: 64MiB}
preallocation: false
EOF
"$B/deepepd" -c "$d/deepepd.yaml" 2>"$d/log" &
pid=$!
cleanup() { [[ -z $pid ]] || kill "$pid" 2>/dev/null; }
wait_until 30 grep -q '>rdma: ' "$d/log" || { cat "$d/log"; fail "deepepd logged no rdma probe line"; }
grep '>rdma: ' "$d/log"
grep -q ">rdma: $RDMAVM_DEV: node GUID " "$d/log" && ! grep -q 'will use TCP' "$d/log" \
  || { cat "$d/log"; fail "deepepd's probe did not find $RDMAVM_DEV"; }
kill -TERM "$pid"
rc=0; wait "$pid" || rc=$?
pid=
[[ $rc -eq 0 ]] || { cat "$d/log"; fail "deepepd exited $rc on SIGTERM (want 0)"; }
say "deepepd found $RDMAVM_DEV and stopped cleanly"
