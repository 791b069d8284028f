"""The NVMe tier: kvtool's object store on any store URL, holding whole KV blocks.

The namespace (file, block device, or ``nvme+tcp://`` namespace of the emulator, the
kernel target or SPDK) is formatted as a kvtool store (superblock, index area, slots of
the block's size padded to whole LBAs) and blocks go to slots. Like vLLM's and LMCache's
local-disk backends, the key → slot map of this cache lives in memory while it runs: a
replay starts cold, so no index entry is committed per block (no flush per put); content
is proven on every load instead (the caller compares it with the block's deterministic
payload). At the end of a run :meth:`NvmeTier.commit` commits every block the tier holds
through the store's commit protocol (one batch: flush, index, flush), so ``kvtool verify``
of the place afterwards checks each of them on the medium. The CRC32C each index entry
needs is taken from the staged bytes by a helper thread once the write has completed,
off the caller's thread (a 1 MB block's CRC costs ~100 µs, five times the replay's
per-block overhead budget).

**Durable mode** (``durable=True``, an engine's connector): the tier opens the store the
place already holds (formatting it only when it holds none), so a new process finds the
blocks an earlier one stored; writes go to free slots of the store and
:meth:`NvmeTier.commit` commits them (and the evictions since the last commit) through
the store's crash-consistent protocol, batch by batch while the engine runs: an entry on
the medium always names bytes that were durable before it. A block stored but not yet
committed when the process dies is a miss for the next one, never wrong bytes.

Every write is staged through an aligned buffer of the padded slot size (the bounce path,
which a misaligned object such as DeepSeek-V4-Flash's 1,002,240 B needs anyway), so the
caller's row is free again when :meth:`prepare_store` returns and the write completes in
the background — overlapped with the next request. Loads keep ``read_qd`` reads in flight.
"""

from __future__ import annotations

import contextlib
import queue
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import replace
from typing import Any

import numpy as np

from kvtool.store.checksum import crc32c
from kvtool.store.engine import AlignedBuffer, IOEngine
from kvtool.store.layout import (
    ORDINAL_KEYED,
    ORDINAL_NONE,
    BadSuperblock,
    Geometry,
    NotAStore,
    Written,
    new_superblock,
)
from kvtool.store.objectstore import ObjectStore, StoreFull
from kvtool.tiers.base import DataTier, TierError, TransferJob

IO_TIMEOUT_S = 30.0
"""Longest wait for one transfer before the tier is declared failed."""


class NvmeTier(DataTier):
    """Blocks in the slots of a freshly formatted kvtool store on ``engine``."""

    backend = "objectstore"

    def __init__(self, engine: IOEngine, *, block_bytes: int, url: str,
                 max_slots: int | None = None, read_qd: int = 16, write_qd: int = 16,
                 seed: int = 0, geometry: Geometry | None = None, name: str = "nvme",
                 keyed_payload: bool = False, durable: bool = False,
                 reformat: bool = False) -> None:
        """``keyed_payload``: every block stored is ``Payload(block_bytes, seed)`` of its
        key (a data-mode replay's blocks), so committed entries let verify check content.
        ``durable``: open the store the place holds (see the module docstring); one of
        other blocks (another object size or geometry), or a damaged one, is an error
        unless ``reformat`` (then it is formatted anew)."""
        self.name = name
        self.ordinal = ORDINAL_KEYED if keyed_payload else ORDINAL_NONE
        self.url = url
        self.engine = engine
        self.block_bytes = block_bytes
        self.read_qd = max(1, read_qd)
        self.write_qd = max(1, write_qd)
        sb = new_superblock(device_bytes=engine.size, object_bytes=block_bytes,
                            lba_size=engine.lba_size,
                            physical_block_size=getattr(engine, "physical_block_size",
                                                        engine.lba_size),
                            seed=seed, created_ns=time.time_ns(), geometry=geometry)
        if max_slots is not None and max_slots < sb.slot_count:
            sb = replace(sb, slot_count=max_slots)
        if sb.slot_count < 1:
            raise TierError(name, url, f"{engine.size} bytes hold no {block_bytes}-byte block")
        self.durable = durable
        self.reopened = 0
        """Durable mode: blocks found in the store the place already held."""
        self.dead: str | None = None
        store = None
        if durable:
            store = self._reopen(engine, block_bytes, geometry, reformat)
        if store is not None:
            sb = store.sb
        self.sb = sb
        self.slots = sb.slot_count
        self.metadata_bytes = sb.index_offset + sb.index_bytes
        """Bytes formatting writes (superblock and zeroed index), besides the blocks."""
        self.padded = sb.slot_bytes
        if store is None:
            try:
                store = ObjectStore.format(engine, sb)
            except Exception as exc:
                raise self._error(exc) from None
        self.store = store
        self.slot_of: dict[int, int] = dict(store.by_key)
        self.reopened = len(self.slot_of)
        self._uncommitted: dict[int, int] = {}
        """Durable mode: key → slot of writes not yet committed."""
        self._pending: dict[int, Future[None]] = {}
        self._free: deque[int] = deque(range(sb.slot_count))
        self._wstage: queue.SimpleQueue[AlignedBuffer] = queue.SimpleQueue()
        self._owned = [AlignedBuffer(self.padded) for _ in range(self.write_qd + self.read_qd)]
        for ab in self._owned[:self.write_qd]:
            self._wstage.put(ab)
        self._rstage = [np.frombuffer(ab.view, dtype=np.uint8)
                        for ab in self._owned[self.write_qd:]]
        self._rviews = [ab.view for ab in self._owned[self.write_qd:]]
        self._crc_of: dict[int, Future[int]] = {}
        """Each held key's CRC32C, computed after its latest write completed."""
        for key, slot in self.slot_of.items():
            done: Future[int] = Future()
            done.set_result(int(store.entries[slot]["data_crc"]))
            self._crc_of[key] = done
        self._crc_pool = ThreadPoolExecutor(1, thread_name_prefix=f"{name}-crc")
        self.committed: int | None = None
        """Objects :meth:`commit` made durable in the store's index (None: not committed)."""

    # ------------------------------------------------------------------ helpers
    def _reopen(self, engine: IOEngine, block_bytes: int, geometry: Geometry | None,
                reformat: bool) -> ObjectStore | None:
        """The store ``engine`` holds, if it is one of these blocks (None: none there, or
        one of other blocks and ``reformat``)."""
        try:
            store = ObjectStore.open(engine)
        except NotAStore:
            return None
        except BadSuperblock as exc:
            if reformat:
                return None
            raise TierError(self.name, self.url, f"{exc}; reformat it to use it as a cache "
                            "(this erases it)") from None
        except Exception as exc:
            raise self._error(exc) from None
        sb = store.sb
        want = geometry or Geometry()
        # (the superblock keeps the first 64 bytes of the model's name, 16 of the dtype's)
        want = replace(want, model=want.model.encode()[:64].decode(errors="replace"),
                       dtype=want.dtype.encode()[:16].decode(errors="replace"))
        if sb.object_bytes != block_bytes or sb.geometry != want:
            have = (f"{sb.object_bytes:,}-byte objects of {sb.geometry.model or 'no model'} "
                    f"{sb.geometry.dtype} ({sb.geometry.block_tokens} tokens/block, "
                    f"tp {sb.geometry.tp})")
            need = (f"{block_bytes:,}-byte blocks of {want.model or 'no model'} {want.dtype} "
                    f"({want.block_tokens} tokens/block, tp {want.tp})")
            store.close()
            if reformat:
                return None
            raise TierError(self.name, self.url, f"holds a kvtool store of {have}, not "
                            f"{need}; reformat it to use it for these (this erases it)")
        return store

    def persisted_crcs(self) -> dict[int, int]:
        """Durable mode: the CRC32C of every block the store held when it was opened."""
        entries = self.store.entries
        return {key: int(entries[slot]["data_crc"])
                for key, slot in self.store.by_key.items()}

    def _error(self, exc: BaseException) -> TierError:
        text = str(exc) or type(exc).__name__
        self.dead = text.splitlines()[0]
        return TierError(self.name, self.url, self.dead)

    def _alive(self) -> None:
        """Fail fast once the medium has failed (each wait would be another timeout)."""
        if self.dead is not None:
            raise TierError(self.name, self.url, self.dead)

    def __contains__(self, key: int) -> bool:
        return key in self.slot_of

    def __len__(self) -> int:
        return len(self.slot_of)

    def _settle(self, key: int) -> None:
        """Wait for an in-flight write of ``key`` (a read or a reuse of its slot follows)."""
        fut = self._pending.pop(key, None)
        if fut is not None:
            self._wait([fut], "write")

    def _wait(self, futures: Sequence[Future[None]], what: str) -> None:
        """Wait for ``futures``; the first failure (not the first in order) fails the tier,
        so a dead target is reported once its first transfer gives up."""
        done, pending = wait(futures, timeout=IO_TIMEOUT_S, return_when=FIRST_EXCEPTION)
        for f in done:
            exc = f.exception()
            if exc is not None:
                raise self._error(exc) from None
        if pending:
            raise self._error(TimeoutError(f"a {what} did not complete in "
                                           f"{IO_TIMEOUT_S:.0f} s"))

    # ------------------------------------------------------------------ loads
    def prepare_load(self, keys: Sequence[int], dsts: Sequence[np.ndarray]) -> TransferJob:
        self._alive()
        job = TransferJob(list(keys), [False] * len(keys))
        todo = []
        for i, key in enumerate(keys):
            slot = self.slot_of.get(key)
            if slot is None:
                continue
            self._settle(key)
            todo.append((i, slot))
        job.nbytes = len(todo) * self.block_bytes
        # One load at a time per tier (the read buffers are the tier's): the caller
        # completes a load before it prepares the next.
        job.state = (deque(todo), list(dsts), deque(), list(range(self.read_qd)))
        self._fill_window(job)
        return job

    def _fill_window(self, job: TransferJob) -> None:
        todo, _dsts, inflight, free = job.state
        while todo and free:
            i, slot = todo.popleft()
            b = free.pop()
            try:
                fut = self.engine.submit_read(self.sb.slot_offset(slot), self._rviews[b])
            except Exception as exc:
                raise self._error(exc) from None
            inflight.append((i, b, fut))

    def complete_load(self, job: TransferJob) -> list[bool]:
        self._alive()
        _todo, dsts, inflight, free = job.state
        n = self.block_bytes
        while inflight:
            i, b, fut = inflight.popleft()
            self._wait_head(fut, [x[2] for x in inflight])
            np.copyto(dsts[i], self._rstage[b][:n])
            free.append(b)
            job.ok[i] = True
            self._fill_window(job)
        return job.ok

    def _wait_head(self, head: Future[None], others: list[Future[None]]) -> None:
        """Wait for ``head`` while failing at once if any other read in flight fails."""
        while not head.done():
            others = [f for f in others if not f.done()]
            done, _ = wait([head, *others], timeout=IO_TIMEOUT_S, return_when=FIRST_COMPLETED)
            if not done:
                raise self._error(TimeoutError(f"a read did not complete in "
                                               f"{IO_TIMEOUT_S:.0f} s"))
            for f in done:
                if f.exception() is not None:
                    raise self._error(f.exception())  # type: ignore[arg-type]
        if head.exception() is not None:
            raise self._error(head.exception())  # type: ignore[arg-type]

    # ------------------------------------------------------------------ stores
    def prepare_store(self, keys: Sequence[int], srcs: Sequence[np.ndarray]) -> TransferJob:
        self._alive()
        job = TransferJob(list(keys), [])
        n = self.block_bytes
        for key, src in zip(keys, srcs, strict=True):
            if self.durable:
                slot = self._durable_slot(key)
            else:
                held = self.slot_of.get(key)
                if held is None:
                    if not self._free:
                        raise RuntimeError(f"{self.name} tier: all {self.slots} slots in use "
                                           "(the engine sized it too small)")
                    slot = self._free.popleft()
                else:
                    slot = held
                    self._settle(key)
            try:
                ab = self._wstage.get(timeout=IO_TIMEOUT_S)
            except queue.Empty:
                raise self._error(TimeoutError(f"writes did not complete in "
                                               f"{IO_TIMEOUT_S:.0f} s")) from None
            np.copyto(np.frombuffer(ab.view, dtype=np.uint8, count=n), src)
            try:
                fut = self.engine.submit_write(self.sb.slot_offset(slot), ab.view)
            except Exception as exc:
                self._wstage.put(ab)
                if self.durable:
                    self.store.release(slot)
                else:
                    self._free.appendleft(slot)
                raise self._error(exc) from None
            crc: Future[int] = Future()
            fut.add_done_callback(self._returner(ab, n, crc))
            self._crc_of[key] = crc
            self.slot_of[key] = slot
            if self.durable:
                self._uncommitted[key] = slot
            self._pending[key] = fut
            job.futures.append(fut)
            job.ok.append(True)
            job.nbytes += n
        return job

    def _returner(self, ab: AlignedBuffer, n: int,
                  crc: Future[int]) -> Callable[[Future[None]], None]:
        """A done-callback that has the written bytes' CRC32C taken on the CRC thread (not
        the engine's completion thread, which reads wait on), then hands the staging
        buffer back for the next write."""
        def checksum(f: Future[None]) -> None:
            try:
                exc = f.exception()
                if exc is None:
                    crc.set_result(crc32c(np.frombuffer(ab.view, dtype=np.uint8, count=n)))
                else:
                    crc.set_exception(exc)
            except BaseException as err:  # the commit must see it, not a logger
                if not crc.done():
                    crc.set_exception(err)
            finally:
                self._wstage.put(ab)

        def done(f: Future[None]) -> None:
            try:
                self._crc_pool.submit(checksum, f)
            except RuntimeError as exc:  # closed: nothing will commit this write
                crc.set_exception(exc)
                self._wstage.put(ab)
        return done

    def _durable_slot(self, key: int) -> int:
        """A free slot of the store for a new version of ``key``. A committed version
        stays where it is until the commit of the new one retires it; an uncommitted one
        was never in the index, and its slot is free again once its write has landed."""
        old = self._uncommitted.pop(key, None)
        if old is not None:
            self._settle(key)
            self.store.release(old)
        try:
            return self.store.allocate()
        except StoreFull:
            pass
        # retired versions are freed by a commit: make them durable and try again
        try:
            self.commit_pending()
            self.store.commit([])
        except TierError:
            raise
        except Exception as exc:
            raise self._error(exc) from None
        try:
            return self.store.allocate()
        except StoreFull:
            raise RuntimeError(f"{self.name} tier: all {self.slots} slots in use (the "
                               "engine sized it too small)") from None

    def complete_store(self, job: TransferJob) -> None:
        self._alive()
        self._wait(job.futures, "write")
        for key, fut in zip(job.keys, job.futures, strict=True):
            if self._pending.get(key) is fut:
                del self._pending[key]

    # ------------------------------------------------------------------ space
    def evict(self, keys: Sequence[int]) -> None:
        for key in keys:
            slot = self.slot_of.pop(key, None)
            if slot is None:
                continue
            self._crc_of.pop(key, None)
            fut = self._pending.pop(key, None)
            if fut is not None and self.dead is None:
                # the slot is reused only after its write has landed
                with contextlib.suppress(Exception):
                    fut.result(timeout=IO_TIMEOUT_S)
            if not self.durable:
                self._free.append(slot)
                continue
            if self._uncommitted.pop(key, None) is not None:
                self.store.release(slot)  # never in the index
            if key in self.store.by_key:
                self.store.retire(key)  # its entry goes with the next commit

    def drain(self) -> None:
        """Wait for every write in flight (end of a run)."""
        for key in list(self._pending):
            self._settle(key)

    def commit_pending(self) -> int:
        """Durable mode: commit the writes since the last commit (waiting for each) and the
        evictions since then, in one batch of the store's protocol; returns the number of
        blocks it committed. Cheap when there is nothing to commit."""
        self._alive()
        if not self._uncommitted and not self.store.retiring:
            return 0
        records = []
        for key, slot in self._uncommitted.items():
            self._settle(key)
            try:
                crc = self._crc_of[key].result(timeout=IO_TIMEOUT_S)
            except Exception as exc:
                raise self._error(exc) from None
            records.append(Written(slot, key, self.block_bytes, crc, self.ordinal))
        try:
            self.store.commit(records)
        except Exception as exc:
            raise self._error(exc) from None
        self._uncommitted.clear()
        return len(records)

    def commit(self) -> int:
        """Make the store durable at the end of a run (or a clean stop): wait for every
        write, then commit an index entry for every block the tier holds through the
        store's commit protocol, so ``kvtool verify`` of the place checks them. Call it
        once, after the last store; returns the number of objects committed (durable
        mode: every block the store holds, after committing what is pending)."""
        if self.durable:
            self.commit_pending()
            if self.store.retiring:
                with contextlib.suppress(Exception):
                    self.store.commit([])
            self.committed = len(self.store)
            return self.committed
        self._alive()
        self.drain()
        records = []
        for key, slot in self.slot_of.items():
            try:
                crc = self._crc_of[key].result(timeout=IO_TIMEOUT_S)
            except Exception as exc:
                raise self._error(exc) from None
            records.append(Written(slot, key, self.block_bytes, crc, self.ordinal))
        try:
            self.store.commit_written(records)
        except Exception as exc:
            raise self._error(exc) from None
        self.committed = len(records)
        return self.committed

    def close(self) -> None:
        try:
            if self.dead is None:
                for fut in list(self._pending.values()):
                    with contextlib.suppress(Exception):
                        fut.result(timeout=IO_TIMEOUT_S)
            else:
                # a failed target: stop the host's reconnect attempts rather than wait
                # for each queued retry to time out
                ctrl = getattr(self.engine, "ctrl", None)
                if ctrl is not None:
                    with contextlib.suppress(Exception):
                        ctrl.close()
            self._pending.clear()
        finally:
            self._crc_pool.shutdown(wait=True)
            self.store.close()
            for ab in self._owned:
                ab.close()
            self._owned = []
            self.engine.close()

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "slot_bytes": self.padded,
                "committed_objects": self.committed,
                "lba_size": self.engine.lba_size, "engine": self.engine.describe()}
