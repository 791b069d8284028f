"""The storage side of a simulated replay as a fio I/O log (``kvtool replay --iolog``).

:class:`IologWriter` is a :class:`~kvtool.cache.tier.TierMover` for one tier (the NVMe
tier): it gives every block the tier stores a slot of ``block_bytes`` on one device and
writes each block write, read and slot release as fio's ``read_iolog`` format, so that
``fio --read_iolog=FILE`` (with ``--replay_redirect=DEVICE`` to point it elsewhere)
issues the same I/O on real hardware.

Layout (simulated): slot ``s`` is the byte range ``[s·block_bytes, (s+1)·block_bytes)``;
a stored block takes the most recently freed slot, else the lowest never used one; an
evicted block's slot is freed (no I/O: a real store overwrites it later). The replayer
stores a request's blocks before the tier evicts down to its capacity, so the log
addresses at most ``(capacity + the longest request's blocks) × block_bytes`` bytes
(:attr:`IologWriter.device_bytes` says how many). Within a request the tier's
operations come in the order the replayer makes them (loads of hit blocks, then stores).

Formats (fio's HOWTO, "I/O replay"): version 2 lines are ``FILE ACTION [OFFSET LENGTH]``;
version 3 puts a timestamp in milliseconds first, which fio waits for when replaying
(unless ``--replay_no_stall``). Times are the requests' trace timestamps, from the first
request (an untimed trace gives 0 everywhere: fio replays at full speed).
"""

from __future__ import annotations

import math
from typing import IO

IOLOG_VERSIONS = (2, 3)


class IologWriter:
    """Write one tier's block I/O as a fio iolog. Use as a context manager or call
    :meth:`close`. Invariant: ``slots`` maps exactly the blocks the tier holds (as far
    as this mover has been told) to distinct slots below ``high``."""

    def __init__(self, path: str, *, block_bytes: int, tier: str = "nvme",
                 device: str = "kvtool-nvme", version: int = 3) -> None:
        if version not in IOLOG_VERSIONS:
            raise ValueError(f"fio iolog version must be 2 or 3, got {version}")
        if block_bytes <= 0:
            raise ValueError("block_bytes must be positive")
        self.path = path
        self.block_bytes = block_bytes
        self.tier = tier
        self.device = device
        self.version = version
        self.now_ms = 0
        self.slots: dict[int, int] = {}
        self.free: list[int] = []
        self.high = 0
        self.reads = 0
        self.writes = 0
        self._t0: float | None = None
        self._f: IO[str] = open(path, "w", encoding="utf-8")  # noqa: SIM115 (closed in close())
        self._line(f"fio version {version} iolog", stamp=False)
        self._op("add")
        self._op("open")

    # -- clock ---------------------------------------------------------------------------
    def at(self, timestamp_ms: float) -> None:
        """Set the time of the next operations from a request's trace timestamp."""
        if self._t0 is None:
            self._t0 = timestamp_ms
        t = timestamp_ms - self._t0
        self.now_ms = max(self.now_ms, math.floor(t) if t > 0 else 0)

    # -- lines ---------------------------------------------------------------------------
    def _line(self, text: str, stamp: bool = True) -> None:
        if stamp and self.version == 3:
            self._f.write(f"{self.now_ms} {text}\n")
        else:
            self._f.write(text + "\n")

    def _op(self, action: str, offset: int | None = None) -> None:
        if offset is None:
            self._line(f"{self.device} {action}")
        else:
            self._line(f"{self.device} {action} {offset} {self.block_bytes}")

    # -- TierMover -----------------------------------------------------------------------
    def on_write(self, tier: str, keys: list[int]) -> None:
        if tier != self.tier:
            return
        slots, free, bb = self.slots, self.free, self.block_bytes
        for key in keys:
            slot = slots.get(key)
            if slot is None:
                if free:
                    slot = free.pop()
                else:
                    slot = self.high
                    self.high += 1
                slots[key] = slot
            self._op("write", slot * bb)
            self.writes += 1

    def on_read(self, tier: str, keys: list[int]) -> None:
        if tier != self.tier:
            return
        slots, bb = self.slots, self.block_bytes
        for key in keys:
            self._op("read", slots[key] * bb)
            self.reads += 1

    def on_evict(self, tier: str, keys: list[int]) -> None:
        if tier != self.tier:
            return
        for key in keys:
            slot = self.slots.pop(key, None)
            if slot is not None:
                self.free.append(slot)

    # -- end -----------------------------------------------------------------------------
    @property
    def device_bytes(self) -> int:
        """The bytes the log addresses: a device or file at least this large replays it."""
        return self.high * self.block_bytes

    def summary(self) -> dict[str, int | str]:
        return {"path": self.path, "version": self.version, "tier": self.tier,
                "reads": self.reads, "writes": self.writes, "block_bytes": self.block_bytes,
                "read_bytes": self.reads * self.block_bytes,
                "write_bytes": self.writes * self.block_bytes,
                "device_bytes": self.device_bytes}

    def close(self) -> None:
        if not self._f.closed:
            self._op("close")
            self._f.close()

    def __enter__(self) -> IologWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
