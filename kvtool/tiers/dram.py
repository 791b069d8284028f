"""The local DRAM tier: one preallocated host pool (numpy), ``slots × block_bytes``."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np

from kvtool.tiers.base import DataTier, TransferJob, prefault


class DramTier(DataTier):
    """Blocks in rows of one numpy array; a key → row map and a free list.

    Copies are synchronous ``np.copyto`` (which releases the GIL): host memory moves at
    memory bandwidth, so there is nothing to overlap.
    """

    backend = "numpy"

    def __init__(self, slots: int, block_bytes: int, *, name: str = "dram") -> None:
        if slots < 1 or block_bytes < 1:
            raise ValueError("a DRAM pool needs at least one slot of at least one byte")
        self.name = name
        self.slots = slots
        self.block_bytes = block_bytes
        self.pool = np.empty((slots, block_bytes), dtype=np.uint8)
        prefault(self.pool)
        self.rows: dict[int, int] = {}
        self._free: deque[int] = deque(range(slots))

    def __contains__(self, key: int) -> bool:
        return key in self.rows

    def __len__(self) -> int:
        return len(self.rows)

    def row(self, key: int) -> np.ndarray:
        """The stored bytes of ``key`` (a view; KeyError if absent)."""
        return self.pool[self.rows[key]]

    def prepare_load(self, keys: Sequence[int], dsts: Sequence[np.ndarray], *,
                     checksum: bool = False) -> TransferJob:
        job = TransferJob(list(keys), [])
        rows, pool = self.rows, self.pool
        for key, dst in zip(keys, dsts, strict=True):
            r = rows.get(key)
            if r is None:
                job.ok.append(False)
                continue
            np.copyto(dst, pool[r])
            job.ok.append(True)
            job.nbytes += self.block_bytes
        return job

    def complete_load(self, job: TransferJob) -> list[bool]:
        return job.ok

    def prepare_store(self, keys: Sequence[int], srcs: Sequence[np.ndarray], *,
                      crcs: Sequence[int] | None = None) -> TransferJob:
        job = TransferJob(list(keys), [])
        rows, pool, free = self.rows, self.pool, self._free
        for key, src in zip(keys, srcs, strict=True):
            r = rows.get(key)
            if r is None:
                if not free:
                    raise RuntimeError(f"{self.name} pool: all {self.slots} slots in use "
                                       "(the engine sized it too small)")
                r = rows[key] = free.popleft()
            np.copyto(pool[r], src)
            job.ok.append(True)
            job.nbytes += self.block_bytes
        return job

    def complete_store(self, job: TransferJob) -> None:
        return None

    def evict(self, keys: Sequence[int]) -> None:
        rows, free = self.rows, self._free
        for key in keys:
            r = rows.pop(key, None)
            if r is not None:
                free.append(r)

    def close(self) -> None:
        self.rows.clear()
        self.pool = np.empty((0, self.block_bytes), dtype=np.uint8)
