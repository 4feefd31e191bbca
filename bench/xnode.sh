#!/usr/bin/env bash
# xnode.sh — the benchmark between nodes on the host backend (issue 14): two
# "nodes" as two network namespaces joined by a veth pair, one deepepd in
# each (the other its peer), and bench/ep's ranks spread over them; beside
# it, in the same run and between the same namespaces, the ceilings: raw
# TCP with as many streams as the daemons open data connections each way
# (iperf3; each daemon's control lane, one more connection each way that
# carries only credits, is not counted), and a TCP round trip of each
# low-latency operation's bytes (bench/xnode_pingpong), and the same
# throughput job with every rank on one daemon (no network: what the ranks'
# own work costs).  Prints one table
# with the issue's ratios, and for each ep run every daemon and rank
# thread's CPU time as a share of the run's wall time (which thread bounds
# the run: a proxy deepepd-px*, a receiver deepepd-rx, a rank's calls);
# everything it made (namespaces, daemons, scratch) goes at exit.
#
#   bench/xnode.sh [BUILD]          as root; BUILD defaults to build
#
# Knobs (environment): TOKENS (throughput token counts, "128 256 512"),
# LL_TOKENS (low-latency token counts, "1 8 32 128"), RANKS (ranks per
# world, "2 4": 1+1 and 2+2), HIDDEN (7168), CALLS (timed calls per op, 100),
# CONNS (connection_pool_size, so data connections each way, 2), TCP_SECONDS
# (iperf3's run, 5), OUT (also write everything to this file), KEEP=1 (keep
# the scratch directory with the daemons' logs), STREAM (the daemons'
# stream_chunk_rows: auto, their default; 0: whole blocks; N rows), NICE (run the daemons,
# ranks and ceilings at this nice value, e.g. -10 on a machine that others
# load; every figure of a run is taken at the same one), THREADS_TOP (threads
# listed for each ep run, the busiest first, 12), PROXY_THREADS (the daemons' proxy_threads,
# 0: their default), EP_ARGS (more bench/ep options, e.g.
# "-G 2000": each rank pauses 2 s between attach and its first call), TCP_SSAI (the
# namespaces' net.ipv4.tcp_slow_start_after_idle, 0 or 1; unset: their default).
set -euo pipefail

BUILD=${1:-build}
TOKENS=${TOKENS:-128 256 512}
LL_TOKENS=${LL_TOKENS:-1 8 32 128}
RANKS=${RANKS:-2 4}
HIDDEN=${HIDDEN:-7168}
CALLS=${CALLS:-100}
CONNS=${CONNS:-2}
STREAM=${STREAM:-auto}
TCP_SECONDS=${TCP_SECONDS:-5} # (not SECONDS: bash keeps its own)
NICE=${NICE:-0}
THREADS_TOP=${THREADS_TOP:-12}
PROXY_THREADS=${PROXY_THREADS:-0}
PORT=7471    # the daemons' listen port
PP_PORT=7472 # the ping-pong's
ADDR=(10.79.0.1 10.79.0.2)

die() { echo "xnode: $*" >&2; exit 1; }
[[ $(id -u) == 0 ]] || die "run as root: network namespaces need CAP_SYS_ADMIN"
command -v ip >/dev/null || die "no ip (apt-get install iproute2, or make deps)"
command -v iperf3 >/dev/null || die "no iperf3 (apt-get install iperf3, or make deps)"
command -v python3 >/dev/null || die "no python3 (it reads iperf3's JSON)"
for b in deepepd deepepctl bench/ep bench/xnode_pingpong; do
  [[ -x $BUILD/$b ]] || die "no $BUILD/$b: build it first (make BUILD=$BUILD all)"
done
BUILD=$(cd "$BUILD" && pwd)

DIR=$(mktemp -d /tmp/dep-xnode-XXXXXX)
NS=(dxn$$a dxn$$b)
PIDS=()
exec 3>&1 4>&2 # the caller's stdout and stderr, for the cleanup (OUT's tee may be gone)
cleanup() {
  trap '' PIPE INT TERM # a second signal must not cut the cleanup short
  exec 1>&3 2>&4
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  for t in $(seq 100); do # the daemons stop in a few seconds; then SIGKILL
    local alive=0
    for p in "${PIDS[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
    (( alive )) || break
    sleep 0.1
  done
  for p in "${PIDS[@]}"; do kill -KILL "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done
  for n in "${NS[@]}"; do ip netns delete "$n" 2>/dev/null || true; done
  if [[ ${KEEP:-0} == 1 ]]; then echo "xnode: kept $DIR" >&2; else rm -rf "$DIR"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# ---- the nodes ---------------------------------------------------------------
for i in 0 1; do
  ip netns add "${NS[i]}"
  ip -n "${NS[i]}" link set lo up
done
ip link add "${NS[0]}" netns "${NS[0]}" type veth peer name "${NS[1]}" netns "${NS[1]}"
for i in 0 1; do
  ip -n "${NS[i]}" addr add "${ADDR[i]}/24" dev "${NS[i]}"
  ip -n "${NS[i]}" link set "${NS[i]}" up
  # A TCP connection idle past its retransmission timeout starts slowly again (RFC 2861)
  # unless the namespace's net.ipv4.tcp_slow_start_after_idle is 0: TCP_SSAI sets it.
  [[ -z ${TCP_SSAI:-} ]] ||
    ip netns exec "${NS[i]}" sysctl -q -w net.ipv4.tcp_slow_start_after_idle="$TCP_SSAI" ||
    die "cannot set net.ipv4.tcp_slow_start_after_idle in ${NS[i]}"
done
"$BUILD/deepepctl" genkey "$DIR/peer.key" >/dev/null

# A node's ranks of the largest shape (2 x 512 tokens x 7168 hidden, LL 128)
# take well under 1 GiB of slab; the first node's pool also holds the whole
# world of the largest run on one daemon (the one-node reference below), as
# `deepepctl size` gives it.  The pools are made once at start, and the
# benchmark waits for them (log_level info says "device pools ready").
MAXR=$(printf '%s\n' $RANKS | sort -n | tail -1)
MAXT=$(printf '%s\n' $TOKENS $LL_TOKENS | sort -n | tail -1)
MAXL=$(printf '%s\n' $LL_TOKENS | sort -n | tail -1)
ONE_BYTES=$("$BUILD/deepepctl" --json size --world "$MAXR" --ranks-per-node "$MAXR" \
  --tokens "$MAXT" --ll-tokens "$MAXL" --hidden "$HIDDEN" --chunk-rows "${STREAM/auto/0}" |
  python3 -c 'import json, sys; print(json.load(sys.stdin)["total_bytes"])') ||
  die "deepepctl size failed for the one-node reference"
POOL=(1 1)
POOL[0]=$(( (MAXR * ONE_BYTES * 5 / 4 + (1 << 30) - 1) >> 30 ))
(( POOL[0] >= 1 )) || POOL[0]=1
for i in 0 1; do
  cat >"$DIR/n$i.yaml" <<EOF
socket: {path: $DIR/n$i.sock}
backend: host
pool: {host_size: ${POOL[i]}GiB}
connection_pool_size: $CONNS
stream_chunk_rows: $STREAM
proxy_threads: $PROXY_THREADS
listen: {address: ${ADDR[i]}, port: $PORT}
peers: [{host: ${ADDR[1 - i]}, port: $PORT}]
peer_key_file: $DIR/peer.key
peer_wait_ms: 0
log_level: info
limits: {attach_timeout_ms: 20000}
EOF
  ip netns exec "${NS[i]}" nice -n "$NICE" "$BUILD/deepepd" -c "$DIR/n$i.yaml" 2>"$DIR/n$i.log" &
  PIDS+=($!)
done
# Ready when each daemon has made its pool and its PEERS shows the peer up
# (the data connections follow at once, over the authenticated link).
for i in 0 1; do
  for t in $(seq 600); do
    if grep -q 'device pools ready' "$DIR/n$i.log" &&
       "$BUILD/deepepctl" -s "$DIR/n$i.sock" peers --json 2>/dev/null | grep -q '"state":"up"'; then
      break
    fi
    [[ $t == 600 ]] && { cat "$DIR/n$i.log" >&2; die "node $i is not ready with its peer up in 30 s"; }
    sleep 0.05
  done
done

[[ -n ${OUT:-} ]] && exec > >(tee "$OUT") 2>&1

echo "# xnode: $(date -u '+%Y-%m-%d %H:%M UTC'), $(uname -n), $(nproc) CPUs" \
     "($(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -1)), commit" \
     "$(git -C "$(dirname "$0")" rev-parse --short HEAD 2>/dev/null || echo '?')"
echo "# two namespaces over veth (${ADDR[0]}, ${ADDR[1]}), deepepd host backend," \
     "connection_pool_size $CONNS (and a control lane), stream_chunk_rows $STREAM, proxy_threads $PROXY_THREADS (0: the daemons' default, one per 4 CPUs); nice $NICE;" \
     "tcp_slow_start_after_idle $(ip netns exec "${NS[0]}" cat /proc/sys/net/ipv4/tcp_slow_start_after_idle);" \
     "load average at start:" \
     "$(cut -d' ' -f1-3 /proc/loadavg)"

# ---- the threads' CPU time --------------------------------------------------------
# During each ep run a sampler reads every thread's utime + stime
# (/proc/PID/task/TID/stat) of the daemons and of ep's processes (its ranks)
# every 0.1 s until ep exits: a thread's busy share is what it used over
# the run's wall time (from its value before the run, or from 0 for a thread
# that started during it), and its peak is its busiest 1 s.  The threads
# are named (top -H): deepepd-px<N> the proxies, deepepd-rx the receivers,
# deepepd-dc the connectors, deepepd-fill the exchange regions' populate;
# a rank's calls run on its main thread (ep), deepep-warmup its warm-up.  A
# thread that ends between two samples loses what it used since the last.
cat >"$DIR/threads.py" <<'EOF'
import os, sys, time
ep, daemons = int(sys.argv[1]), [int(p) for p in sys.argv[2].split()]
hz, top = os.sysconf("SC_CLK_TCK"), int(sys.argv[3])
def stat(path):  # (comm, ppid, utime + stime in ticks) of a /proc stat file, or None
    try:
        with open(path) as f:
            s = f.read()
    except OSError:
        return None
    rest = s[s.rindex(")") + 2:].split()
    return s[s.index("(") + 1:s.rindex(")")], int(rest[1]), int(rest[11]) + int(rest[12])
def procs():  # the daemons and ep's processes: pid -> label
    parent = {}
    for d in os.listdir("/proc"):
        st = d.isdigit() and stat("/proc/%s/stat" % d)
        if st:
            parent[int(d)] = st[1]
    out = {}
    for p in parent:
        q, hops = p, 0
        while q > 1 and hops < 64 and q not in daemons and q != ep:
            q, hops = parent.get(q, 0), hops + 1
        if q in daemons:
            out[p] = "deepepd n%d" % daemons.index(q)
        elif q == ep:
            out[p] = "ep" if p == ep else "rank %d" % p
    return out
seen, t0, first = {}, time.monotonic(), True  # (pid, tid) -> [label, comm, start, [(t, ticks)]]
while True:
    now = time.monotonic()
    for pid, label in procs().items():
        try:
            tids = os.listdir("/proc/%d/task" % pid)
        except OSError:
            continue
        for tid in tids:
            st = stat("/proc/%d/task/%s/stat" % (pid, tid))
            if st is None:
                continue
            k = (pid, int(tid))
            if k not in seen:  # there before the run: from its value then; else from 0
                base = st[2] if first else 0
                seen[k] = [label, st[0], base, [(now, base)]]
            seen[k][1] = st[0]
            seen[k][3].append((now, st[2]))
    first = False
    try:  # until ep has exited (a zombie until the script reaps it)
        with open("/proc/%d/stat" % ep) as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                break
    except OSError:
        break
    time.sleep(0.1)
wall = time.monotonic() - t0
rows = []
for (pid, tid), (label, comm, start, samples) in seen.items():
    peak, j = 0.0, 0
    for i in range(len(samples)):
        while j + 1 < i and samples[i][0] - samples[j + 1][0] >= 1.0:
            j += 1
        if samples[i][0] - samples[j][0] >= 1.0:
            peak = max(peak, (samples[i][1] - samples[j][1]) / hz / (samples[i][0] - samples[j][0]))
    cpu = (samples[-1][1] - start) / hz
    rows.append((cpu, peak, label, tid, comm))
rows.sort(reverse=True)
print("# %.1f s of wall time, %d threads seen; the top %d by CPU:" % (wall, len(rows), top))
print("%7s %7s %8s  %-14s %8s  %s" % ("busy%", "peak%", "cpu_s", "process", "tid", "thread"))
for cpu, peak, label, tid, comm in rows[:top]:
    print("%7.1f %7.1f %8.2f  %-14s %8d  %s" % (100 * cpu / wall, 100 * peak, cpu, label, tid, comm))
EOF

# ---- the ceilings ---------------------------------------------------------------
# Raw TCP, as many streams as data connections each way: an operation sends
# both ways at once, each daemon with its own sender and receivers, so two
# iperf3 clients, one each way, in processes of their own, at once (iperf3
# --bidir runs both ways in one thread, which on few CPUs starves one
# direction); per direction, their mean.  Sampled before the first ep run
# and after each, so that every row is held against the rate of the same
# minutes (a shared machine's load moves); a row's ceiling is the mean of
# the samples either side of its run.  The TCP round trip of each
# low-latency op's bytes follows its run likewise.
iperf_recv() { # JSON file -> GB/s received
  python3 -c 'import json, sys
print("%.3f" % (json.load(open(sys.argv[1]))["end"]["sum_received"]["bits_per_second"] / 8e9))' "$1"
}
tcp_run() { # from-node to-node json
  timeout $((TCP_SECONDS + 30)) ip netns exec "${NS[$1]}" nice -n "$NICE" iperf3 -c "${ADDR[$2]}" \
    -p 5201 -B "${ADDR[$1]}" -P "$CONNS" -t "$TCP_SECONDS" -J >"$3"
}
TCP_N=0
tcp_sample() { # appends "a->b b->a mean" to $DIR/tcp.txt; TCP_LAST is the mean
  tcp_run 0 1 "$DIR/iperf3-ab-$TCP_N.json" &
  local ab=$!
  tcp_run 1 0 "$DIR/iperf3-ba-$TCP_N.json"
  wait "$ab"
  local a b
  a=$(iperf_recv "$DIR/iperf3-ab-$TCP_N.json")
  b=$(iperf_recv "$DIR/iperf3-ba-$TCP_N.json")
  TCP_LAST=$(awk -v a="$a" -v b="$b" 'BEGIN { printf "%.3f", (a + b) / 2 }')
  echo "$a $b $TCP_LAST" >>"$DIR/tcp.txt"
  TCP_N=$((TCP_N + 1))
}
for i in 0 1; do
  ip netns exec "${NS[i]}" nice -n "$NICE" iperf3 -s -B "${ADDR[i]}" -p 5201 >/dev/null 2>&1 &
  PIDS+=($!)
done
ip netns exec "${NS[1]}" nice -n "$NICE" "$BUILD/bench/xnode_pingpong" -l "${ADDR[1]}:$PP_PORT" \
  >"$DIR/pp-server.txt" &
PIDS+=($!)
for t in $(seq 100); do grep -q listening "$DIR/pp-server.txt" && break; sleep 0.05; done
sleep 0.3
tcp_run 0 1 "$DIR/iperf3-oneway.json"
TCP_ONE=$(iperf_recv "$DIR/iperf3-oneway.json")
: >"$DIR/pp.txt"
tcp_sample

# ---- the benchmark -------------------------------------------------------------
# One ep run per token count, timing the throughput pair at TOKENS and the
# low-latency pairs (bf16, FP8) at LL_TOKENS (-p); a count in only one list
# times only its pairs, with -l at most the largest LL count.
SOCKS="$DIR/n0.sock,$DIR/n1.sock"
NLIST=$(echo $RANKS | tr ' ' ',')
declare -A want_tp want_ll
for t in $TOKENS; do want_tp[$t]=1; done
for t in $LL_TOKENS; do want_ll[$t]=1; done
for t in $(printf '%s\n' $TOKENS $LL_TOKENS | sort -nu); do
  l=$t pairs=
  [[ -n ${want_ll[$t]:-} ]] || l=$(printf '%s\n' $LL_TOKENS | sort -n | tail -1)
  (( l > t )) && l=$t
  [[ -n ${want_tp[$t]:-} ]] && pairs=tp
  [[ -n ${want_ll[$t]:-} ]] && pairs=${pairs:+$pairs,}ll,ll8
  before=$TCP_LAST
  nice -n "$NICE" "$BUILD/bench/ep" -s "$SOCKS" -n "$NLIST" -m processes -t "$t" -l "$l" \
    -H "$HIDDEN" -e 256 -k 8 -c "$CALLS" -w 5 -r 3 -p "$pairs" ${EP_ARGS:-} >"$DIR/ep-$t.txt" &
  ep=$!
  python3 "$DIR/threads.py" "$ep" "${PIDS[0]} ${PIDS[1]}" "$THREADS_TOP" >"$DIR/threads-$t.txt" &
  sampler=$!
  wait "$ep" ||
    { cat "$DIR/ep-$t.txt"; KEEP=1; die "ep -t $t failed (the daemons' logs: $DIR/n*.log)"; }
  wait "$sampler" || echo "# the threads' sampler failed" >>"$DIR/threads-$t.txt"
  # tokens, ll tokens, then ep's row: ranks mode op attach first med p99 MB GB/s rankGB/s
  # copy rkcopy frac first/med nowarm nowarm/med xB xGB/s rkxGB/s
  awk -v t="$t" -v l="$l" -v tp="${want_tp[$t]:-0}" -v ll="${want_ll[$l]:-0}" '
    $2 == "processes" && NF == 19 {
      if (($3 == "dispatch" || $3 == "combine") && tp) print "tp", t, $0
      if ($3 ~ /^ll_/ && ll && l == t) print "ll", l, $0
    }' "$DIR/ep-$t.txt" >>"$DIR/rows.txt"
  # The same throughput job with every rank on the first daemon: no network at all, so what
  # the ranks' own copies (and the host backend's work within a node) cost at this shape.
  if [[ -n ${want_tp[$t]:-} ]]; then
    nice -n "$NICE" "$BUILD/bench/ep" -s "$DIR/n0.sock" -n "$NLIST" -m processes -t "$t" -l "$l" \
      -H "$HIDDEN" -e 256 -k 8 -c "$CALLS" -w 5 -r 3 -p tp ${EP_ARGS:-} >"$DIR/ep1-$t.txt" ||
      { cat "$DIR/ep1-$t.txt"; KEEP=1; die "ep -t $t on one daemon failed"; }
    awk -v t="$t" '$2 == "processes" && NF >= 15 && ($3 == "dispatch" || $3 == "combine") {
      print "one", t, $0 }' "$DIR/ep1-$t.txt" >>"$DIR/rows.txt"
  fi
  SIZES=$(awk -v t="$t" '$1 == "ll" && $2 == t { print $19 }' "$DIR/rows.txt" | sort -nu |
          tr '\n' ',' | sed 's/,$//')
  if [[ -n $SIZES ]]; then
    ip netns exec "${NS[0]}" nice -n "$NICE" "$BUILD/bench/xnode_pingpong" \
      -c "${ADDR[1]}:$PP_PORT" -b "$SIZES" -i 200 -w 10 >"$DIR/pp-$t.txt"
    awk -v t="$t" '$1 ~ /^[0-9]+$/ { print t, $0 }' "$DIR/pp-$t.txt" >>"$DIR/pp.txt"
  fi
  tcp_sample
  echo "$t $(awk -v a="$before" -v b="$TCP_LAST" 'BEGIN { printf "%.3f", (a + b) / 2 }')" \
    >>"$DIR/tcp-run.txt"
done
echo "# raw TCP (iperf3 -P $CONNS each way at once, ${TCP_SECONDS} s, $TCP_N samples):" \
     "per direction $(awk '{ printf "%s%s", (NR > 1 ? ", " : ""), $3 }' "$DIR/tcp.txt") GB/s;" \
     "one way alone $TCP_ONE GB/s"

# ---- the table -----------------------------------------------------------------
echo
echo "## throughput mode (dispatch + combine), hidden $HIDDEN, top-8 of 256 experts, bf16"
awk '
  FILENAME ~ /tcp-run/ { tcp[$1] = $2; next }
  $1 == "tp" {
    k = $2 " " $3; op = $5
    med[k, op] = $8; first[k, op] = $7; xb[k, op] = $19; rk[k, op] = $21 * $8
    keys[k] = 1
  }
  $1 == "one" { one[$2 " " $3, $5] = $8 }
  END {
    printf "%-6s %-5s %9s %9s %9s %9s %9s %8s %7s %7s %7s %9s %7s\n", "tokens", "ranks",
      "xMB/call", "disp_ms", "comb_ms", "rankGB/s", "nodeGB/s", "tcpGB/s", "/tcp", "D 1st/",
      "C 1st/", "1node_ms", "1n/tcp"
    n = 0; for (k in keys) order[++n] = k
    for (i = 1; i <= n; i++) for (j = i + 1; j <= n; j++) {
      split(order[i], a, " "); split(order[j], b, " ")
      if (a[1] + 0 > b[1] + 0 || (a[1] == b[1] && a[2] + 0 > b[2] + 0)) {
        x = order[i]; order[i] = order[j]; order[j] = x }
    }
    for (i = 1; i <= n; i++) {
      k = order[i]; split(k, a, " ")
      d = med[k, "dispatch"]; c = med[k, "combine"]
      node = (xb[k, "dispatch"] + xb[k, "combine"]) / (d + c) / 1e6
      rank = (rk[k, "dispatch"] + rk[k, "combine"]) / (d + c)
      o = one[k, "dispatch"] + one[k, "combine"]
      bound = o > 0 ? (xb[k, "dispatch"] + xb[k, "combine"]) / o / 1e6 : 0
      printf "%-6s %-5s %9.2f %9.3f %9.3f %9.3f %9.3f %8.3f %6.0f%% %6.2fx %6.2fx %9.3f %6.0f%%\n",
        a[1], a[2] / 2 "+" a[2] / 2, (xb[k, "dispatch"] + xb[k, "combine"]) / 1e6, d, c, rank,
        node, tcp[a[1]], 100 * node / tcp[a[1]], first[k, "dispatch"] / d,
        first[k, "combine"] / c, o, 100 * bound / tcp[a[1]]
    }
  }' "$DIR/tcp-run.txt" "$DIR/rows.txt"
echo "# xMB/call: bytes from one node to the other per dispatch + combine (busiest direction);"
echo "# rankGB/s: the smallest rank's bytes to the other node / (disp_ms + comb_ms);"
echo "# nodeGB/s: xMB/call / (disp_ms + comb_ms); tcpGB/s: raw TCP per direction around the run;"
echo "# /tcp: nodeGB/s / tcpGB/s (target >= 80%); 1st/: first call after attach / median"
echo "# (target <= 1.1x); 1node_ms: dispatch + combine of the same job with every rank on one"
echo "# daemon (no network); 1n/tcp: xMB/call / 1node_ms / tcpGB/s, the /tcp a call between the"
echo "# nodes would reach if it took only that: the most the ranks' own work allows"
echo
echo "## low latency, hidden $HIDDEN"
awk '
  FNR == NR { rtt[$1, $2] = $4; next }
  $1 == "ll" {
    r = rtt[$2, $19]
    printf "%-6s %-5s %-15s %9d %9.1f %9.1f %7.2fx %9.1f %7.2fx\n", $2, $3 / 2 "+" $3 / 2, $5,
      $19, $7 * 1e3, $8 * 1e3, $7 / $8, r, $8 * 1e3 / r
  }' "$DIR/pp.txt" <(sort -k2,2n -k3,3n -s "$DIR/rows.txt") |
  { printf "%-6s %-5s %-15s %9s %9s %9s %8s %9s %8s\n" tokens ranks op xbytes first_us med_us \
      1st/med rtt_us med/rtt; cat; }
echo "# xbytes: bytes from one node to the other per call (busiest direction); rtt_us: median"
echo "# TCP round trip of that many bytes each way, one connection (xnode_pingpong, 200 after"
echo "# the op's run);"
echo "# targets: ll_dispatch med/rtt <= 2x, 1st/med <= 1.1x"
echo "# load average at the end: $(cut -d' ' -f1-3 /proc/loadavg)"
echo
echo "## threads: each daemon and rank thread's CPU time during each ep run"
for t in $(printf '%s\n' $TOKENS $LL_TOKENS | sort -nu); do
  echo "### ep -t $t (ranks $NLIST)"
  cat "$DIR/threads-$t.txt"
done
echo "# busy%: the thread's CPU time / the run's wall time (attach, warm-up, every pair and"
echo "# world size of the run); peak%: its busiest 1 s; 100% is one CPU, so a thread near 100%"
echo "# bounds what runs on it"
echo
echo "## bytes between the nodes over the whole run, as the daemons counted them"
for i in 0 1; do
  "$BUILD/deepepctl" -s "$DIR/n$i.sock" --json peers 2>/dev/null | python3 -c '
import json, sys
for p in json.load(sys.stdin)["peers"]:
    print("node %s: %d bytes in %d frames to %s" % (sys.argv[1], p["data_bytes_out"],
          p["data_frames_out"], p["address"]))' "$i" || true
done
echo "# every op's calls (first, warm-up and timed) with their frame headers, slots and credits;"
echo "# two runs of another CALLS give the bytes of one call of a pair by their difference"
echo
echo "## raw outputs"
for f in "$DIR"/ep-*.txt "$DIR"/ep1-*.txt "$DIR/pp.txt"; do echo "### $(basename "$f")"; cat "$f"; done
for i in 0 1; do
  echo "### node $i: deepepctl peers"
  "$BUILD/deepepctl" -s "$DIR/n$i.sock" peers 2>&1 || true
done
