#!/bin/busybox sh
# /init of kvtool's QEMU guest: busybox + the Debian kernel's own modules.
# Adapted from the qemu-nvmet recipe (../shared/reference/qemu-nvmet/init.sh, kvtool project).
#
# Kernel command-line knobs (all optional; emulator.qemu.guest.Guest sets them):
#   kvt.target=1|0        1: configure an nvmet-tcp target (below); 0: load the modules and mount
#                         configfs but configure nothing (for kvtool's configfs backend)
#   kvt.nqn=NQN           subsystem NQN          (default nqn.2024-01.io.kvtool:emu)
#   kvt.port=N            NVMe/TCP listen port   (default 4420)
#   kvt.size_mb=N         namespace size in MiB  (default 64)
#   kvt.backing=ram|file|loop  brd /dev/ram0; a file on tmpfs with buffered_io=1; or
#                         /dev/loop0 over a tmpfs file. Only loop (blk-mq) keeps the block
#                         I/O statistics nvmet's SMART log reports as Data Units Read/Written:
#                         brd is bio-based and keeps none, and a file namespace reports 0.
#   kvt.hosts=NQN[,NQN]   allowed host NQNs (default: allow any host)
#   kvt.hostroot=1        mount host / (9p tag hostroot) read-only + tmpfs overlay at /hostroot
#   kvt.ctl=0             no control shell on guest port 2323 (default: on)
#   kvt.rdma=1            load soft-RoCE (rdma_rxe), rdma_ucm and the NVMe/RDMA host and target
#   kvt.pcie=1            load the NVMe PCIe driver and vfio-pci (QEMU NVMe controllers; SPDK)
# Console markers: KVTOOL-TARGET-READY (target configured), KVTOOL-GUEST-READY (always, last).
/bin/busybox --install -s /bin
export PATH=/bin:/sbin:/usr/bin:/usr/sbin
mkdir -p /proc /sys /dev /tmp /run
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mount -t tmpfs tmpfs /tmp
mount -t tmpfs tmpfs /run
mkdir -p /dev/shm && mount -t tmpfs -o mode=1777 shm /dev/shm   # shm_open (SPDK's trace)

arg() { # arg NAME DEFAULT
    v=$(tr ' ' '\n' </proc/cmdline | sed -n "s/^kvt\.$1=//p" | tail -n1)
    echo "${v:-$2}"
}
NQN=$(arg nqn nqn.2024-01.io.kvtool:emu)
PORT=$(arg port 4420)
SIZE_MB=$(arg size_mb 64)
BACKING=$(arg backing ram)
HOSTS=$(arg hosts "")
up() { cut -d' ' -f1 /proc/uptime; }
log() { echo "[kvt $(up)] $*"; }
fail() { log "KVTOOL-GUEST-FAILED $*"; exec setsid cttyhack sh; }

log "init start"
while read -r m args; do
    [ -n "$m" ] || continue
    insmod "/lib/modules/$m" $args 2>&1 | sed 's/^/[insmod] /'
done </modules.load
if [ "$(arg hostroot 0)" = 1 ]; then
    while read -r m; do [ -n "$m" ] && insmod "/lib/modules/$m"; done </modules-9p.load
fi
for set in rdma pcie; do
    if [ "$(arg $set 0)" = 1 ]; then
        while read -r m args; do
            [ -n "$m" ] && insmod "/lib/modules/$m" $args 2>&1 | sed 's/^/[insmod] /'
        done <"/modules-$set.load"
    fi
done
log "modules loaded"

mount -t configfs configfs /sys/kernel/config || fail "configfs mount"

ip link set lo up
for i in $(seq 50); do [ -e /sys/class/net/eth0 ] && break; usleep 100000; done
ip addr add 10.0.2.15/24 dev eth0
ip link set eth0 up
ip route add default via 10.0.2.2
log "eth0 up: $(ip -4 -o addr show eth0 | awk '{print $4}')"

# --- backing store: brd is always loaded (the configfs backend needs a block device too) ---
insmod /lib/modules/kernel/drivers/block/brd.ko rd_nr=1 rd_size=$((SIZE_MB * 1024))
if [ "$BACKING" = file ]; then
    DEV=/run/ns1.img
    truncate -s "${SIZE_MB}M" "$DEV"
elif [ "$BACKING" = loop ]; then
    insmod /lib/modules/kernel/drivers/block/loop.ko || fail "insmod loop"
    truncate -s "${SIZE_MB}M" /run/ns1.img
    DEV=/dev/loop0
    losetup "$DEV" /run/ns1.img || fail "losetup $DEV"
else
    DEV=/dev/ram0
fi

# --- optional: host rootfs over 9p (read-only) + tmpfs overlay, ready for chroot ---
if [ "$(arg hostroot 0)" = 1 ]; then
    mkdir -p /mnt/lower /mnt/ovl /hostroot
    mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=262144,cache=loose hostroot /mnt/lower \
        || fail "9p mount of hostroot"
    mount -t tmpfs tmpfs /mnt/ovl
    mkdir -p /mnt/ovl/up /mnt/ovl/work
    mount -t overlay overlay -o lowerdir=/mnt/lower,upperdir=/mnt/ovl/up,workdir=/mnt/ovl/work \
        /hostroot || fail "overlay mount"
    # /run is the guest's own scratch, shared with the chroot (files nvmet serves must live
    # on a real guest file system: on the overlay nvmet sees a 0-bit block size). /tmp stays
    # the host's, through the overlay, so a checkout or virtualenv under /tmp is visible.
    for d in proc sys dev dev/shm run; do mkdir -p "/hostroot/$d"; mount -o bind "/$d" "/hostroot/$d"; done
    # a bind of /sys does not carry its submounts: mount configfs again inside the chroot
    mount -t configfs configfs /hostroot/sys/kernel/config
    log "hostroot mounted at /hostroot"
fi

# --- nvmet subsystem + TCP port via configfs -------------------------------
if [ "$(arg target 1)" = 1 ]; then
    T=/sys/kernel/config/nvmet
    S=$T/subsystems/$NQN
    mkdir "$S" || fail "mkdir subsystem"
    if [ -n "$HOSTS" ]; then
        for h in $(echo "$HOSTS" | tr ',' ' '); do
            mkdir -p "$T/hosts/$h"
            ln -s "$T/hosts/$h" "$S/allowed_hosts/$h"
        done
    else
        echo 1 >"$S/attr_allow_any_host"
    fi
    mkdir "$S/namespaces/1"
    echo -n "$DEV" >"$S/namespaces/1/device_path"
    [ "$BACKING" = file ] && echo 1 >"$S/namespaces/1/buffered_io"
    echo 1 >"$S/namespaces/1/enable" || fail "namespace enable"
    mkdir "$T/ports/1"
    echo tcp >"$T/ports/1/addr_trtype"
    echo ipv4 >"$T/ports/1/addr_adrfam"
    echo 0.0.0.0 >"$T/ports/1/addr_traddr"
    echo "$PORT" >"$T/ports/1/addr_trsvcid"
    ln -s "$S" "$T/ports/1/subsystems/$NQN" || fail "port enable"
    log "KVTOOL-TARGET-READY nqn=$NQN port=$PORT dev=$DEV size=${SIZE_MB}MiB"
fi

# control channel: a root shell per TCP connection on guest port 2323; the host forwards a
# loopback port to it (Guest.exec). Unauthenticated, reachable from host loopback only.
if [ "$(arg ctl 1)" = 1 ]; then
    setsid nc -ll -p 2323 -e /bin/sh </dev/null >/dev/null 2>&1 &
fi
log "free: $(free -m | awk '/Mem:/{print "used="$3"MiB total="$2"MiB"}')"
log "KVTOOL-GUEST-READY"
# stay up; a shell on the console for manual poking
exec setsid cttyhack sh
