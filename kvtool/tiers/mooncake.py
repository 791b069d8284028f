"""The DRAM tier on Mooncake Store (``--dram mooncake://HOST:PORT``), as the GP7000 stack
ran it: a distributed DRAM pool, here one master on loopback (``kvtool pool up``).

This process joins the pool as a client and contributes the memory the tier needs
(Mooncake pools are the sum of their clients' segments), so the tier's capacity is
really allocated, once. Blocks are objects ``<run>/<key>`` (the run prefix keeps
concurrent replays on one pool apart); transfers go through one registered staging
buffer in batches (``batch_put_from`` / ``batch_get_into``: Mooncake's zero-copy path).

The master also evicts on its own, by lease-based approximate LRU from its high
watermark. The segment is sized so that kvtool's engine, which evicts at the tier's
capacity, reaches it first; if the master evicts anyway, the block's load comes back
``False`` (lost: counted and recomputed, never served).
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvtool.mooncake.client import MooncakeClient
from kvtool.mooncake.url import MooncakeUrl, parse_mooncake_url
from kvtool.tiers.base import DataTier, TierError, TransferJob, prefault

BATCH_BLOCKS = 16
"""Blocks per Mooncake batch call (the staging buffer holds this many)."""
SEGMENT_HEADROOM = 1.25
"""Segment / capacity: above the master's 0.9 watermark with room for its allocator."""


class MooncakeTier(DataTier):
    backend = "mooncake"

    def __init__(self, url: str | MooncakeUrl, *, slots: int, block_bytes: int,
                 name: str = "dram", run_id: str | None = None) -> None:
        if slots < 1 or block_bytes < 1:
            raise ValueError("a Mooncake tier needs at least one slot of at least one byte")
        self.name = name
        self._url = url if isinstance(url, MooncakeUrl) else parse_mooncake_url(url)
        self.url = str(self._url)
        self.slots = slots
        self.block_bytes = block_bytes
        self.prefix = f"kvtool/{run_id or uuid.uuid4().hex[:12]}/"
        self.batch = min(BATCH_BLOCKS, slots)
        segment = max(64 << 20, math.ceil(slots * block_bytes * SEGMENT_HEADROOM))
        staging_bytes = self.batch * block_bytes
        # No pool at the URL is bad input (MooncakeError, exit 2), not a failed tier.
        self.client = MooncakeClient(self._url, segment_bytes=segment,
                                     buffer_bytes=max(16 << 20, 2 * staging_bytes))
        self.staging = np.empty((self.batch, block_bytes), dtype=np.uint8)
        prefault(self.staging)
        self.client.register(self.staging)
        self._base = self.staging.ctypes.data
        self.held: set[int] = set()

    def object_key(self, key: int) -> str:
        """The name block ``key`` has in the Mooncake pool: this run's prefix, then the key
        in hex (one run's blocks never collide with another's)."""
        return f"{self.prefix}{key:x}"

    def __contains__(self, key: int) -> bool:
        return key in self.held

    def __len__(self) -> int:
        return len(self.held)

    def _ptrs(self, n: int) -> list[int]:
        return [self._base + i * self.block_bytes for i in range(n)]

    def prepare_load(self, keys: Sequence[int], dsts: Sequence[np.ndarray]) -> TransferJob:
        job = TransferJob(list(keys), [])
        bb = self.block_bytes
        for start in range(0, len(keys), self.batch):
            part = keys[start:start + self.batch]
            names = [self.object_key(k) for k in part]
            got = self.client.batch_get_into(names, self._ptrs(len(part)),
                                                    [bb] * len(part))
            for i, (key, n) in enumerate(zip(part, got, strict=True)):
                ok = key in self.held and n == bb
                if ok:
                    np.copyto(dsts[start + i], self.staging[i])
                    job.nbytes += bb
                job.ok.append(ok)
        return job

    def complete_load(self, job: TransferJob) -> list[bool]:
        return job.ok

    def prepare_store(self, keys: Sequence[int], srcs: Sequence[np.ndarray]) -> TransferJob:
        job = TransferJob(list(keys), [])
        bb = self.block_bytes
        for start in range(0, len(keys), self.batch):
            part = list(keys[start:start + self.batch])
            if len(self.held) + sum(k not in self.held for k in part) > self.slots:
                raise RuntimeError(f"{self.name} tier: all {self.slots} slots in use "
                                   "(the engine sized it too small)")
            stale = [self.object_key(k) for k in part if k in self.held]
            if stale:  # a re-put replaces the object (Mooncake refuses duplicate puts)
                self.client.batch_remove(stale)
            for i in range(len(part)):
                np.copyto(self.staging[i], srcs[start + i])
            rcs = self.client.batch_put_from([self.object_key(k) for k in part],
                                                    self._ptrs(len(part)), [bb] * len(part))
            for key, rc in zip(part, rcs, strict=True):
                if rc != 0:
                    raise TierError(self.name, self.url, f"put of block {key:x} failed "
                                                         f"(Mooncake error {rc})")
                self.held.add(key)
                job.ok.append(True)
                job.nbytes += bb
        return job

    def complete_store(self, job: TransferJob) -> None:
        return None

    def evict(self, keys: Sequence[int]) -> None:
        gone = [k for k in keys if k in self.held]
        if not gone:
            return
        self.held.difference_update(gone)
        for start in range(0, len(gone), 256):
            self.client.batch_remove([self.object_key(k) for k in gone[start:start + 256]])

    def close(self) -> None:
        if self.held:
            self.evict(list(self.held))
        self.client.close()

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "prefix": self.prefix}
