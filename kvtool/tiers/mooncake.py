"""The DRAM tier on Mooncake Store (``--dram mooncake://HOST:PORT``), as the GP7000 stack
ran it: a distributed DRAM pool, here one master on loopback (``kvtool pool up``).

This process joins the pool as a client and contributes the memory the tier needs
(Mooncake pools are the sum of their clients' segments), so the tier's capacity is
really allocated, once. Blocks are objects ``<run>/<key>`` (the run prefix keeps
concurrent replays on one pool apart); transfers go through one registered staging
buffer in batches (``batch_put_from`` / ``batch_get_into``: Mooncake's zero-copy path).

**Durable mode** (``durable=True``, an engine's connector): the objects must outlive the
process, so the tier contributes no memory (a client's segment leaves the pool with it)
and relies on the pool's own (``kvtool pool up --memory SIZE``); the key prefix is the
caller's stable ``run_id``; each block's CRC32C is taken as it is stored, and
:meth:`MooncakeTier.commit_pending` keeps an index object (``<prefix>index``: keys and
CRCs) that a new process reads back, keeping the keys the pool still holds.

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
from kvtool.store.checksum import crc32c
from kvtool.tiers.base import DataTier, TierError, TransferJob, prefault

BATCH_BLOCKS = 16
"""Blocks per Mooncake batch call (the staging buffer holds this many)."""
SEGMENT_HEADROOM = 1.25
_INDEX = np.dtype([("key", "<u8"), ("crc", "<u4")])
_INDEX_MAGIC = b"KVTMCIX1"
"""The durable index object: this magic, then (key, CRC32C) records."""
"""Segment / capacity: above the master's 0.9 watermark with room for its allocator."""


class MooncakeTier(DataTier):
    backend = "mooncake"

    def __init__(self, url: str | MooncakeUrl, *, slots: int, block_bytes: int,
                 name: str = "dram", run_id: str | None = None, durable: bool = False) -> None:
        if slots < 1 or block_bytes < 1:
            raise ValueError("a Mooncake tier needs at least one slot of at least one byte")
        self.name = name
        self._url = url if isinstance(url, MooncakeUrl) else parse_mooncake_url(url)
        self.url = str(self._url)
        self.slots = slots
        self.block_bytes = block_bytes
        self.prefix = f"kvtool/{run_id or uuid.uuid4().hex[:12]}/"
        self.batch = min(BATCH_BLOCKS, slots)
        self.durable = durable
        segment = 0 if durable else max(64 << 20, math.ceil(slots * block_bytes * SEGMENT_HEADROOM))
        staging_bytes = self.batch * block_bytes
        # No pool at the URL is bad input (MooncakeError, exit 2), not a failed tier.
        self.client = MooncakeClient(self._url, segment_bytes=segment,
                                     buffer_bytes=max(16 << 20, 2 * staging_bytes))
        self.staging = np.empty((self.batch, block_bytes), dtype=np.uint8)
        prefault(self.staging)
        self.client.register(self.staging)
        self._base = self.staging.ctypes.data
        self.held: set[int] = set()
        self.crcs: dict[int, int] = {}
        """Durable mode: each held block's CRC32C, as stored."""
        self._dirty = False
        self.reopened = 0
        if durable:
            try:
                self._reopen()
            except BaseException:
                self.client.close()
                raise

    def _index_key(self) -> str:
        return f"{self.prefix}index"

    def _reopen(self) -> None:
        """Durable mode: the index object, less the keys the pool no longer holds; then
        a probe put proves the pool holds memory of its own."""
        raw = self.client.get_bytes(self._index_key())
        if raw[:8] == _INDEX_MAGIC and (len(raw) - 8) % _INDEX.itemsize == 0:
            rec = np.frombuffer(raw, dtype=_INDEX, offset=8)
            keys = rec["key"].tolist()
            names = [self.object_key(k) for k in keys]
            there = self.client.batch_exists(names)
            for key, crc, ok in zip(keys, rec["crc"].tolist(), there, strict=True):
                if ok and len(self.held) < self.slots:
                    self.held.add(key)
                    self.crcs[key] = crc
        self.reopened = len(self.held)
        try:
            self._write_index()
        except Exception as exc:
            raise TierError(self.name, self.url, f"{exc}; a pool that keeps objects after "
                            "their client exits needs memory of its own: kvtool pool up "
                            "--memory SIZE") from None

    def _write_index(self) -> None:
        rec = np.empty(len(self.held), dtype=_INDEX)
        keys = list(self.held)
        rec["key"] = keys
        rec["crc"] = [self.crcs.get(k, 0) for k in keys]
        self.client.upsert(self._index_key(), _INDEX_MAGIC + rec.tobytes())
        self._dirty = False

    def persisted_crcs(self) -> dict[int, int]:
        """Durable mode: the CRC32C of every block the pool held when this tier opened
        (and since)."""
        return {k: self.crcs[k] for k in self.held if k in self.crcs}

    def commit_pending(self) -> int:
        """Durable mode: write the index object if blocks came or went since the last
        write; returns the blocks it names (0 when nothing changed)."""
        if not self.durable or not self._dirty:
            return 0
        try:
            self._write_index()
        except Exception as exc:
            raise TierError(self.name, self.url, f"index write failed: {exc}") from None
        return len(self.held)

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

    def prepare_load(self, keys: Sequence[int], dsts: Sequence[np.ndarray], *,
                     checksum: bool = False) -> TransferJob:
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

    def prepare_store(self, keys: Sequence[int], srcs: Sequence[np.ndarray], *,
                      crcs: Sequence[int] | None = None) -> TransferJob:
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
            for i, (key, rc) in enumerate(zip(part, rcs, strict=True)):
                if rc != 0:
                    raise TierError(self.name, self.url, f"put of block {key:x} failed "
                                                         f"(Mooncake error {rc})")
                self.held.add(key)
                if self.durable:
                    self.crcs[key] = crc32c(self.staging[i])
                    self._dirty = True
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
        for k in gone:
            self.crcs.pop(k, None)
        self._dirty = self.durable
        for start in range(0, len(gone), 256):
            self.client.batch_remove([self.object_key(k) for k in gone[start:start + 256]])

    def close(self) -> None:
        if self.durable:  # the blocks stay in the pool, named by the index
            try:
                self.commit_pending()
            finally:
                self.client.close()
            return
        if self.held:
            self.evict(list(self.held))
        self.client.close()

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "prefix": self.prefix}
