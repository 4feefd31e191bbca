#!/bin/sh
# guest.sh — runs in the rdmavm guest, chrooted into the host's root (see
# run.sh): brings up the netdev and its rxe device, waits until the device
# can carry RoCE v2 traffic, then runs the command with bash and exits with
# its status.  A setup step that fails exits 125 (a harness break).
. /run/rdmavm/conf
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export HOME=/tmp/home LC_ALL=C.UTF-8
mkdir -p "$HOME"
fail() { echo "rdmavm: guest: $*" >&2; exit 125; }

# Node names tell the two daemons' logs apart.
hostname "node$RDMAVM_NODE"
ip link set lo up
if [ "$RDMAVM_NODES" = 2 ]; then
  # The virtio-net card is the wire to the other guest.
  RDMAVM_NETDEV=eth0
  RDMAVM_PEER_IP=10.77.0.$((3 - RDMAVM_NODE))
  export RDMAVM_PEER_IP
else
  # One guest has no card: rxe runs on a dummy netdev, traffic stays inside.
  RDMAVM_NETDEV=rxenet0
  ip link add $RDMAVM_NETDEV type dummy || fail "ip link add $RDMAVM_NETDEV type dummy failed"
fi
RDMAVM_IP=10.77.0.$RDMAVM_NODE
RDMAVM_DEV=rxe0
ip addr add $RDMAVM_IP/24 dev $RDMAVM_NETDEV || fail "ip addr add $RDMAVM_IP on $RDMAVM_NETDEV failed"
ip link set $RDMAVM_NETDEV up || fail "ip link set $RDMAVM_NETDEV up failed"
rdma link add $RDMAVM_DEV type rxe netdev $RDMAVM_NETDEV || fail "rdma link add $RDMAVM_DEV failed"

# The port is usable once ACTIVE with a RoCE v2 GID of the IPv4 address
# (::ffff:a.b.c.d); the kernel adds it a moment after the link comes up.
port=/sys/class/infiniband/$RDMAVM_DEV/ports/1
RDMAVM_GID_INDEX=
n=0
while [ $n -lt 200 ] && [ -z "$RDMAVM_GID_INDEX" ]; do
  if grep -q ACTIVE $port/state 2>/dev/null; then
    for g in $port/gids/*; do
      x=${g##*/}
      case "$(cat "$g" 2>/dev/null)" in
      0000:0000:0000:0000:0000:ffff:*)
        grep -q v2 $port/gid_attrs/types/"$x" 2>/dev/null && { RDMAVM_GID_INDEX=$x; break; } ;;
      esac
    done
  fi
  [ -n "$RDMAVM_GID_INDEX" ] || { n=$((n + 1)); sleep 0.05; }
done
[ -n "$RDMAVM_GID_INDEX" ] || fail "$RDMAVM_DEV did not become ACTIVE with an IPv4 RoCE v2 GID ($(cat $port/state))"
export RDMAVM_NODE RDMAVM_NODES RDMAVM_IP RDMAVM_NETDEV RDMAVM_DEV RDMAVM_GID_INDEX RDMAVM_SHARED

. /run/rdmavm/env
cd "$RDMAVM_CWD" || fail "cannot enter $RDMAVM_CWD"
exec /bin/bash /run/rdmavm/cmd
