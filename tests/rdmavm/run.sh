#!/usr/bin/env bash
# run.sh — run a command inside a throw-away QEMU guest with a Soft-RoCE
# (rdma_rxe) device, or inside two guests joined by one emulated Ethernet
# link, and exit with the command's status.  This is how the tests reach a
# real (software) RDMA device on machines that have no RDMA hardware and no
# rxe in their own kernel (issue 13).
#
#   tests/rdmavm/run.sh [options] 'command'                   one guest
#   tests/rdmavm/run.sh [options] -2 'node 1 cmd' 'node 2 cmd' two guests
#   tests/rdmavm/run.sh --prepare                             only the cached kernel
#
# The guest runs Debian's own kernel (the one linux-image-amd64 points at:
# the host's kernel has no rxe) under QEMU TCG, with the host's root shared
# read-only over 9p, so a command can run any host binary with the host's
# libraries.  /tmp, /run and /var/tmp are the guest's own tmpfs; a host
# directory under one of them is hidden unless shared with -r or -w (the
# current directory is shared read-only that way by itself).  The command
# runs with bash in the current directory; its output, stdout and stderr,
# comes to stdout with every line prefixed "[nodeN] ".  Two guests' kernels
# are needed for traffic between two rxe devices: one kernel's rxe devices
# do not talk to each other.
#
# The command's environment:
#   RDMAVM_NODE     1, or 2 for the second guest
#   RDMAVM_NODES    1 or 2: how many guests this run has
#   RDMAVM_IP       this guest's IPv4 address (10.77.0.<node>)
#   RDMAVM_PEER_IP  the other guest's address (two guests only; unset with one)
#   RDMAVM_NETDEV   the netdev under the rxe device (eth0 for two guests)
#   RDMAVM_DEV      the rxe device (rxe0)
#   RDMAVM_GID_INDEX  its RoCE v2 IPv4 GID index (for ibv_rc_pingpong -g)
#   RDMAVM_SHARED   a directory both guests and the host share read-write,
#                   empty at the start of each run (for "the other side is
#                   ready" files and logs)
#   plus each -e VAR=VALUE.
#
# Options:
#   -2           two guests, 'node 1 command' 'node 2 command'
#   -t SECS      stop a guest after SECS seconds, exit 124 (default 300)
#   -e VAR=VAL   set VAR in the command's environment (repeatable)
#   -r DIR       share host DIR read-only at its own path (repeatable)
#   -w DIR       share host DIR read-write at its own path (repeatable)
#   -m MB        memory of each guest (default 1024; TCG touches only what is used)
#   -v           say what the harness does and, on failure, show the guest kernel's log
#   --prepare    only make the cached kernel and initramfs, then exit
#
# Exit status: the command's (two guests: the first failure, else 77 if one
# skipped, else 0); 124 a guest timed out; 125 a guest could not be set up
# or died (a harness break, not the command's failure); 77 this machine
# cannot run guests (not root, a missing tool, no kernel package), with the
# reason on stderr as "rdmavm: skip: ...": callers report it as SKIP.  A
# command may exit 77 itself to say it skipped.
#
# Environment: RDMAVM_CACHE (default /var/tmp/deepepd-rdmavm) holds the
# kernel and the base initramfs, made once (apt-get download of the kernel
# package, about 70 MB, and an initramfs build: 20-60 s) and reused after.
# It is under /var/tmp rather than /tmp because /var/tmp is kept across
# reboots (and is not a tmpfs on Debian), so a machine pays for it once.
# RDMAVM_ACCEL=kvm tries KVM instead of TCG (it does not work on this
# project's PVM-nested machines); RDMAVM_APPEND adds to the guest kernel's
# command line; RDMAVM_GRACE (default 10) is how many seconds the other
# guest is given once one has failed.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
CACHE=${RDMAVM_CACHE:-/var/tmp/deepepd-rdmavm}
TMO=300 MEM=1024 PAIR= VERBOSE= PREPARE=
ENVS=() SHARES=()   # SHARES: "ro:/path" or "rw:/path"

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 2; }
say() { echo "rdmavm: $*" >&2; }
log() { [[ -z "$VERBOSE" ]] || say "$(date +%T.%N | cut -c1-12) $*"; }
# A machine that cannot run guests is a SKIP, not a failure: say why, exit 77.
skip() { echo "rdmavm: skip: $*" >&2; exit 77; }

while [[ $# -gt 0 ]]; do
  case "$1" in
  -2) PAIR=1; shift ;;
  -t) TMO=$2; shift 2 ;;
  -e) ENVS+=("$2"); shift 2 ;;
  -r|-w) [[ -d "$2" ]] || { say "$1 $2: no such directory"; exit 2; }
     SHARES+=("$([[ $1 == -r ]] && echo ro || echo rw):$(cd "$2" && pwd)"); shift 2 ;;
  -m) MEM=$2; shift 2 ;;
  -v) VERBOSE=1; shift ;;
  --prepare) PREPARE=1; shift ;;
  -h|--help) usage ;;
  --) shift; break ;;
  -*) say "unknown option $1"; usage ;;
  *) break ;;
  esac
done
if [[ -z "$PREPARE" ]]; then
  if [[ -n "$PAIR" && $# -ne 2 ]] || [[ -z "$PAIR" && $# -ne 1 ]]; then usage; fi
fi

# ---- what the host must have ------------------------------------------------
# The guest sees the host's whole root filesystem, every file root may read,
# and runs its command as root there: only root may set that up.
[[ $(id -u) -eq 0 ]] || skip "not root (the guests share the host's whole root filesystem and run their command as root in it: run as root)"
need() {  # need COMMAND PACKAGE
  command -v "$1" >/dev/null 2>&1 || skip "$1 not found (install Debian's $2, e.g. with make deps)"
}
need qemu-system-x86_64 qemu-system-x86
need cpio cpio
need modprobe kmod
need depmod kmod
need xz xz-utils
need apt-get apt
need dpkg-deb dpkg
need flock util-linux
# In the guest (the host's own root): rxe is set up with iproute2's rdma.
need ip iproute2
need rdma iproute2
# The initramfs runs busybox before any library is reachable: it must be static.
[[ -x /bin/busybox ]] || skip "/bin/busybox not found (install Debian's busybox-static)"
ldd /bin/busybox >/dev/null 2>&1 && skip "/bin/busybox is linked dynamically (install busybox-static, not busybox)"
# Verbs programs in the guest need the rxe provider of libibverbs.
compgen -G "/usr/lib/*/libibverbs/librxe-rdmav*.so" >/dev/null \
  || skip "libibverbs' rxe provider not found (install Debian's ibverbs-providers and libibverbs1)"

# ---- the cached kernel and base initramfs ---------------------------------------
# The modules the guest loads, in order (modprobe brings each one's dependencies).
MODULES="virtio_pci 9pnet_virtio 9p dummy virtio_net crc32_generic rdma_rxe ib_uverbs rdma_ucm"

# Make $CACHE/{vmlinux,initrd.cpio} for the kernel package that
# linux-image-amd64 depends on, unless the cache already holds it.
prepare() {
  local kpkg ver stamp tmp deb kv off ir m f
  kpkg=$(apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/ {print $2; exit}')
  if [[ -z "$kpkg" ]]; then
    # No package index yet (a fresh machine): make one, once.
    apt-get update -q >/dev/null 2>&1 || true
    kpkg=$(apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/ {print $2; exit}')
  fi
  if [[ -z "$kpkg" ]]; then
    # Offline with a cache already made: use it.
    [[ -s "$CACHE/stamp" ]] && { log "no package index; using the cached $(cat "$CACHE/stamp")"; return 0; }
    skip "apt-cache knows no linux-image-amd64 (no Debian package index): the guest's kernel cannot be had"
  fi
  ver=$(apt-cache policy "$kpkg" 2>/dev/null | sed -n 's/^ *Candidate: *//p')
  stamp="$kpkg $ver; $MODULES"
  [[ "$(cat "$CACHE/stamp" 2>/dev/null)" == "$stamp" ]] && return 0
  log "making the guest kernel and initramfs in $CACHE ($kpkg $ver)"
  tmp=$(mktemp -d "$CACHE/make.XXXXXX")
  # A package of an older point release may have left the mirror: refresh the index once.
  (cd "$tmp" && apt-get download -q "$kpkg" >/dev/null 2>&1) \
    || { apt-get update -q >/dev/null 2>&1; (cd "$tmp" && apt-get download -q "$kpkg" >/dev/null 2>&1); } \
    || { rm -rf "$tmp"; skip "apt-get download $kpkg failed (no network to Debian's mirror?): the guest's kernel cannot be had"; }
  deb=$(echo "$tmp"/*.deb)
  kv=${kpkg#linux-image-}
  dpkg-deb -x "$deb" "$tmp/k"
  depmod -b "$tmp/k" "$kv"
  # QEMU boots an uncompressed ELF vmlinux through its PVH entry point, which
  # spares the guest the xz decompression of the bzImage (seconds under TCG).
  off=$(LC_ALL=C grep -obUaP '\xfd7zXZ\x00' "$tmp/k/boot/vmlinuz-$kv" | head -n1 | cut -d: -f1)
  tail -c +$((off + 1)) "$tmp/k/boot/vmlinuz-$kv" | xz -dc --single-stream >"$tmp/vmlinux" 2>/dev/null || true
  [[ "$(head -c4 "$tmp/vmlinux" | od -An -tx1 | tr -d ' ')" == 7f454c46 ]] \
    || { rm -rf "$tmp"; say "could not extract vmlinux from $deb"; exit 125; }
  # The base initramfs: static busybox, the modules and what depmod says of them.
  ir=$tmp/ir
  mkdir -p "$ir"/{bin,sbin,proc,sys,dev,host,rdmavm,lib/modules/"$kv"}
  cp /bin/busybox "$ir/bin/busybox"
  for f in $("$ir/bin/busybox" --list); do [[ "$f" == busybox ]] || ln -sf busybox "$ir/bin/$f"; done
  for f in modprobe poweroff; do ln -sf ../bin/busybox "$ir/sbin/$f"; done
  for m in $MODULES; do
    modprobe -d "$tmp/k" -S "$kv" -D "$m" | awk '$1 == "insmod" {print $2}' | while read -r f; do
      mkdir -p "$ir$(dirname "${f#"$tmp/k"}")"
      cp -n "$f" "$ir${f#"$tmp/k"}"
    done
  done
  echo "$MODULES" >"$ir/rdmavm/modules"
  cp "$tmp/k/lib/modules/$kv"/modules.{order,builtin,builtin.modinfo} "$ir/lib/modules/$kv/"
  depmod -b "$ir" "$kv"
  (cd "$ir" && find . | cpio -o -H newc --quiet) >"$tmp/initrd.cpio"
  mv "$tmp/vmlinux" "$tmp/initrd.cpio" "$CACHE/"
  echo "$stamp" >"$CACHE/stamp"
  rm -rf "$tmp"
  log "cache ready: $stamp"
}

mkdir -p -m 0755 "$CACHE"
# The cache's kernel and initramfs boot with the host's root readable: refuse
# a cache that someone other than root could have written.
[[ "$(stat -c %u "$CACHE")" == 0 && ! -k "$CACHE" && $(( 0$(stat -c %a "$CACHE") & 022 )) -eq 0 ]] \
  || { say "$CACHE must be root's and writable by root only (it is $(stat -c %U "$CACHE")'s, mode $(stat -c %a "$CACHE")): refusing to boot what it holds"; exit 125; }
# Two runs at once (two build dirs) must not build the cache over each other.
exec 9>"$CACHE/lock"
flock 9
prepare
flock -u 9
[[ -n "$PREPARE" ]] && exit 0

# ---- one run --------------------------------------------------------------------
RUN=$(mktemp -d "${TMPDIR:-/tmp}/rdmavm.XXXXXX")
mkdir -p "$RUN/shared"
chmod 1777 "$RUN/shared"
SHARES+=("rw:$RUN/shared")
# The current directory is hidden in the guest when it is under one of the
# guest's own tmpfs (a fresh clone in /tmp): share it read-only.
case "$PWD/" in /tmp/*|/var/tmp/*|/run/*) SHARES+=("ro:$PWD") ;; esac
# Mounted shortest path first, so that a share inside another stays visible.
mapfile -t SHARES < <(for s in "${SHARES[@]}"; do p=${s#??:}; echo "${#p} $s"; done | sort -n | cut -d' ' -f2-)

cleanup() {
  local f
  for f in "$RUN"/n*/qemu.pid; do [[ -e "$f" ]] && kill "$(cat "$f")" 2>/dev/null; done
  rm -rf "$RUN"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

shq() { printf "'%s'" "${1//\'/\'\\\'\'}"; }

case "${RDMAVM_ACCEL:-tcg}" in
kvm) ACCEL=(-accel kvm -cpu host) ;;
# thread=single (one host thread runs every vCPU) boots faster and wakes an
# idle vCPU much sooner than multi-threaded TCG on these nested machines.
*) ACCEL=(-accel tcg,thread=single,tb-size=256 -cpu max) ;;
esac
# qboot starts a -kernel guest in milliseconds where SeaBIOS takes seconds.
BIOS=(); [[ -e /usr/share/qemu/qboot.rom ]] && BIOS=(-bios /usr/share/qemu/qboot.rom)

# boot NODE CMD QEMU-ARGS...: run CMD in guest NODE; its exit status goes to
# $RUN/nNODE/status.  Output of the command: stdout.
boot() {
  local node=$1 cmd=$2; shift 2
  local d=$RUN/n$node qrc rc i share ro
  mkdir -p "$d/a/rdmavm"
  {
    echo "RDMAVM_NODE=$node"
    echo "RDMAVM_NODES=$([[ -n "$PAIR" ]] && echo 2 || echo 1)"
    echo "RDMAVM_CWD=$(shq "$PWD")"
    echo "RDMAVM_SHARED=$(shq "$RUN/shared")"
    echo "RDMAVM_NSHARES=${#SHARES[@]}"
    for i in "${!SHARES[@]}"; do echo "RDMAVM_SHARE$i=$(shq "${SHARES[$i]}")"; done
    echo "RDMAVM_VERBOSE=$VERBOSE"
  } >"$d/a/rdmavm/conf"
  for i in "${ENVS[@]+"${ENVS[@]}"}"; do echo "export $(shq "$i")"; done >"$d/a/rdmavm/env"
  printf '%s\n' "$cmd" >"$d/a/rdmavm/cmd"
  cp "$HERE/init.sh" "$d/a/init"
  cp "$HERE/guest.sh" "$d/a/rdmavm/guest.sh"
  chmod 755 "$d/a/init"
  # The kernel unpacks both archives, the second over the first: the cached
  # kernel stays as it is while the scripts and this run's settings change.
  (cd "$d/a" && find . | cpio -o -H newc --quiet) | cat "$CACHE/initrd.cpio" - >"$d/initrd"
  local fs=()
  for i in "${!SHARES[@]}"; do
    share=${SHARES[$i]} ro=
    [[ $share == ro:* ]] && ro=,readonly=on
    fs+=(-fsdev "local,id=fs$i,path=${share#??:},security_model=none,multidevs=remap$ro"
      -device "virtio-9p-pci,fsdev=fs$i,mount_tag=share$i")
  done
  : >"$d/rc"
  log "node $node: booting"
  # The kernel's command line: a throw-away guest needs no KASLR or Spectre
  # mitigations (each costs TCG time) nor self-tests of its crypto.  Its
  # clock is the HPET, which QEMU runs from the host's clock, rather than the
  # TSC, whose rate the guest measures at boot: on a loaded host one guest's
  # TSC clock was seen running minutes ahead, and its timeouts expired early.
  # no_timer_check: the kernel's boot-time check that the IO-APIC timer ticks
  # counts ticks against a busy loop, and under emulation on a loaded host it
  # failed once and panicked the guest ("IO-APIC + timer doesn't work").
  # ttyS0: the kernel's console, to a log; ttyS1: the command's output, to
  # stdout; ttyS2: the command's exit status, to a file.
  set +e
  timeout -k 5 "$TMO" qemu-system-x86_64 "${ACCEL[@]}" "${BIOS[@]+"${BIOS[@]}"}" \
    -smp "$([[ -n "$PAIR" ]] && echo 1 || echo 2)" -m "$MEM" \
    -display none -nodefaults -no-reboot \
    -kernel "$CACHE/vmlinux" -initrd "$d/initrd" \
    -append "console=ttyS0 quiet loglevel=4 panic=-1 nokaslr mitigations=off clocksource=hpet no_timer_check cryptomgr.notests ${RDMAVM_APPEND:-}" \
    -serial "file:$d/console.log" -chardev stdio,id=out,signal=off -serial chardev:out \
    -serial "file:$d/rc" \
    -fsdev local,id=root,path=/,security_model=none,readonly=on,multidevs=remap \
    -device virtio-9p-pci,fsdev=root,mount_tag=hostroot \
    "${fs[@]}" "$@" </dev/null &
  echo $! >"$d/qemu.pid"
  wait $!
  qrc=$?
  set -e
  rm -f "$d/qemu.pid"
  rc=$(tr -dc 0-9 <"$d/rc")
  log "node $node: guest gone (qemu exit $qrc, command exit ${rc:-none})"
  if [[ -e "$d/stopped" ]]; then
    say "node $node: stopped: $(cat "$d/stopped")"; rc=125
  elif [[ $qrc -eq 124 || $qrc -eq 137 ]]; then
    say "node $node: timed out after ${TMO}s"; rc=124
  elif [[ -z "$rc" ]]; then
    say "node $node: the guest ended without an exit status (qemu exit $qrc)"; rc=125
  fi
  if [[ $rc -ne 0 && $rc -ne 77 && ! -e "$d/stopped" ]] && [[ -n "$VERBOSE" || $rc -eq 125 ]]; then
    echo "--- node $node: the guest kernel's log (last 40 lines)"; tail -n 40 "$d/console.log"
  fi
  echo "$rc" >"$d/status"
}

# node N CMD QEMU-ARGS...: boot guest N with its output prefixed "[nodeN] ".
node() {
  local n=$1; shift
  boot "$n" "$@" 2>&1 | sed -u "s/^/[node$n] /"
}

if [[ -z "$PAIR" ]]; then
  node 1 "$1" -nic none
  exit "$(cat "$RUN/n1/status")"
fi

# Two guests: each QEMU's virtio-net card sends its Ethernet frames as
# datagrams to the other's Unix socket, so nothing touches the host's network.
declare -A PID
for n in 1 2; do
  o=$((3 - n))
  node "$n" "${!n}" \
    -netdev "dgram,id=net0,local.type=unix,local.path=$RUN/n$n.sock,remote.type=unix,remote.path=$RUN/n$o.sock" \
    -device "virtio-net-pci,netdev=net0,mac=52:54:00:77:00:0$n" &
  PID[$n]=$!
done
# When one node fails, the other is likely waiting for it: give it a few
# seconds to say what it saw, then stop it, rather than wait for its timeout.
GRACE=${RDMAVM_GRACE:-10}
wait -n -p first "${PID[1]}" "${PID[2]}" || true
[[ "${PID[1]}" == "$first" ]] && done=1 || done=2
other=$((3 - done))
if [[ "$(cat "$RUN/n$done/status" 2>/dev/null)" != 0 ]]; then
  for _ in $(seq $((GRACE * 10))); do kill -0 "${PID[$other]}" 2>/dev/null || break; sleep 0.1; done
  if [[ -e "$RUN/n$other/qemu.pid" ]]; then
    echo "node $done failed" >"$RUN/n$other/stopped"
    kill "$(cat "$RUN/n$other/qemu.pid")" 2>/dev/null || true
  fi
fi
wait "${PID[$other]}" || true
rc1=$(cat "$RUN/n$done/status" 2>/dev/null || echo 125)
rc2=$(cat "$RUN/n$other/status" 2>/dev/null || echo 125)
log "node $done exit $rc1, node $other exit $rc2"
# The failure that came first is the one to report: the other node was
# often stopped because of it.
for rc in "$rc1" "$rc2"; do [[ $rc == 0 || $rc == 77 ]] || exit "$rc"; done
[[ $rc1 == 77 || $rc2 == 77 ]] && exit 77
exit 0
