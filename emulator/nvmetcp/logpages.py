"""Log page contents served by the target (Get Log Page), byte for byte as the spec lays
them out (NVMe base 2.0 §5.16.1): Error Information, SMART / Health Information,
Firmware Slot Information, Changed Namespace List, Commands Supported and Effects.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from dataclasses import dataclass

from kvtool.nvme import spec

ERROR_ENTRY_LEN = 64
ERROR_LOG_SLOTS = 128  # as Linux nvmet (ELPE = 127)
SMART_LEN = 512
FW_SLOT_LEN = 512
CHANGED_NS_LEN = 4096
EFFECTS_LEN = 4096
CHANGED_NS_MAX = 1024

# Commands Supported and Effects: CSUPP, LBCC (may change LBA content)
_CSUPP = 1 << 0
_LBCC = 1 << 1


@dataclass(frozen=True, slots=True)
class ErrorEntry:
    """One Error Information log entry (a failed command)."""

    count: int
    sqid: int
    cid: int
    status: int  # the CQE status field, phase bit clear
    location: int  # parameter error location: byte offset in the SQE; 0xFFFF unknown
    lba: int
    nsid: int

    def encode(self) -> bytes:
        out = bytearray(ERROR_ENTRY_LEN)
        struct.pack_into("<QHHHHQI", out, 0, self.count, self.sqid, self.cid, self.status,
                         self.location, self.lba, self.nsid)
        out[29] = spec.TRTYPE_TCP
        return bytes(out)


def error_log(entries: Iterable[ErrorEntry]) -> bytes:
    """Newest first, as the spec orders them."""
    return b"".join(e.encode() for e in sorted(entries, key=lambda e: -e.count))


def data_units(nbytes: int) -> int:
    """SMART Data Units: thousands of 512-byte units, rounded up (a 512 B write counts 1)."""
    return -(-(nbytes // 512) // 1000)


@dataclass(slots=True)
class SmartCounters:
    """Live I/O counters of a namespace (mutated in place on the hot path)."""

    bytes_read: int = 0
    bytes_written: int = 0
    reads: int = 0
    writes: int = 0
    errors: int = 0

    def __add__(self, other: SmartCounters) -> SmartCounters:
        return SmartCounters(self.bytes_read + other.bytes_read,
                             self.bytes_written + other.bytes_written,
                             self.reads + other.reads, self.writes + other.writes,
                             self.errors + other.errors)


def smart_log(c: SmartCounters) -> bytes:
    """SMART / Health Information: the I/O counters are live; the media has no wear, no
    temperature sensor and no spare to report (zero, as Linux nvmet reports them)."""
    out = bytearray(SMART_LEN)
    for off, value in ((32, data_units(c.bytes_read)), (48, data_units(c.bytes_written)),
                       (64, c.reads), (80, c.writes), (176, c.errors)):
        out[off: off + 16] = value.to_bytes(16, "little")
    return bytes(out)


def firmware_slot_log(revision: str) -> bytes:
    """One slot, active and read-only in practice: AFI = slot 1, FRS1 = the version."""
    out = bytearray(FW_SLOT_LEN)
    out[0] = 1
    raw = revision.encode("ascii", "replace")[:8]
    out[8:16] = raw + b" " * (8 - len(raw))
    return bytes(out)


def changed_ns_log(nsids: Iterable[int]) -> bytes:
    ids = sorted(set(nsids))
    out = bytearray(CHANGED_NS_LEN)
    if len(ids) > CHANGED_NS_MAX:
        struct.pack_into("<I", out, 0, 0xFFFFFFFF)  # too many: the host rescans them all
        return bytes(out)
    for i, nsid in enumerate(ids):
        struct.pack_into("<I", out, 4 * i, nsid)
    return bytes(out)


ADMIN_COMMANDS = (spec.ADMIN_GET_LOG_PAGE, spec.ADMIN_IDENTIFY, spec.ADMIN_ABORT,
                  spec.ADMIN_SET_FEATURES, spec.ADMIN_GET_FEATURES, spec.ADMIN_ASYNC_EVENT,
                  spec.ADMIN_KEEP_ALIVE)
IO_COMMANDS = {spec.IO_FLUSH: 0, spec.IO_WRITE: _LBCC, spec.IO_READ: 0,
               spec.IO_WRITE_ZEROES: _LBCC, spec.IO_DSM: _LBCC}


def effects_log() -> bytes:
    out = bytearray(EFFECTS_LEN)
    for opc in ADMIN_COMMANDS:
        struct.pack_into("<I", out, 4 * opc, _CSUPP)
    for opc, effect in IO_COMMANDS.items():
        struct.pack_into("<I", out, 1024 + 4 * opc, _CSUPP | effect)
    return bytes(out)
