"""The QEMU guest kernel's NVMe/TCP host, driven from tests (nvme-cli in the guest).

The guest reaches a host loopback port listed in its ``guest_forwards`` at
``GUESTFWD_ADDR:PORT``; these helpers connect its kernel host there, find the namespace's
block device, hash guest block ranges with O_DIRECT and disconnect.
"""

from __future__ import annotations

from emulator.qemu.guest import GUESTFWD_ADDR, Guest


def guest_sha256(guest: Guest, device: str, offset: int, length: int) -> str:
    """sha256 of ``length`` bytes at ``offset`` of a guest block device, read with O_DIRECT."""
    bs = 1 << 20 if offset % (1 << 20) == 0 and length % (1 << 20) == 0 else 4096
    assert offset % bs == 0 and length % bs == 0
    out = guest.check(f"dd if={device} bs={bs} skip={offset // bs} count={length // bs}"
                      f" iflag=direct 2>/dev/null | sha256sum", timeout=120)
    return out.split()[0]


def kernel_connect(guest: Guest, port: int, nqn: str, *, digests: bool,
                   hostnqn: str | None = None) -> str:
    """`nvme connect` the guest kernel's host to 10.0.2.100:port; returns the namespace device."""
    flags = ("-g -G" if digests else "") + (f" -q {hostnqn}" if hostnqn else "")
    guest.check(f"nvme connect -t tcp -a {GUESTFWD_ADDR} -s {port} -n {nqn} {flags}", timeout=60)
    out = guest.check(
        "for i in $(seq 200); do for c in /sys/class/nvme/nvme*; do"
        f" [ \"$(cat $c/subsysnqn)\" = {nqn} ] && for n in /dev/$(basename $c)n1; do"
        " [ -b $n ] && echo $n && exit 0; done; done; usleep 50000; done; exit 1", timeout=30)
    return out.strip()


def kernel_disconnect(guest: Guest, nqn: str) -> None:
    guest.exec(f"nvme disconnect -n {nqn}", timeout=30)


def dmesg_tail(guest: Guest, n: int = 30) -> str:
    return guest.exec(f"dmesg | tail -n {n}")[1]
