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
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import numpy as np

from kvtool.store.checksum import crc32c
from kvtool.store.engine import AlignedBuffer, IOEngine, submit_batch
from kvtool.store.io import buffer_address
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
EARLY_READS = 2
"""A load's first reads go to the engine on their own, before the others are prepared:
over NVMe/TCP the target works on them while the host prepares the rest (measured with
33 blocks of 32 KiB: the first command left 160-200 µs after the load began when all
went at once)."""
WRITE_STAGING_BYTES = 64 << 20
"""Staging buffers for writes grow up to this many bytes (at least ``write_qd`` of them)
so a request's blocks go to the engine in one batch."""


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
        self._async_reads = bool(getattr(engine, "item_callbacks", False))
        """The engine completes reads on threads of its own (:mod:`kvtool.store.io`)."""
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
        self._owned = [AlignedBuffer(self.padded) for _ in range(self.read_qd + self.write_qd)]
        """The read_qd read staging buffers, then the write staging buffers (write_qd at
        first; more, up to ``_wcap``, while a request stores more blocks than are free)."""
        for ab in self._owned[self.read_qd:]:
            self._wstage.put(ab)
        self._wcap = max(self.write_qd, WRITE_STAGING_BYTES // self.padded)
        self._rstage = [np.frombuffer(ab.view, dtype=np.uint8)
                        for ab in self._owned[:self.read_qd]]
        self._rviews = [ab.view for ab in self._owned[:self.read_qd]]
        self._crc_of: dict[int, int | tuple[Future[list[int]], int]] = {
            key: int(store.entries[slot]["data_crc"]) for key, slot in self.slot_of.items()}
        """Each held key's CRC32C: of the bytes staged for its latest write (durable
        mode), else (a batch's CRCs, its position) taken once that batch completed."""
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
            self._wait_one(fut, "write")

    # ------------------------------------------------------------------ loads
    def _direct(self, dst: np.ndarray) -> memoryview | None:
        """``dst`` itself as the read buffer when the engine can read into it (a row of
        whole LBAs, contiguous, writable, aligned as the engine needs): no staging and no
        copy. None: the read goes through a staging buffer."""
        if (self.padded != self.block_bytes or dst.ndim != 1 or dst.dtype != np.uint8
                or dst.nbytes != self.padded or not dst.flags.c_contiguous
                or not dst.flags.writeable):
            return None
        view = memoryview(dst)  # type: ignore[arg-type]
        align = self.engine.mem_align
        if align > 1 and buffer_address(view) % align:
            return None
        return view

    def prepare_load(self, keys: Sequence[int], dsts: Sequence[np.ndarray], *,
                     checksum: bool = False) -> TransferJob:
        self._alive()
        job = TransferJob(list(keys), [False] * len(keys))
        todo = []
        slot_of, pending = self.slot_of, self._pending
        for i, key in enumerate(keys):
            slot = slot_of.get(key)
            if slot is None:
                continue
            if pending and key in pending:
                self._settle(key)
            todo.append((i, slot))
        job.nbytes = len(todo) * self.block_bytes
        if checksum and self._async_reads:
            job.crcs = [None] * len(keys)
        # One load at a time per tier (the staging buffers are the tier's): the caller
        # completes a load before it prepares the next. Every read goes to the engine at
        # once (it queues what its queue depth has no room for), straight into the
        # caller's rows where they qualify, else through the read_qd staging buffers
        # (more than read_qd of those: in further batches).
        later: deque[tuple[int, int]] = deque(todo)
        free = list(range(self.read_qd))
        futs, staged = self._read_batch(later, dsts, free, job.crcs)
        job.state = (futs, staged, later, list(dsts), free, [i for i, _slot in todo])
        return job

    def _read_batch(self, todo: deque[tuple[int, int]], dsts: Sequence[np.ndarray],
                    free: list[int], crcs: list[int | None] | None
                    ) -> tuple[list[Future[None]], list[tuple[int, int]]]:
        """Submit the reads of ``todo`` that have a buffer (all direct ones, staged ones
        while ``free`` lasts); the rest stay in ``todo``. The first :data:`EARLY_READS`
        go to an engine that completes reads on threads of its own (NVMe/TCP) before the
        others are prepared, so the target starts on them meanwhile (an engine that
        completes them in its submit call, native AIO on a file, gets one batch).
        Returns the batches' futures and the staged reads (position, staging buffer).
        ``crcs``: each block's CRC32C is put at its position as it arrives."""
        items: list[tuple[int, memoryview]] = []
        arrived: list[tuple[int, np.ndarray]] = []  # per item: position, its bytes
        staged: list[tuple[int, int]] = []
        keep: list[tuple[int, int]] = []
        futs: list[Future[None]] = []
        n = self.block_bytes
        early = self._async_reads
        while todo:
            i, slot = todo.popleft()
            view = self._direct(dsts[i])
            if view is None:
                if not free:
                    keep.append((i, slot))
                    continue
                b = free.pop()
                staged.append((i, b))
                view = self._rviews[b]
                if crcs is not None:
                    arrived.append((i, self._rstage[b][:n]))
            elif crcs is not None:
                arrived.append((i, dsts[i]))
            items.append((self.sb.slot_offset(slot), view))
            if early and not futs and len(items) == EARLY_READS and todo:
                futs.append(self._submit_reads(items, arrived, crcs))
                items, arrived = [], []
        todo.extend(keep)
        if items:
            try:
                futs.append(self._submit_reads(items, arrived, crcs))
            except TierError:
                self._wait_all(futs)  # the early reads land in the caller's rows first
                raise
        return futs, staged

    def _submit_reads(self, items: list[tuple[int, memoryview]],
                      arrived: list[tuple[int, np.ndarray]],
                      crcs: list[int | None] | None) -> Future[None]:
        on_item: Callable[[int], None] | None = None
        if crcs is not None:
            def on_item(k: int) -> None:  # on the engine's thread, as read k arrives
                i, block = arrived[k]
                crcs[i] = crc32c(block)
        try:
            return submit_batch(self.engine, items, on_caller=self.durable, on_item=on_item)
        except Exception as exc:
            raise self._error(exc) from None

    def complete_load(self, job: TransferJob) -> list[bool]:
        self._alive()
        futs, staged, later, dsts, free, read = job.state
        n = self.block_bytes
        while True:
            self._wait_all(futs)
            for i, b in staged:
                np.copyto(dsts[i], self._rstage[b][:n])
                free.append(b)
            if not later:
                break
            futs, staged = self._read_batch(later, dsts, free, job.crcs)
        for i in read:
            job.ok[i] = True
        return job.ok

    def _wait_all(self, futs: list[Future[None]]) -> None:
        """Wait for every batch of a load (none is left writing into the caller's rows),
        then raise the first failure."""
        first: TierError | None = None
        for fut in futs:
            try:
                self._wait_one(fut, "read")
            except TierError as err:
                first = first or err
        if first is not None:
            raise first

    def _wait_one(self, fut: Future[None], what: str) -> None:
        """Wait for one batch's future; its failure (or a timeout) fails the tier. An
        engine that can complete requests on the caller's thread does so first."""
        reap = getattr(self.engine, "reap", None)
        if reap is not None and not fut.done():
            try:
                reap()
            except Exception as err:
                raise self._error(err) from None
        try:
            exc = fut.exception(timeout=IO_TIMEOUT_S)
        except TimeoutError:
            raise self._error(TimeoutError(f"a {what} did not complete in "
                                           f"{IO_TIMEOUT_S:.0f} s")) from None
        if exc is not None:
            raise self._error(exc)

    # ------------------------------------------------------------------ stores
    def _stage_buffer(self) -> AlignedBuffer | None:
        """A free staging buffer, a new one while fewer than the cap exist, else None."""
        try:
            return self._wstage.get_nowait()
        except queue.Empty:
            pass
        if len(self._owned) - self.read_qd < self._wcap:
            ab = AlignedBuffer(self.padded)
            self._owned.append(ab)
            return ab
        return None

    def prepare_store(self, keys: Sequence[int], srcs: Sequence[np.ndarray], *,
                      crcs: Sequence[int] | None = None) -> TransferJob:
        """Stage every block (the caller's rows are free again on return) and write them
        in as few batches as the staging buffers allow (one, mostly): one future per
        batch, completed in the background. ``crcs``: the CRC32C of each source block,
        taken by the caller (the data mover, which checks later loads against it): the
        index records it rather than a second pass over the staged copy."""
        self._alive()
        job = TransferJob(list(keys), [])
        job.state = []
        n = self.block_bytes
        group: list[tuple[int, int, AlignedBuffer, int | None]] = []
        grouped: set[int] = set()
        try:
            for pos, (key, src) in enumerate(zip(keys, srcs, strict=True)):
                if key in grouped:  # the same key again: its earlier version goes first
                    self._write_group(group, job)
                    grouped.clear()
                if self.durable:
                    slot = self._durable_slot(key)
                else:
                    held = self.slot_of.get(key)
                    if held is None:
                        if not self._free:
                            raise RuntimeError(f"{self.name} tier: all {self.slots} slots in "
                                               "use (the engine sized it too small)")
                        slot = self._free.popleft()
                    else:
                        slot = held
                        self._settle(key)
                ab = self._stage_buffer()
                if ab is None:
                    # every staging buffer is taken: send what is staged, wait for one back
                    self._write_group(group, job)
                    grouped.clear()
                    self._await_buffer()
                    try:
                        ab = self._wstage.get(timeout=IO_TIMEOUT_S)
                    except queue.Empty:
                        self._unclaim(slot)
                        raise self._error(TimeoutError(f"writes did not complete in "
                                                       f"{IO_TIMEOUT_S:.0f} s")) from None
                staged = np.frombuffer(ab.view, dtype=np.uint8, count=n)
                np.copyto(staged, src)
                # durable mode commits every step: the CRC of the staged bytes is taken
                # here, while they are in cache, instead of on the CRC thread after the
                # write
                crc = crcs[pos] if crcs is not None else (
                    crc32c(staged) if self.durable else None)
                group.append((key, slot, ab, crc))
                grouped.add(key)
        except BaseException:
            # what was staged before the failure is written and recorded, as if stored
            # one by one (unless the medium itself failed)
            if group and self.dead is None:
                with contextlib.suppress(TierError):
                    self._write_group(group, job)
            raise
        self._write_group(group, job)
        return job

    def _await_buffer(self) -> None:
        """Wait for writes in flight, oldest first, until one has handed its staging
        buffer back (waiting on their futures: in durable mode the waiting thread takes
        the completions itself)."""
        for fut in list(dict.fromkeys(self._pending.values())):
            if not self._wstage.empty():
                return
            with contextlib.suppress(Exception):  # a failure is the commit's to report
                fut.exception(timeout=IO_TIMEOUT_S)

    def _unclaim(self, slot: int) -> None:
        if self.durable:
            self.store.release(slot)
        else:
            self._free.appendleft(slot)

    def _write_group(self, group: list[tuple[int, int, AlignedBuffer, int | None]],
                     job: TransferJob) -> None:
        """Submit the staged writes of ``group`` as one batch and record them; ``group``
        is emptied either way."""
        if not group:
            return
        n = self.block_bytes
        try:
            fut = submit_batch(self.engine, [(self.sb.slot_offset(slot), ab.view)
                                             for _k, slot, ab, _c in group], write=True,
                               on_caller=self.durable)
        except Exception as exc:
            for _k, slot, ab, _c in group:
                self._wstage.put(ab)
                self._unclaim(slot)
            group.clear()
            raise self._error(exc) from None
        bufs = [ab for _k, _s, ab, _c in group]
        if self.durable:
            fut.add_done_callback(self._returner(bufs))
        else:
            crcs: Future[list[int]] = Future()
            fut.add_done_callback(self._checksummer(bufs, n, crcs))
        for j, (key, slot, _ab, crc) in enumerate(group):
            self._crc_of[key] = crc if crc is not None else (crcs, j)
            self.slot_of[key] = slot
            if self.durable:
                self._uncommitted[key] = slot
            self._pending[key] = fut
            job.state.append((key, fut))
            job.ok.append(True)
            job.nbytes += n
        job.futures.append(fut)
        group.clear()

    def _returner(self, bufs: list[AlignedBuffer]) -> Callable[[Future[None]], None]:
        """A done-callback handing a batch's staging buffers back once its writes are
        done."""
        def done(_f: Future[None]) -> None:
            for ab in bufs:
                self._wstage.put(ab)
        return done

    def _checksummer(self, bufs: list[AlignedBuffer], n: int,
                     crcs: Future[list[int]]) -> Callable[[Future[None]], None]:
        """A done-callback that has the written bytes' CRC32Cs taken on the CRC thread (not
        the engine's completion thread, which reads wait on), then hands the staging
        buffers back for the next writes."""
        def checksum(f: Future[None]) -> None:
            try:
                exc = f.exception()
                if exc is None:
                    crcs.set_result([crc32c(np.frombuffer(ab.view, dtype=np.uint8, count=n))
                                     for ab in bufs])
                else:
                    crcs.set_exception(exc)
            except BaseException as err:  # the commit must see it, not a logger
                if not crcs.done():
                    crcs.set_exception(err)
            finally:
                for ab in bufs:
                    self._wstage.put(ab)

        def done(f: Future[None]) -> None:
            try:
                self._crc_pool.submit(checksum, f)
            except RuntimeError as exc:  # closed: nothing will commit these writes
                crcs.set_exception(exc)
                for ab in bufs:
                    self._wstage.put(ab)
        return done

    def _crc(self, key: int) -> int:
        """The CRC32C of ``key``'s latest write (waiting for the CRC thread's)."""
        got = self._crc_of[key]
        if isinstance(got, int):
            return got
        fut, j = got
        try:
            return fut.result(timeout=IO_TIMEOUT_S)[j]
        except Exception as exc:
            raise self._error(exc) from None

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
        for fut in job.futures:
            self._wait_one(fut, "write")
        for key, fut in job.state:
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
            crc = self._crc(key)
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
            crc = self._crc(key)
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
