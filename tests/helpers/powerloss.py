"""An I/O engine whose power can be cut: only flushed writes are sure to survive.

:class:`PowerLossEngine` keeps a namespace in memory as two images: ``durable`` (what the
medium holds) and the live view that reads see. A write changes the live view only; a
``flush`` makes every write completed before it durable — the contract of
:class:`kvtool.store.io.IOEngine`. After ``cut_after`` operations (writes and flushes) the
power goes: that operation and every later one raise :class:`PowerCut`.
:meth:`PowerLossEngine.after_power_loss` then gives the medium as a restart would find it:
the durable image, plus — in the ``torn`` mode — a random subset of the 512-byte sectors
of the writes not yet flushed (nothing about which un-flushed writes reach the medium, or
in which order, may be assumed).
"""

from __future__ import annotations

import errno
import random
import threading
from typing import Any

from kvtool.store.io import ThreadedEngine

SECTOR = 512


class PowerCut(OSError):
    def __init__(self) -> None:
        super().__init__(errno.EIO, "power cut")


class PowerLossEngine(ThreadedEngine):
    def __init__(self, size: int, *, lba_size: int = 512, qd: int = 4,
                 cut_after: int | None = None, durable: bytes | None = None) -> None:
        super().__init__(qd)
        self.size = size
        self.lba_size = lba_size
        self.mem_align = 1
        self.writable = True
        self.durable = bytearray(durable if durable is not None else bytes(size))
        self.live = bytearray(self.durable)
        self.unflushed: list[tuple[int, bytes]] = []
        self.cut_after = cut_after
        self.ops = 0
        self.dead = False
        self._lock = threading.Lock()

    def _tick(self) -> None:
        """Count one operation; cut the power when the budget is spent."""
        if self.dead:
            raise PowerCut()
        self.ops += 1
        if self.cut_after is not None and self.ops > self.cut_after:
            self.dead = True
            raise PowerCut()

    def read_into(self, offset: int, buf: memoryview) -> None:
        self.check(offset, buf)
        with self._lock:
            if self.dead:
                raise PowerCut()
            buf[:] = self.live[offset:offset + buf.nbytes]

    def write_from(self, offset: int, buf: memoryview) -> None:
        self.check(offset, buf)
        data = bytes(buf)
        with self._lock:
            self._tick()
            self.live[offset:offset + len(data)] = data
            self.unflushed.append((offset, data))

    def flush(self) -> None:
        with self._lock:
            self._tick()
            for offset, data in self.unflushed:
                self.durable[offset:offset + len(data)] = data
            self.unflushed.clear()

    def after_power_loss(self, rng: random.Random, *, torn: bool) -> bytes:
        """The medium after the cut: durable bytes, plus (``torn``) random sectors of the
        writes that were never flushed, applied in a random order."""
        image = bytearray(self.durable)
        if torn:
            sectors = [(off + s, data[s:s + SECTOR]) for off, data in self.unflushed
                       for s in range(0, len(data), SECTOR)]
            rng.shuffle(sectors)
            for off, data in sectors[:rng.randint(0, len(sectors))]:
                image[off:off + len(data)] = data
        return bytes(image)

    def _release(self) -> None:
        pass

    def describe(self) -> dict[str, Any]:
        return {"kind": "power-loss", "target": "memory", "ops": self.ops, "dead": self.dead}
