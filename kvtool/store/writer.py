"""Pipelined bulk writes into an :class:`~kvtool.store.objectstore.ObjectStore`: ``qd``
data writes in flight, committed in batches by the store's commit protocol."""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import numpy as np

from kvtool.store.bounce import as_bytes_view, stage_for_write
from kvtool.store.checksum import crc32c
from kvtool.store.io import AlignedBuffer, IOEngine
from kvtool.store.layout import ORDINAL_NONE, Superblock, Written


class CommittingStore(Protocol):
    """What the writer uses of its :class:`~kvtool.store.objectstore.ObjectStore`: the
    layout, the engine, slot allocation and the public commit protocol."""

    engine: IOEngine
    sb: Superblock

    @property
    def retiring(self) -> bool: ...

    def allocate(self) -> int: ...

    def commit(self, records: Sequence[Written]) -> None: ...


def cpu_workers() -> int:
    """Threads for checksums, payload generation and bounce copies (one per core)."""
    return max(1, min(8, len(os.sched_getaffinity(0))))


class BatchWriter:
    """Pipelined bulk writes: ``qd`` writes in flight, committed ``batch_objects`` at a time.

    ``put(key, fill, ordinal)`` queues one object. A CPU worker calls ``fill(out)`` to write
    its bytes into ``out`` (a uint8 array of the object's length), computes its CRC32C and,
    when the object is not a whole number of LBAs, stages it into an aligned scratch buffer
    (the bounce path; aligned objects are filled in place and written zero-copy). The write
    is then submitted to the engine, which keeps up to ``qd`` of them in flight, so CPU work
    overlaps I/O instead of eating into the queue depth. A committer thread runs the commit
    protocol for each completed batch in order and then calls
    ``on_commit([(key, ordinal), ...])``: the acknowledgement. ``close()`` commits the
    remainder; errors surface there or from the next ``put``.
    """

    def __init__(self, store: CommittingStore, *, qd: int, batch_objects: int,
                 on_commit: Callable[[list[tuple[int, int]]], None] | None) -> None:
        self.store = store
        self.qd = qd
        self.batch_objects = max(1, batch_objects)
        self.on_commit = on_commit
        sb = store.sb
        self.object_bytes = sb.object_bytes
        self.padded = sb.slot_bytes
        self.aligned = self.object_bytes == self.padded
        workers = cpu_workers()
        self.window = qd + workers
        self._buffers: queue.SimpleQueue[tuple[AlignedBuffer, np.ndarray]] = queue.SimpleQueue()
        self._owned: list[AlignedBuffer] = []
        for _ in range(self.window + 1):
            ab = AlignedBuffer(self.padded)
            self._owned.append(ab)
            # The unaligned-size object lives in a plain heap array, as a KV engine's tensor
            # would; the aligned buffer is the bounce scratch. Aligned objects skip it.
            user = (np.frombuffer(ab.view, dtype=np.uint8, count=self.object_bytes)
                    if self.aligned else np.empty(self.object_bytes, dtype=np.uint8))
            self._buffers.put((ab, user))
        self._cpu = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvtool-prep")
        # Completed objects arrive here in completion order (a record, or the exception of
        # a failed fill/write), so one slow write never holds the queue depth down.
        self._done: queue.SimpleQueue[Written | BaseException] = \
            queue.SimpleQueue()
        self._inflight = 0
        self._unsent: set[int] = set()  # keys put but not yet handed to the committer
        self._batch: list[Written] = []
        self._commits: queue.Queue[list[Written] | None] = queue.Queue(2)
        self._error: BaseException | None = None
        self._committer = threading.Thread(target=self._commit_loop, name="kvtool-commit",
                                           daemon=True)
        self._committer.start()
        self.committed = 0
        self.bytes_committed = 0

    def _prepare(self, slot: int, key: int, ordinal: int, fill: Callable[[np.ndarray], None],
                 crc: int | None, bufs: tuple[AlignedBuffer, np.ndarray]) -> None:
        ab, user = bufs
        try:
            fill(user)
            if crc is None:
                crc = crc32c(user)
            view = ab.view if self.aligned else stage_for_write(
                as_bytes_view(user), ab, self.padded)
            fut = self.store.engine.submit_write(self.store.sb.slot_offset(slot), view)
        except BaseException as exc:
            self._buffers.put(bufs)
            self._done.put(exc)
            return
        record = Written(slot, key, self.object_bytes, crc, ordinal)

        def written(f: Future[None]) -> None:
            self._buffers.put(bufs)
            exc = f.exception()
            self._done.put(record if exc is None else exc)

        fut.add_done_callback(written)

    def put(self, key: int, fill: Callable[[np.ndarray], None], ordinal: int = ORDINAL_NONE,
            crc: int | None = None) -> None:
        """Queue ``key``; ``crc``, when given, must be the CRC32C of the bytes ``fill``
        writes (a deterministic payload knows it without a pass over the data)."""
        self._raise_pending()
        if key in self._unsent:
            # The same key is still queued: let that version reach an earlier commit, so
            # the later put gets the higher generation.
            while self._inflight:
                self._reap_one()
            self._send_batch()
        while self._inflight >= self.window:
            self._reap_one()
        self._unsent.add(key)
        slot = self.store.allocate()
        bufs = self._buffers.get()
        self._cpu.submit(self._prepare, slot, key, ordinal, fill, crc, bufs)
        self._inflight += 1

    def _reap_one(self) -> None:
        done = self._done.get()
        self._inflight -= 1
        if isinstance(done, BaseException):
            raise done
        self._batch.append(done)
        if len(self._batch) >= self.batch_objects:
            self._send_batch()

    def _send_batch(self) -> None:
        if self._batch:
            batch, self._batch = self._batch, []
            self._unsent.difference_update(r.key for r in batch)
            while True:
                self._raise_pending()
                try:
                    self._commits.put(batch, timeout=0.2)
                    return
                except queue.Full:
                    continue

    def _commit_loop(self) -> None:
        while True:
            batch = self._commits.get()
            if batch is None:
                if self._error is None and self.store.retiring:
                    try:  # retire versions replaced by the last batch
                        self.store.commit([])
                    except BaseException as exc:
                        self._error = exc
                return
            if self._error is not None:
                continue
            try:
                self.store.commit(batch)
                self.committed += len(batch)
                self.bytes_committed += sum(r.length for r in batch)
                if self.on_commit is not None:
                    self.on_commit([(r.key, r.ordinal) for r in batch])
            except BaseException as exc:
                self._error = exc

    def _raise_pending(self) -> None:
        if self._error is not None:
            raise self._error

    def close(self) -> None:
        """Wait for every queued object, commit them, and stop the threads."""
        try:
            while self._inflight:
                self._reap_one()
            self._send_batch()
        finally:
            while self._inflight:  # draining after an error: the first one is raised
                self._done.get()
                self._inflight -= 1
            self._cpu.shutdown(wait=True)
            self._commits.put(None)
            self._committer.join()
            for ab in self._owned:
                ab.close()
            self._owned = []
        self._raise_pending()
