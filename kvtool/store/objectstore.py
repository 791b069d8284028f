"""A store of fixed-size KV objects on one namespace, with a crash-consistent index.

Commit protocol (docs/store-layout.md §"Crash consistency")
-----------------------------------------------------------
A batch of objects is committed in four steps, by one committer, batches in order:

1. write each object's data (padded to whole LBAs) into a **free** slot and wait for it;
2. ``flush`` — every byte of the batch's data is durable;
3. write the index blocks holding the batch's entries (each entry sealed by its CRC32C);
4. ``flush`` — the entries are durable; only now is the batch *acknowledged*.

A crash before step 4 completes leaves each new entry either absent (old bytes: the slot
is still free) or present and pointing at data made durable in step 2; entries are 64 B
and never straddle a 512 B sector, so a torn index write cannot mix two entries. Slots are
never overwritten while an entry references them: replacing a key writes a new slot with
a higher ``generation`` and retires the old entry in a later commit; if a crash leaves both,
the higher generation wins when the store is opened.

Invariant: every entry that is valid on the medium (CRC ok, this store's tag, flag set)
references a slot whose data was durable before the entry was written.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from kvtool.align import padded_size, round_up
from kvtool.store import layout as L
from kvtool.store.bounce import as_bytes_view, copy_into, stage_for_write
from kvtool.store.checksum import crc32c
from kvtool.store.io import AlignedBuffer, IOEngine
from kvtool.store.layout import (
    ENTRY_BYTES,
    ENTRY_DTYPE,
    FLAG_VALID,
    META_BLOCK,
    Superblock,
    Written,
)

if TYPE_CHECKING:
    from kvtool.store.writer import BatchWriter

IO_CHUNK = 8 << 20
"""Index reads/writes larger than this are split (bounded scratch memory)."""


@dataclass
class IndexProblem:
    """An index entry that cannot be trusted (bad CRC or impossible fields)."""

    slot: int
    entry_offset: int
    key: int
    reason: str


@dataclass
class IndexScan:
    """What opening the store found in the index (see docs/store-layout.md)."""

    live: int = 0
    stale: int = 0
    superseded: int = 0
    problems: list[IndexProblem] = field(default_factory=list)
    live_slots: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))


class ObjectStore:
    """Format/open a store on an engine; put/get/delete objects; iterate the index.

    ``put`` and ``delete`` are durable when they return (each is its own commit); bulk
    loads use :meth:`writer`, which pipelines data writes and commits in batches. Commits
    are serialised by the caller: use one writer, or single ``put``/``delete`` calls, at a
    time (the writer's own threads are coordinated internally).
    """

    def __init__(self, engine: IOEngine, sb: Superblock, image: AlignedBuffer,
                 scan: IndexScan) -> None:
        self.engine = engine
        self.sb = sb
        self._image = image
        self.entries: np.ndarray = np.frombuffer(image.view, dtype=ENTRY_DTYPE,
                                                 count=sb.slot_count)
        self.scan = scan
        self.by_key: dict[int, int] = {}
        self.generation = 0
        self._free: deque[int] = deque()
        self._retire: list[int] = []
        self._lock = threading.Lock()
        self._index_entries()

    # ---------------------------------------------------------------- format / open
    @classmethod
    def format(cls, engine: IOEngine, sb: Superblock) -> ObjectStore:
        """Write an empty store described by ``sb`` (index zeroed, then superblock)."""
        if sb.slot_count < 1:
            raise ValueError("the superblock has no slots")
        meta = sb.index_offset
        zero = AlignedBuffer(min(IO_CHUNK, sb.index_bytes))
        try:
            for off in range(meta, meta + sb.index_bytes, zero.nbytes):
                n = min(zero.nbytes, meta + sb.index_bytes - off)
                engine.write_from(off, zero.view[:n])
        finally:
            zero.close()
        engine.flush()
        head = AlignedBuffer(meta)
        head.view[:META_BLOCK] = sb.encode()
        engine.write_from(0, head.view[:meta])
        engine.flush()
        head.close()
        image = AlignedBuffer(sb.index_bytes)
        return cls(engine, sb, image, IndexScan())

    @staticmethod
    def read_superblock(engine: IOEngine) -> Superblock:
        meta = round_up(META_BLOCK, engine.lba_size)
        if engine.size < meta:
            raise L.NotAStore(f"the target has only {engine.size} usable bytes, less than a "
                              f"kvtool superblock ({meta} bytes)")
        head = AlignedBuffer(meta)
        try:
            engine.read_into(0, head.view)
            return Superblock.decode(head.view)
        finally:
            head.close()

    @classmethod
    def open(cls, engine: IOEngine) -> ObjectStore:
        """Open an existing store: raises :class:`~kvtool.store.layout.NotAStore` or
        :class:`~kvtool.store.layout.BadSuperblock`."""
        sb = cls.read_superblock(engine)
        end = sb.data_offset + sb.slot_count * sb.slot_bytes
        if end > engine.size:
            raise L.BadSuperblock(f"the store ends at byte {end} but the target has only "
                                  f"{engine.size} bytes (truncated?)")
        if sb.lba_size % engine.lba_size:
            raise L.BadSuperblock(f"the store was formatted for {sb.lba_size}-byte blocks; "
                                  f"this target needs multiples of {engine.lba_size}")
        image = AlignedBuffer(sb.index_bytes)
        for off in range(0, sb.index_bytes, IO_CHUNK):
            n = min(IO_CHUNK, sb.index_bytes - off)
            engine.read_into(sb.index_offset + off, image.view[off:off + n])
        entries = np.frombuffer(image.view, dtype=ENTRY_DTYPE, count=sb.slot_count)
        return cls(engine, sb, image, scan_index(sb, entries))

    def close(self) -> None:
        self.entries = np.empty(0, dtype=ENTRY_DTYPE)
        self._image.close()

    def _index_entries(self) -> None:
        e = self.entries
        bad = {p.slot for p in self.scan.problems}
        slots = self.scan.live_slots
        keys, gens = e["key"][slots], e["generation"][slots]
        order = np.argsort(gens, kind="stable")
        for slot, key in zip(slots[order].tolist(), keys[order].tolist(), strict=True):
            old = self.by_key.get(key)
            if old is not None:
                self._retire.append(old)  # a crash left two generations: newest wins
                self.scan.superseded += 1
            self.by_key[key] = slot
        self.scan.live = len(self.by_key)
        self.generation = int(gens.max()) if gens.size else 0
        used = set(self.by_key.values()) | bad | set(self._retire)
        self._free = deque(s for s in range(self.sb.slot_count) if s not in used)

    # ---------------------------------------------------------------- queries
    @property
    def free_slots(self) -> int:
        return len(self._free)

    def is_free(self, slot: int) -> bool:
        """Whether ``slot`` may be allocated (O(free slots)). A slot whose index entry
        failed its checks never is: the evidence stays for ``verify``."""
        return slot in self._free

    def __len__(self) -> int:
        return len(self.by_key)

    def __contains__(self, key: int) -> bool:
        return key in self.by_key

    def live_slots(self) -> list[int]:
        """Slots of live objects in slot order."""
        return sorted(self.by_key.values())

    # ---------------------------------------------------------------- index writes
    def write_index(self, slots: list[int]) -> None:
        """Write the index blocks (whole LBAs) holding ``slots``' entries from the image
        (:attr:`entries` as it is now), one write per run of adjacent blocks; no flush.

        :meth:`commit` calls it; called directly it writes outside the commit protocol
        (what a repair tool, or a test planting a fault, does)."""
        if not slots:
            return
        lba = self.engine.lba_size
        blocks = sorted({s * ENTRY_BYTES // lba for s in slots})
        runs: list[list[int]] = [[blocks[0], blocks[0]]]
        for b in blocks[1:]:
            if b == runs[-1][1] + 1 and (b - runs[-1][0]) * lba < IO_CHUNK:
                runs[-1][1] = b
            else:
                runs.append([b, b])
        for first, last in runs:
            lo, hi = first * lba, min((last + 1) * lba, self.sb.index_bytes)
            self.engine.write_from(self.sb.index_offset + lo, self._image.view[lo:hi])

    @property
    def retiring(self) -> bool:
        """Whether replaced or deleted versions wait to be zeroed by the next commit (an
        empty :meth:`commit` zeroes them)."""
        return bool(self._retire)

    def commit(self, records: Sequence[Written]) -> None:
        """Steps 2–4 of the protocol for ``records``, whose data writes have completed, into
        slots allocated from this store: one flush, one index write, one flush. A key twice
        in ``records``: the later one wins and the earlier slot is freed. Versions these
        records replace are zeroed by the next commit, once this one is durable (an empty
        list just does that)."""
        self.engine.flush()
        sb = self.sb
        with self._lock:
            last = {r.key: r for r in records}
            if len(last) < len(records):  # a key twice in one batch: the later one wins,
                kept = set(map(id, last.values()))  # the earlier slot was never referenced
                self._free.extend(r.slot for r in records if id(r) not in kept)
            records = [r for r in records if r is last[r.key]]
            self.generation += 1
            retire, self._retire = self._retire, []
            touched = [r.slot for r in records]
            for r in records:
                old = self.by_key.get(r.key)
                if old is not None and old != r.slot:
                    # The old version is zeroed by the *next* commit, once this one is
                    # durable: zeroing it in the same index write could, if that write
                    # tore, lose the key entirely.
                    self._retire.append(old)
                self.by_key[r.key] = r.slot
            if records:
                idx = np.array(touched, dtype=np.int64)
                new = np.zeros(len(records), dtype=ENTRY_DTYPE)
                new["key"] = np.array([r.key for r in records], dtype=np.uint64)
                new["store_tag"] = sb.store_tag
                new["offset"] = np.uint64(sb.data_offset) + idx.astype(np.uint64) * np.uint64(
                    sb.slot_bytes)
                new["length"] = np.array([r.length for r in records], dtype=np.uint64)
                new["generation"] = self.generation
                new["ordinal"] = np.array([r.ordinal for r in records], dtype=np.uint64)
                new["data_crc"] = np.array([r.crc for r in records], dtype=np.uint32)
                new["lba_count"] = (new["length"] + np.uint64(sb.lba_size - 1)) // np.uint64(
                    sb.lba_size)
                new["flags"] = FLAG_VALID
                L.seal(new)
                self.entries[idx] = new
            if retire:
                self.entries[np.array(retire, dtype=np.int64)] = np.zeros(len(retire),
                                                                          dtype=ENTRY_DTYPE)
        self.write_index(sorted(touched + retire))
        self.engine.flush()
        with self._lock:
            self._free.extend(retire)

    def commit_written(self, records: Sequence[Written]) -> None:
        """Commit ``records`` whose data the caller wrote into slots it owns (every write
        completed): :meth:`commit`, one batch. The slots must be free in this store's index
        (a fresh store's caller allocates them itself, as the NVMe tier does)."""
        with self._lock:
            taken = {r.slot for r in records}
            self._free = deque(s for s in self._free if s not in taken)
        self.commit(records)

    def allocate(self) -> int:
        with self._lock:
            if not self._free:
                raise StoreFull(f"no free slot: the store holds {self.sb.slot_count} objects")
            return self._free.popleft()

    def release(self, slot: int) -> None:
        """Return a slot that was allocated but never committed."""
        with self._lock:
            self._free.appendleft(slot)

    # ---------------------------------------------------------------- single objects
    def put(self, key: int, data: bytes | memoryview | np.ndarray) -> None:
        """Store ``data`` under ``key`` (replacing any older version); durable on return."""
        view = as_bytes_view(data)
        if not 0 < view.nbytes <= self.sb.slot_bytes:
            raise ValueError(f"object of {view.nbytes} bytes does not fit a "
                             f"{self.sb.slot_bytes}-byte slot")
        slot = self.allocate()
        try:
            padded = padded_size(view.nbytes, self.sb.lba_size)
            scratch = AlignedBuffer(padded)
            try:
                self.engine.write_from(self.sb.slot_offset(slot),
                                       stage_for_write(view, scratch, padded))
            finally:
                scratch.close()
        except BaseException:
            self.release(slot)
            raise
        self.commit([Written(slot, key, view.nbytes, crc32c(view))])
        if self._retire:
            self.commit([])  # retire the replaced version now that the new one is durable

    def get(self, key: int) -> bytes:
        """The object stored under ``key``; KeyError if absent, ObjectCorrupt on a bad CRC."""
        with self._verified_object(key) as data:
            return bytes(data)

    def get_into(self, key: int, out: memoryview) -> int:
        """Read ``key``'s object into ``out`` (bounce path: only the object's bytes are
        copied back); returns its length. KeyError if absent, ObjectCorrupt on a bad CRC."""
        with self._verified_object(key) as data:
            copy_into(out, data)
            return data.nbytes

    @contextmanager
    def _verified_object(self, key: int) -> Iterator[memoryview]:
        """``key``'s bytes, read into aligned scratch and checked against the entry's CRC;
        the view is valid only inside the ``with`` block."""
        slot = self.by_key[key]
        ent = self.entries[slot]
        length = int(ent["length"])
        scratch = AlignedBuffer(padded_size(length, self.sb.lba_size))
        try:
            self.engine.read_into(int(ent["offset"]), scratch.view)
            data = scratch.view[:length]
            if crc32c(data) != int(ent["data_crc"]):
                raise ObjectCorrupt(f"object {key:#018x} in slot {slot}: checksum mismatch")
            yield data
        finally:
            scratch.close()

    def delete(self, key: int) -> None:
        """Remove ``key``; durable on return. KeyError if absent."""
        self.retire(key)
        self.commit([])

    def retire(self, key: int) -> None:
        """Remove ``key`` from the index as of the next :meth:`commit` (which zeroes its
        entry; its slot is free once that commit is durable). KeyError if absent."""
        with self._lock:
            slot = self.by_key.pop(key)
            self._retire.append(slot)

    def writer(self, *, qd: int | None = None, batch_objects: int = 64,
               on_commit: Callable[[list[tuple[int, int]]], None] | None = None) -> BatchWriter:
        """A pipelined bulk writer (:class:`kvtool.store.writer.BatchWriter`)."""
        from kvtool.store.writer import BatchWriter

        return BatchWriter(self, qd=qd or self.engine.qd, batch_objects=batch_objects,
                           on_commit=on_commit)


class StoreFull(Exception):
    """No free slot left."""


class ObjectCorrupt(Exception):
    """An object's bytes do not match its index entry."""


def scan_index(sb: Superblock, e: np.ndarray) -> IndexScan:
    """Classify every entry: live (counted later), stale (another format or retired),
    or a problem (non-zero bytes that fail the CRC or describe an impossible extent)."""
    scan = IndexScan()
    raw = e.view(np.uint8).reshape(-1, ENTRY_BYTES)
    nz = np.flatnonzero(raw.any(axis=1))
    if not nz.size:
        return scan
    sub = e[nz]
    crc_ok = L.entry_crc(sub) == sub["entry_crc"]
    tag_ok = sub["store_tag"] == np.uint64(sb.store_tag)
    expect = np.uint64(sb.data_offset) + nz.astype(np.uint64) * np.uint64(sb.slot_bytes)
    shape_ok = ((sub["offset"] == expect) & (sub["length"] > 0)
                & (sub["length"] <= np.uint64(sb.slot_bytes)) & (sub["flags"] == FLAG_VALID))
    for i in np.flatnonzero(~crc_ok).tolist():
        slot = int(nz[i])
        scan.problems.append(IndexProblem(slot, sb.index_offset + slot * ENTRY_BYTES,
                                          int(sub["key"][i]), "index entry checksum mismatch"))
    for i in np.flatnonzero(crc_ok & tag_ok & ~shape_ok).tolist():
        slot = int(nz[i])
        scan.problems.append(IndexProblem(slot, sb.index_offset + slot * ENTRY_BYTES,
                                          int(sub["key"][i]), "index entry describes an "
                                          "impossible extent"))
    scan.stale = int(np.count_nonzero(crc_ok & ~tag_ok))
    scan.live_slots = nz[crc_ok & tag_ok & shape_ok]
    return scan


__all__ = ["IndexProblem", "IndexScan", "ObjectCorrupt", "ObjectStore", "StoreFull",
           "scan_index"]
