"""A DRAM tier that outlives its process: a pool in a shared-memory file (``/dev/shm``).

``--dram 1GiB@/dev/shm/kvtool-pool`` (or ``"dram": "1GiB@/dev/shm/…"`` in a connector's
config): the pool's rows and an index of what they hold live in one file on a tmpfs, so a
new engine process finds the blocks an earlier one stored (until the machine restarts or
the file is removed). The file is::

    header (4 KiB): magic, version, block bytes, slots, identity (model, dtype, tokens/block, tp)
    index:          slots × 16 B: key (u64), CRC32C of the block (u32), flags (u32)
    rows:           slots × block bytes, from a 4 KiB boundary

A store copies the block into its row, then writes the entry (the key, the CRC32C of the
row's bytes) with its flag set last, so an entry never names a row whose copy was cut
short; an eviction clears the flag first.
One process uses a pool at a time (an exclusive ``flock`` while it is open): a second
one is refused with the first one's pid.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
from collections import deque
from collections.abc import Sequence

import numpy as np

from kvtool.store.checksum import crc32c
from kvtool.tiers.base import TierError, TransferJob
from kvtool.tiers.dram import DramTier

MAGIC = b"KVTSHMP1"
HEADER_BYTES = 4096
ENTRY = np.dtype([("key", "<u8"), ("crc", "<u4"), ("flags", "<u4")])
VALID = 1
_HEAD = struct.Struct("<8sIIQQ64s16sII")


def held_keys(path: str) -> set[int]:
    """The keys a pool file holds, read without opening it as a tier (no lock: the
    process using it may change it meanwhile). Empty when it is not a pool."""
    try:
        with open(path, "rb") as f:
            head = f.read(_HEAD.size)
            if len(head) < _HEAD.size or head[:8] != MAGIC:
                return set()
            slots = _HEAD.unpack(head)[4]
            f.seek(HEADER_BYTES)
            ix = np.frombuffer(f.read(slots * ENTRY.itemsize), dtype=ENTRY)
    except (OSError, ValueError):
        return set()
    return set(ix["key"][ix["flags"] == VALID].tolist())


def _layout(slots: int, block_bytes: int) -> tuple[int, int]:
    """(offset of the rows, file size)."""
    rows_at = -(-(HEADER_BYTES + slots * ENTRY.itemsize) // 4096) * 4096
    return rows_at, rows_at + slots * block_bytes


class ShmDramTier(DramTier):
    """:class:`DramTier` whose pool and index are a shared-memory file (module docstring)."""

    backend = "shm"

    def __init__(self, path: str, slots: int, block_bytes: int, *, name: str = "dram",
                 identity: tuple[str, str, int, int] = ("", "", 0, 0)) -> None:
        if slots < 1 or block_bytes < 1:
            raise ValueError("a DRAM pool needs at least one slot of at least one byte")
        self.name = name
        self.url = path
        self.slots = slots
        self.block_bytes = block_bytes
        self.identity = identity
        rows_at, size = _layout(slots, block_bytes)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise TierError(name, path, f"cannot open: {exc.strerror}") from None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise TierError(name, path, "in use by another process (one engine per "
                                "pool: give each its own file)") from None
            head = os.pread(fd, _HEAD.size, 0)
            fresh = not self._matches(head)
            if fresh:
                os.ftruncate(fd, 0)
            os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self.index = np.frombuffer(self._map, dtype=ENTRY, count=slots, offset=HEADER_BYTES)
        self.pool = np.frombuffer(self._map, dtype=np.uint8, count=slots * block_bytes,
                                  offset=rows_at).reshape(slots, block_bytes)
        self.rows = {}
        if fresh:
            model, dtype, tokens, tp = identity
            self._map[:_HEAD.size] = _HEAD.pack(MAGIC, 1, 0, block_bytes, slots,
                                                model.encode()[:64], dtype.encode()[:16],
                                                tokens, tp)
        else:
            live = np.flatnonzero(self.index["flags"] == VALID)
            self.rows = dict(zip(self.index["key"][live].tolist(), live.tolist(), strict=True))
        self.reopened = len(self.rows)
        used = set(self.rows.values())
        self._free = deque(r for r in range(slots) if r not in used)

    def _matches(self, head: bytes) -> bool:
        if len(head) < _HEAD.size:
            return False
        magic, version, _, bb, slots, model, dtype, tokens, tp = _HEAD.unpack(head)
        model_, dtype_, tokens_, tp_ = self.identity
        return (magic == MAGIC and version == 1 and bb == self.block_bytes
                and slots == self.slots and model.rstrip(b"\0") == model_.encode()[:64]
                and dtype.rstrip(b"\0") == dtype_.encode()[:16] and tokens == tokens_
                and tp == tp_)

    def persisted_crcs(self) -> dict[int, int]:
        """The CRC32C recorded with every block the pool holds (taken of the row's bytes
        when it was stored)."""
        ix = self.index
        return {key: int(ix["crc"][row]) for key, row in self.rows.items()}

    def prepare_store(self, keys: Sequence[int], srcs: Sequence[np.ndarray], *,
                      crcs: Sequence[int] | None = None) -> TransferJob:
        ix = self.index
        for key in keys:  # a replaced block: its entry off before its row changes
            row = self.rows.get(key)
            if row is not None:
                ix["flags"][row] = 0
        job = super().prepare_store(keys, srcs)
        pool = self.pool
        for pos, key in enumerate(keys):
            row = self.rows[key]
            ix["key"][row] = key
            # the caller's CRC of the source is the row's: an exact copy
            ix["crc"][row] = crc32c(pool[row]) if crcs is None else crcs[pos]
            ix["flags"][row] = VALID
        return job

    def evict(self, keys: Sequence[int]) -> None:
        ix = self.index
        for key in keys:
            row = self.rows.get(key)
            if row is not None:
                ix["flags"][row] = 0
        super().evict(keys)

    def close(self) -> None:
        if self._fd < 0:
            return
        self.rows.clear()
        self.index = np.empty(0, dtype=ENTRY)
        self.pool = np.empty((0, self.block_bytes), dtype=np.uint8)
        try:
            self._map.flush()
            self._map.close()
        except (BufferError, ValueError):
            pass  # a view still exported: the mapping goes with the process
        os.close(self._fd)
        self._fd = -1

    def describe(self) -> dict[str, object]:
        return {**super().describe(), "reopened_blocks": self.reopened}
