#!/usr/bin/env bash
# xnode2once.sh — one crossing per destination node over RDMA (issue 27):
# two daemons (transport: rdma), ranks 0-1 of a 4-rank job on node 1 and
# 2-3 on node 2, each rank one throughput dispatch of top-4 of 8 experts
# (tests/rdma/xrank.c with XRANK_ONCE: most tokens go to both ranks of the
# other node), checked against the oracle bit for bit; in chunks of 1 row,
# of 3 rows, in whole blocks, and in whole blocks of a shape whose rows for
# the other node (about 2.4 MB) are more than a chunk of a daemon's
# staging holds, so that they go in pieces (a daemon restart each).  Each rank's rows
# for the other node go once into the far daemon's staging by RDMA writes,
# and that daemon fans them out to its ranks: the job's payload_out (deepepctl
# status) is, to the byte, the rows the layout predicts once per destination
# node (each token with an expert on the other node once, row_bytes each),
# not once per destination rank (what the code before this scenario sent
# over RDMA, where the far daemon took no part); nothing went over the TCP
# data connections, and the RDMA counters grew.
# rdmavm: nodes=2 timeout=600
set -euo pipefail
. tests/rdmavm/lib.sh
B=${DEP_BUILD:?DEP_BUILD names the build directory}
OP_MS=30000 # a call takes 0.1-0.2 s between the emulated guests
d=$(mktemp -d)
sock=$d/deepepd.sock
cc -std=c11 -D_GNU_SOURCE ${XRANK_CFLAGS:-} -Iinclude -Iclient -Iproto -Ikernels -Itests -o "$d/xrank" tests/rdma/xrank.c \
  "$B/obj/tests/xnround.o" "$B/obj/tests/opsworld.o" "$B/obj/tests/ref.o" "$B/libdeepep-client.a" \
  -lcheck -lsubunit -lm -ldl -lpthread -lrt || fail "cannot build tests/rdma/xrank.c"
pid=
cleanup() { [[ -z $pid ]] || kill -9 "$pid" 2>/dev/null || true; }
show() { echo "--- deepepd's log"; cat "$d/log"; "$B/deepepctl" -s "$sock" peers 2>&1 || true; }
rdma_data() { grep -q "data path over RDMA" "$d/log"; }
# connection_pool_size 2 and the control lane (credits alone), each way.
data_up() {
  "$B/deepepctl" -s "$sock" peers --json >"$d/peers.json" 2>&1 &&
    grep -qE '"data_out":3[,}]' "$d/peers.json" && grep -qE '"data_in":3[,}]' "$d/peers.json"
}
# The job's payload_out in deepepctl status --json (the rows its proxy sent).
payload_out() {
  "$B/deepepctl" -s "$sock" status --json | python3 -c '
import json, sys
def find(o, job):
    if isinstance(o, dict):
        if o.get("job_id") == job:
            return o
        o = list(o.values())
    if isinstance(o, list):
        for v in o:
            f = find(v, job)
            if f is not None:
                return f
    return None
def value(o, key):
    if isinstance(o, dict):
        if key in o:
            return o[key]
        o = list(o.values())
    if isinstance(o, list):
        for v in o:
            f = value(v, key)
            if f is not None:
                return f
    return None
j = find(json.load(sys.stdin), sys.argv[1])
print(value(j, "payload_out") if j is not None else "none")' "$1"
}

if [[ $RDMAVM_NODE == 1 ]]; then
  echo $(( (RANDOM << 15 | RANDOM) + 1 )) >"$RDMAVM_SHARED/seed"
fi
barrier seeded 120
export DEP_TEST_SEED=$(cat "$RDMAVM_SHARED/seed")
say "node $RDMAVM_NODE: seed $DEP_TEST_SEED"
first=$((2 * (RDMAVM_NODE - 1)))

# Each case: rows a chunk (0: whole blocks), then XRANK_HIDDEN and XRANK_TOKENS (empty: xrank's).
for c in 1:: 3:: 0:: 0:6144:200; do
  IFS=: read -r chunk hidden tokens <<<"$c"
  export XRANK_HIDDEN=$hidden XRANK_TOKENS=$tokens
  stream=()
  [[ $chunk == 0 ]] || stream=("stream_chunk_rows: $chunk")
  how=$([[ $chunk == 0 ]] && echo "whole blocks" || echo "chunks of $chunk row(s)")
  [[ -z $hidden ]] || how="$how of hidden $hidden, $tokens tokens"
  key=$chunk${hidden:+big} # the case's name in barriers, files and the job id
  # The large shape's slabs and exchange regions (about 80 MiB for two ranks) need a larger pool.
  peer_config "$d" "connection_pool_size: 2" "transport: rdma" ${stream[@]+"${stream[@]}"} \
    "limits: {op_timeout_ms: $OP_MS, attach_timeout_ms: 120000}" |
    sed "s/host_size: 64MiB/host_size: $([[ -z $hidden ]] && echo 64 || echo 256)MiB/" >"$d/deepepd.yaml"
  : >"$d/log"
  "$B/deepepd" -c "$d/deepepd.yaml" 2>>"$d/log" &
  pid=$!
  wait_until 120 rdma_data || { show; fail "the data path's queue pair did not come up within 120 s"; }
  wait_until 60 data_up || { cat "$d/peers.json"; show; fail "not 2 TCP data connections each way"; }
  barrier "up.$key" 180
  job=once$key
  rm -f "$d/hold"
  for l in 0 1; do
    XRANK_ONCE=$d/hold XRANK_CHUNK=$chunk "$d/xrank" "$sock" "$job" $((first + l)) $l 2 1 \
      >"$d/once.$l" 2>&1 &
    eval "rank$l=\$!"
  done
  # Both ranks have dispatched and checked (or one failed), then hold the job.
  said() { grep -qE "rank .*: (once|attach)" "$d/once.0" && grep -qE "rank .*: (once|attach)" "$d/once.1"; }
  wait_until 240 said || { cat "$d/once.0" "$d/once.1"; show; fail "$how: the ranks did not dispatch"; }
  rows=0 per_rank=0 rb=0
  for l in 0 1; do
    line=$(cat "$d/once.$l")
    say "node $RDMAVM_NODE, $how: $line"
    [[ $line =~ once\ ok:\ ([0-9]+)\ rows\ for\ other\ nodes,\ ([0-9]+)\ for\ their\ ranks,\ ([0-9]+)\ bytes ]] \
      || { show; fail "$how: rank $((first + l)): $line"; }
    rows=$((rows + BASH_REMATCH[1])) per_rank=$((per_rank + BASH_REMATCH[2])) rb=${BASH_REMATCH[3]}
  done
  # Both nodes' counts: a seed whose tokens go to one rank of a node at most shows nothing.
  echo "$rows $per_rank" >"$RDMAVM_SHARED/counts.$RDMAVM_NODE.$key"
  got=$(payload_out "$job")
  want=$((rows * rb))
  "$B/deepepctl" -s "$sock" peers --json >"$d/peers.json"
  [[ $got == "$want" ]] \
    || { show; fail "$how: the job sent $got bytes of rows; $rows rows of $rb bytes once per destination node are $want; once per destination rank, $((per_rank * rb))"; }
  grep -qE '"data_frames_out":0[,}]' "$d/peers.json" \
    || { cat "$d/peers.json"; show; fail "$how: frames went over the TCP data connections"; }
  grep -qE '"rdma_bytes_out":[1-9]' "$d/peers.json" \
    || { cat "$d/peers.json"; show; fail "$how: nothing went as RDMA writes"; }
  say "node $RDMAVM_NODE, $how: payload_out $got bytes = $rows rows x $rb bytes once per destination node (once per destination rank: $per_rank rows, $((per_rank * rb)) bytes), no TCP frame"
  barrier "counted.$key" 120
  if [[ $RDMAVM_NODE == 1 ]]; then
    read -r r1 p1 <"$RDMAVM_SHARED/counts.1.$key"
    read -r r2 p2 <"$RDMAVM_SHARED/counts.2.$key"
    ((p1 + p2 > r1 + r2)) \
      || fail "$how: no token went to both ranks of the other node: the scenario shows nothing (seed $DEP_TEST_SEED)"
  fi
  touch "$d/hold"
  for l in 0 1; do
    eval "wait \$rank$l" || { cat "$d/once.$l"; show; fail "$how: rank $((first + l)) failed"; }
  done
  barrier "done.$key" 120
  kill -TERM "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
  ! grep -qE "Sanitizer|runtime error:" "$d/log" || { show; fail "the daemon's sanitizer found an error"; }
  pid=
  barrier "stopped.$key" 60
done
say "node $RDMAVM_NODE: done"
