"""The QEMU guest kernel's NVMe/TCP host, driven from tests (nvme-cli in the guest).

The guest reaches a host loopback port listed in its ``guest_forwards`` at
``GUESTFWD_ADDR:PORT``; these helpers connect its kernel host there, find the namespace's
block device, hash guest block ranges with O_DIRECT and disconnect.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from emulator.qemu.guest import GUESTFWD_ADDR, Guest

# What a host tool does in normal use: identify, health, the error log, and the features
# the specification makes mandatory (nvme-cli's get-feature with its own data lengths).
NORMAL_USE = ("id-ctrl", "id-ns", "smart-log", "error-log",
              *(f"get-feature -f {fid:#x}" for fid in (1, 2, 4, 5, 6, 7, 0xA, 0xB, 0xF)))
EVERY_FEATURE = tuple(f"get-feature -f {fid:#x}" for fid in (*range(1, 0x20), 0x80, 0x81,
                                                               0x82, 0x83, 0x84))


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


@dataclass
class HostToolRuns:
    """nvme-cli against one controller: command -> (exit status, output); the lifetime
    error count (SMART "num_err_log_entries") before and after ``NORMAL_USE``."""

    runs: dict[str, tuple[int, str]] = field(default_factory=dict)
    errors_before: int = -1
    errors_after: int = -1


def _error_count(guest: Guest, ctrl: str) -> int:
    out = guest.check(f"nvme smart-log {ctrl} -o json", timeout=30)
    return int(json.loads(out[out.index("{"):])["num_err_log_entries"])


def host_tool_runs(guest: Guest, addr: str | None, port: int, nqn: str) -> HostToolRuns:
    """Connect the guest's kernel host to ``addr:port`` (None: the host side's loopback,
    ``GUESTFWD_ADDR``), run ``NORMAL_USE`` then every get-feature with nvme-cli on its
    controller, and disconnect (also on failure)."""
    addr = addr or GUESTFWD_ADDR
    guest.check(f"nvme connect -t tcp -a {addr} -s {port} -n {nqn}", timeout=60)
    try:
        ctrl = "/dev/" + guest.check(
            "for i in $(seq 200); do for c in /sys/class/nvme/nvme*; do"
            f" [ \"$(cat $c/subsysnqn)\" = {nqn} ] && [ -c /dev/$(basename $c) ]"
            " && basename $c && exit 0; done; usleep 50000; done; exit 1", timeout=30).strip()
        result = HostToolRuns(errors_before=_error_count(guest, ctrl))
        for cmd in NORMAL_USE:
            ns = " -n 1" if cmd == "id-ns" else ""
            result.runs[cmd] = guest.exec(f"nvme {cmd} {ctrl}{ns}", timeout=30)
        result.errors_after = _error_count(guest, ctrl)
        for cmd in EVERY_FEATURE:
            if cmd not in result.runs:
                result.runs[cmd] = guest.exec(f"nvme {cmd} {ctrl}", timeout=30)
        return result
    finally:
        kernel_disconnect(guest, nqn)
