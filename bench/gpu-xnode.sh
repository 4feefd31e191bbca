#!/bin/bash
# gpu-xnode.sh — issue 14's GPU pass in one command (DEVICE.md): jobs that
# span daemons on the cuda backend, two or three daemons on this machine
# sharing its GPU over TCP on loopback (check_xnode's gpu case: the kernels'
# exchange region and ring in host memory, which the proxies read and
# write with plain loads and stores), under
# MPS (the daemons outside it, as tu_daemon_start keeps them), then the
# single-node oracle suite (check_cuda_ops' oracle case) on the same build,
# then the first layouts once more time-sliced (no MPS: nothing deadlocks
# there).  Logs under $OUT, one file per step.
# Build here first with: make BUILD=build-gpu STATIC_DEPS=1 all build-gpu/check_deepepd
# Usage there, from the repository root: bench/gpu-xnode.sh [BUILD_DIR]
# Knobs: STEPS (default "xnode oracle sliced"; "ep": bench/ep across two
# daemons and on one, and loopback TCP round trips; "epctas": the same at each SM budget
# of EP_CTAS; "elastic": bench/elastic
# on one daemon and two, host and cuda; "hostwarm": the host backend's first
# calls with and without its warm-up; "splitx": split low-latency calls across
# two daemons, check_xnode_split.c's gpu case; "epstream": bench/ep across two
# daemons streaming in chunks of EP_CHUNK rows against whole blocks; "streamx": jobs that stream
# (stream_chunk_rows) on one daemon, check_cuda_ops_stream.c's gpu case, then
# across two and three, check_xnode_stream.c's), SECS (per step, 150;
# STREAMX_SECS for streamx's, 600), PROXY_THREADS (the daemons' proxy_threads, 0: their default), CONNS (their
# connection_pool_size, 2), EP_ARGS (more bench/ep options for the epctas step, e.g. "-G 1000":
# each rank pauses 1 s between attach and its first call), SSAI (0 or 1: the whole pass in a
# fresh network namespace whose net.ipv4.tcp_slow_start_after_idle is SSAI, root only; Linux's
# default 1 restarts a connection idle past its retransmission timeout from a small window).
set -u
# lo_up: bring this namespace's loopback up, with ip(8) or, where there is none (the GPU
# machine has none), the SIOCGIFFLAGS/SIOCSIFFLAGS ioctls from Python.
lo_up() {
  command -v ip >/dev/null && { ip link set lo up; return; }
  python3 -c 'import fcntl, socket, struct
s = socket.socket(); r = struct.pack("16sH22x", b"lo", 0)
f = struct.unpack("16sH22x", fcntl.ioctl(s, 0x8913, r))[1]
fcntl.ioctl(s, 0x8914, struct.pack("16sH22x", b"lo", f | 1))'
}
if [ -n "${SSAI:-}" ] && [ -z "${DEP_GX_NETNS:-}" ]; then
  exec unshare -n env DEP_GX_NETNS=1 bash -c "$(declare -f lo_up)"'
    lo_up && echo "$SSAI" > /proc/sys/net/ipv4/tcp_slow_start_after_idle && exec "$0" "$@"' \
    "$0" "$@"
fi
B=$(cd "${1:-build-gpu}" && pwd) || exit 2
OUTD=${OUT:-/tmp/dep-out}
mkdir -p "$OUTD"
exec > >(tee "$OUTD/gpu-xnode.log") 2>&1
date -u; nvidia-smi --query-gpu=name,uuid,driver_version,memory.total,compute_mode --format=csv,noheader
[ -n "${DEP_GX_NETNS:-}" ] &&
  echo "== a fresh network namespace: tcp_slow_start_after_idle $(cat /proc/sys/net/ipv4/tcp_slow_start_after_idle)"
echo "== missing libraries (none expected):"; ldd "$B"/deepepd "$B"/check_deepepd | grep 'not found'
export DEP_BUILD=$B DEP_TEST_TAGS=gpu DEP_TEST_BACKEND=cuda CK_VERBOSITY=verbose

# step NAME SUITE CASE: one case of the GPU tests under timeout, its log in $OUTD/NAME.log.
step() {
  local t0=$SECONDS rc
  echo "== $1: CK_RUN_SUITE=$2 CK_RUN_CASE=$3"
  CK_RUN_SUITE=$2 CK_RUN_CASE=$3 timeout "${SECS:-150}" "$B"/check_deepepd > "$OUTD/$1.log" 2>&1
  rc=$?
  grep -E "xnode gpu:|xnode_stream gpu:|cuda_ops stream:|cuda_ops processes:|Checks:|Failures|Skipped|skipped:|:F:|:E:" "$OUTD/$1.log" | head -40
  echo "== $1 rc $rc in $((SECONDS - t0)) s$([ $rc = 124 ] && echo ' (timed out)')"
}

. "$(dirname "${BASH_SOURCE[0]}")/mps.sh"

# pair_up BACKEND LOGTAG: two daemons of BACKEND on loopback, each the other's
# peer, started outside MPS (before it), in a new directory $D (n0.sock,
# n1.sock); returns once each sees the other up.
pair_up() {
  local i t
  D=$(mktemp -d /tmp/dep-gx.XXXXXX)
  "$B"/deepepctl genkey "$D/peer.key" >/dev/null
  for i in 0 1; do
    cat > "$D/n$i.yaml" <<YAML
socket: {path: $D/n$i.sock}
backend: $1
pool: {size_per_device: 8GiB, chunk_size: 1GiB, host_size: 2GiB}
connection_pool_size: ${CONNS:-2}
listen: {address: 127.0.0.1, port: $((7481 + i))}
peers: [{host: 127.0.0.1, port: $((7482 - i))}]
peer_key_file: $D/peer.key
peer_wait_ms: 0
limits: {attach_timeout_ms: 60000}
stream_chunk_rows: ${CHUNK_ROWS:-0}
proxy_threads: ${PROXY_THREADS:-0}
YAML
    env -u CUDA_MPS_PIPE_DIRECTORY -u CUDA_MPS_LOG_DIRECTORY "$B"/deepepd -c "$D/n$i.yaml" \
      2> "$OUTD/$2-deepepd-n$i.log" &
    DPIDS[$i]=$!
  done
  for i in 0 1; do
    for t in $(seq 300); do
      "$B"/deepepctl -s "$D/n$i.sock" peers --json 2>/dev/null | grep -q '"state":"up"' && break
      sleep 0.1
    done
  done
}

# daemons_cpu: the CPU time pair_up's daemons have taken so far, in clock ticks (user and
# system, every thread: the proxy threads and receivers that look take theirs).
daemons_cpu() {
  local i t=0
  for i in "${DPIDS[@]}"; do
    t=$((t + $(awk '{print $14 + $15}' "/proc/$i/stat" 2>/dev/null || echo 0)))
  done
  echo $t
}

# Two cuda daemons on loopback: bench/ep's ranks spread over them, then all on
# the first (the same job on one node), then the TCP round trip of the LL ops'
# bytes on loopback (bench/xnode_pingpong) and the bus between the GPU and
# pinned host memory (bench/hostbus, where the build has it), all in this one step.
ep_step() {
  local D t0=$SECONDS i
  pair_up "${EP_BACKEND:-cuda}" ep
  mps_on
  echo "== ep: two daemons, ranks spread over them"
  timeout 120 "$B"/bench/ep -s "$D/n0.sock,$D/n1.sock" -n 2,4 -m processes -t ${EP_TOKENS:-128} \
    -l ${EP_LL:-8,128} -c ${EP_CALLS:-50} 2>&1 | tee "$OUTD/ep-spread.txt"
  echo "== ep: the same on one daemon"
  timeout 90 "$B"/bench/ep -s "$D/n0.sock" -n 2,4 -m processes -t ${EP_TOKENS:-128} \
    -l ${EP_LL:-8,128} -c ${EP_CALLS:-50} 2>&1 | tee "$OUTD/ep-one.txt"
  "$B"/deepepctl -s "$D/n0.sock" peers 2>&1 | tee "$OUTD/ep-peers.txt"
  "$B"/bench/xnode_pingpong -l 127.0.0.1:7489 & local pp=$!
  sleep 0.3
  echo "== TCP round trips on loopback"
  timeout 30 "$B"/bench/xnode_pingpong -c 127.0.0.1:7489 -b ${PP_BYTES:-16384,262144,1048576,8388608} \
    -i 200 2>&1 | tee "$OUTD/ep-pingpong.txt"
  kill $pp 2>/dev/null
  for i in 0 1; do "$B"/deepepctl -s "$D/n$i.sock" status > "$OUTD/ep-status-n$i.txt" 2>&1; done
  pkill -TERM -f "deepepd -c $D/" ; sleep 1
  mps_off
  if [ -x "$B"/bench/hostbus ]; then
    echo "== the bus between the GPU and pinned host memory (bench/hostbus)"
    timeout 60 "$B"/bench/hostbus 2>&1 | tee "$OUTD/ep-hostbus.txt"
  fi
  echo "== ep step in $((SECONDS - t0)) s"
}

# The SM budget across daemons: bench/ep spread over two daemons and on one, at each
# $DEEPEP_KERNEL_CTAS of EP_CTAS ("default": unset, the library's own budget), one pair of
# daemons for all, so that a call's time is read against its CTAs on both paths in one run.
epctas_step() {
  local D t0=$SECONDS c where
  pair_up cuda epctas
  mps_on
  for c in ${EP_CTAS:-default 4 8 16 32}; do
    for where in "$D/n0.sock,$D/n1.sock" "$D/n0.sock"; do
      echo "== epctas: CTAs $c, daemons ${where//$D\//}"
      local c0 w0=$(date +%s%N)
      c0=$(daemons_cpu)
      ( [ "$c" = default ] || export DEEPEP_KERNEL_CTAS=$c
        timeout 120 "$B"/bench/ep -s "$where" -n 2,4 -m processes -t ${EP_TOKENS:-128} \
          -l ${EP_LL:-8} -c ${EP_CALLS:-50} ${EP_ARGS:-} ) 2>&1 | tee -a "$OUTD/epctas.txt"
      echo "== epctas: the daemons took $(( ($(daemons_cpu) - c0) * 1000 / $(getconf CLK_TCK) )) ms" \
        "of CPU in $(( ($(date +%s%N) - w0) / 1000000 )) ms" | tee -a "$OUTD/epctas.txt"
    done
  done
  pkill -TERM -f "deepepd -c $D/"; sleep 1
  mps_off
  echo "== epctas step in $((SECONDS - t0)) s"
}

# Streaming across nodes on cuda (issue 27): bench/ep across two daemons whose jobs stream in
# chunks of EP_CHUNK rows (64) against the same with whole blocks, alternated EP_ROUNDS (2) times, one pair
# of daemons at a time, with each daemon's lent bytes (deepepctl status) beside.
epstream_step() {
  local D t0=$SECONDS r c
  for r in $(seq ${EP_ROUNDS:-2}); do
    for c in 0 ${EP_CHUNK:-64}; do
      CHUNK_ROWS=$c pair_up "${EP_BACKEND:-cuda}" "epstream-$c-$r"
      mps_on
      echo "== epstream: chunk rows $c, round $r"
      timeout 120 "$B"/bench/ep -s "$D/n0.sock,$D/n1.sock" -n 2,4 -m processes \
        -t ${EP_TOKENS:-512} -l ${EP_LL:-8} -c ${EP_CALLS:-30} 2>&1 |
        tee "$OUTD/epstream-$c-$r.txt"
      "$B"/deepepctl -s "$D/n0.sock" size --world 4 --ranks-per-node 2 \
        --tokens ${EP_TOKENS:-512} --chunk-rows $c 2>&1 | tail -3
      pkill -TERM -f "deepepd -c $D/"; sleep 1
      mps_off
    done
  done
  echo "== epstream step in $((SECONDS - t0)) s"
}

# Elastic jobs (issue 25): bench/elastic, 8 ranks, on one daemon and as 4 + 4
# over two, on the host backend (this machine's quiet CPUs) and on cuda (-g,
# the ranks under MPS).
elastic_step() {
  local D t0=$SECONDS be g
  for be in ${ELASTIC_BACKENDS:-host cuda}; do
    pair_up "$be" "elastic-$be"
    g=; [ "$be" = cuda ] && { g=-g; mps_on; }
    echo "== elastic ($be): one daemon"
    timeout 120 "$B"/bench/elastic -s "$D/n0.sock" $g -c ${ELASTIC_CYCLES:-10} 2>&1 |
      tee "$OUTD/elastic-$be-one.txt"
    echo "== elastic ($be): 4 + 4 over two daemons"
    timeout 120 "$B"/bench/elastic -s "$D/n0.sock,$D/n1.sock" $g -c ${ELASTIC_CYCLES:-10} 2>&1 |
      tee "$OUTD/elastic-$be-two.txt"
    pkill -TERM -f "deepepd -c $D/"; sleep 1
    [ "$be" = cuda ] && mps_off
  done
  echo "== elastic step in $((SECONDS - t0)) s"
}

# The host backend's warm-up (kernel_warmup maps the slabs' pages in at
# attach): bench/ep's first calls against a daemon with it and one without,
# in the same run, on this machine's quiet CPUs.
hostwarm_step() {
  local D n t0=$SECONDS
  D=$(mktemp -d /tmp/dep-hw.XXXXXX)
  for n in on off; do
    printf 'socket: {path: %s/%s.sock}\nbackend: host\npool: {host_size: 4GiB}\nkernel_warmup: %s\n' \
      "$D" $n "$([ $n = on ] && echo true || echo false)" > "$D/$n.yaml"
    "$B"/deepepd -c "$D/$n.yaml" 2> "$OUTD/hostwarm-deepepd-$n.log" &
  done
  for n in on off; do
    for t in $(seq 300); do "$B"/deepepctl -s "$D/$n.sock" status >/dev/null 2>&1 && break; sleep 0.1; done
  done
  echo "== hostwarm: bench/ep, host backend, kernel_warmup true (-s) and false (-S)"
  timeout 150 "$B"/bench/ep -s "$D/on.sock" -S "$D/off.sock" -n 2,4,8 -m processes -c 100 \
    -t ${HW_TOKENS:-256} -l 128 -H 7168 -e 256 -k 8 -w 5 -r 20 2>&1 | tee "$OUTD/hostwarm-ep.txt"
  pkill -TERM -f "deepepd -c $D/"; sleep 1
  echo "== hostwarm step in $((SECONDS - t0)) s"
}

for s in ${STEPS:-xnode oracle sliced}; do
  case $s in
  ep) ep_step ;;
  epctas) epctas_step ;;
  epstream) epstream_step ;;
  elastic) elastic_step ;;
  hostwarm) hostwarm_step ;;
  xnode) mps_on; step xnode-mps xnode gpu ;;
  splitx) mps_on; step splitx-mps xnode_split gpu ;;
  streamx) mps_on; SECS=${STREAMX_SECS:-600} step stream-mps cuda_ops stream
           SECS=${STREAMX_SECS:-600} step streamx-mps xnode_stream gpu ;;
  oracle) step oracle-mps cuda_ops oracle; mps_off ;;
  sliced) [ -n "${CUDA_MPS_PIPE_DIRECTORY:-}" ] && mps_off
          CK_RUN_CASE=gpu SECS=${SLICED_SECS:-90} step xnode-sliced xnode gpu ;;
  esac
done
[ -n "${CUDA_MPS_PIPE_DIRECTORY:-}" ] && mps_off
date -u
