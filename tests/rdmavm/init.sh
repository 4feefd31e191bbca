#!/bin/busybox sh
# init.sh — /init of the rdmavm guest (busybox sh, PID 1; see run.sh).
# Loads the modules, mounts the host's root read-only over 9p with the
# guest's own /proc, /sys, /dev and tmpfs on /tmp, /run and /var/tmp, mounts
# the shares, and runs guest.sh chrooted into the host's root.  Serial
# ports: ttyS0 the kernel's log, ttyS1 the command's output, ttyS2 its exit
# status (each a file or pipe on the host).
export PATH=/bin:/sbin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
. /rdmavm/conf

# raw: no newline translation or echo on the two ports the host reads.
stty -F /dev/ttyS1 raw -echo 2>/dev/null
stty -F /dev/ttyS2 raw -echo 2>/dev/null
# A step that fails here is the harness's, not the command's: status 125.
fail() { echo "rdmavm: guest: $*" >/dev/ttyS1; echo 125 >/dev/ttyS2; poweroff -f; }
t() { [ -z "$RDMAVM_VERBOSE" ] || echo "rdmavm: $(cut -d' ' -f1 /proc/uptime)s $*" >/dev/ttyS1; }

for m in $(cat /rdmavm/modules); do
  # dummy would otherwise make two netdevs of its own.
  case $m in dummy) o=numdummies=0 ;; *) o= ;; esac
  modprobe "$m" $o || fail "modprobe $m failed"
done
t "modules loaded"

R=/host
# cache=loose: the host's root does not change under a run, and 9p without a
# cache makes every exec and library load a round trip to QEMU.
mount -t 9p -o trans=virtio,version=9p2000.L,ro,cache=loose,msize=512000 hostroot $R \
  || fail "cannot mount the host's root over 9p"
mount -t proc proc $R/proc
mount -t sysfs sys $R/sys
mount -t devtmpfs dev $R/dev
mkdir -p $R/dev/pts $R/dev/shm
mount -t devpts devpts $R/dev/pts
mount -t tmpfs tmpfs $R/dev/shm
for d in /tmp /run /var/tmp; do
  [ -d $R$d ] && mount -t tmpfs -o mode=1777 tmpfs $R$d
done
# Shares: cache=mmap, no caching of what the host or the other guest may
# change (the shared directory's "ready" files).
i=0
while [ $i -lt "$RDMAVM_NSHARES" ]; do
  eval "s=\$RDMAVM_SHARE$i"
  mode=${s%%:*} dir=${s#*:}
  mkdir -p "$R$dir" 2>/dev/null
  mount -t 9p -o trans=virtio,version=9p2000.L,$mode,cache=mmap,msize=512000 share$i "$R$dir" \
    || fail "cannot mount the share $dir"
  i=$((i + 1))
done
mkdir -p $R/run/rdmavm
cp /rdmavm/* $R/run/rdmavm/
t "filesystems mounted"

chroot $R /bin/sh /run/rdmavm/guest.sh >/dev/ttyS1 2>&1 </dev/null
rc=$?
t "command exited $rc"
echo $rc >/dev/ttyS2
sync
poweroff -f
