"""The SMART / Health Information log page (Log Identifier 02h), as a host reads it.

The counters prove which medium took the bytes (as the published GP7000 test does):
"Data Units Written" counts 512-byte units in thousands, rounded up (NVMe Base
Specification, Figure "SMART / Health Information Log Page").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvtool.nvme import spec

SMART_LOG_BYTES = 512
ALL_NAMESPACES = 0xFFFFFFFF


@dataclass(frozen=True)
class SmartLog:
    data_units_read: int
    data_units_written: int
    host_read_commands: int
    host_write_commands: int

    @classmethod
    def decode(cls, page: bytes) -> SmartLog:
        if len(page) < 96:
            raise ValueError(f"a SMART log page is {SMART_LOG_BYTES} bytes, got {len(page)}")

        def u128(off: int) -> int:
            return int.from_bytes(page[off:off + 16], "little")

        return cls(u128(32), u128(48), u128(64), u128(80))


def read_smart(ctrl: Any, nsid: int = ALL_NAMESPACES) -> SmartLog:
    """Get Log Page 02h from a connected :class:`~kvtool.nvme.host.Controller`."""
    return SmartLog.decode(ctrl.get_log_page(spec.LID_SMART, SMART_LOG_BYTES, nsid=nsid))
