"""The I/O engine interface every KV-object-store backend implements, and its building blocks
(aligned buffers, the extent check, a thread-pool base). A leaf: engines import it;
:mod:`kvtool.store.engine` picks an engine for a target.

An :class:`IOEngine` is a byte-addressed window onto one namespace (a block device, a
regular file opened with ``O_DIRECT``, or an NVMe/TCP namespace). It moves whole logical
blocks between the namespace and caller-owned memory and nothing else: no caching, no
read-modify-write, no bounce buffering (that is :mod:`kvtool.store.bounce`'s job).

Alignment contract (every engine enforces it and raises :class:`ValueError` otherwise)
------------------------------------------------------------------------------------
* ``offset`` and ``len(buf)`` are multiples of ``lba_size`` and ``offset + len(buf) <= size``.
* ``buf`` is a C-contiguous, 1-D byte :class:`memoryview` (format ``B``) whose start address
  is a multiple of ``mem_align``. :class:`AlignedBuffer` (anonymous ``mmap``, page aligned)
  always qualifies, and slicing its view at multiples of 4096 keeps the alignment.
  For writes the view may be read-only; for reads it must be writable.
* There is no upper bound on ``len(buf)``: an engine whose transport has a transfer limit
  (NVMe MDTS, MAXH2CDATA) splits the request itself and completes it as a whole.

Completion and durability
-------------------------
* ``read_into``/``write_from`` block until the whole transfer is done and raise
  :class:`OSError` on failure (a partial transfer is a failure). They are thread-safe:
  kvtool calls them concurrently from several threads, and calls ``submit_*`` from
  threads other than the one that opened the engine (including from the done-callbacks
  of earlier futures, so ``submit_*`` must not block waiting for those callbacks).
* ``submit_read``/``submit_write`` start the same operation asynchronously and return a
  :class:`concurrent.futures.Future` resolving to ``None`` (or raising the ``OSError``).
  At most ``qd`` operations run at once; further submissions queue. The caller must keep
  ``buf`` alive and untouched until the future is done. Completion order is unspecified.
* A completed write is visible to later reads through any engine but is **not durable**
  until a later :meth:`IOEngine.flush` returns: ``flush`` is the barrier that makes every
  write completed before the call started durable (``fdatasync`` for a file or block
  device, an NVMe Flush command for NVMe/TCP). Nothing about the order in which
  un-flushed writes reach the medium may be assumed.
* ``close`` waits for submitted operations, then releases the namespace. Engines are
  context managers.
* Optionally, ``submit_reads``/``submit_writes`` take several ``(offset, buf)`` at once
  and return one future, resolved once every one of them has completed (never earlier,
  even after a failure) and raising the first failure. :func:`submit_batch` calls them,
  or combines ``submit_*`` futures for an engine without them. A burst of requests then
  costs one completion hand-off (and, for native AIO, one ``io_submit`` per batch).
* Optionally too, an engine whose completions arrive on threads of its own declares
  ``item_callbacks = True`` and takes ``on_item`` there: ``on_item(i)`` runs on the
  completing thread once item ``i`` has completed successfully, before the batch's
  future resolves, so the caller can work on the items that have arrived (checksum
  them) while the others are in flight. It must be quick and must not raise or submit;
  an item whose completion went another way (a retry after a reconnect) gets no call.

An NVMe/TCP engine (``kvtool.nvme.engine.open_nvme_tcp``) implements the same protocol;
it may spread submissions over several I/O queues as long as the rules above hold.
"""

from __future__ import annotations

import ctypes
import mmap
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from types import TracebackType
from typing import Any, Protocol, runtime_checkable

import numpy as np

from kvtool.errors import UsageError

PAGE_SIZE = mmap.PAGESIZE
DEFAULT_QD = 8


@runtime_checkable
class IOEngine(Protocol):
    """One namespace, read and written in whole logical blocks (see the module docstring)."""

    #: Namespace capacity in bytes (a multiple of ``lba_size``).
    size: int
    #: Logical block size in bytes (512 or 4096 for NVMe): the offset/length granule.
    lba_size: int
    #: Required buffer address alignment in bytes (a power of two, at most the page size).
    mem_align: int
    #: Maximum operations in flight (submissions beyond it queue).
    qd: int
    #: False when opened read-only: writes raise :class:`PermissionError`.
    writable: bool

    def read_into(self, offset: int, buf: memoryview) -> None: ...

    def write_from(self, offset: int, buf: memoryview) -> None: ...

    def submit_read(self, offset: int, buf: memoryview) -> Future[None]: ...

    def submit_write(self, offset: int, buf: memoryview) -> Future[None]: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...

    def describe(self) -> dict[str, Any]:
        """A JSON-able description: at least ``kind`` and ``target``."""
        ...


class AlignedBuffer:
    """Page-aligned memory from an anonymous ``mmap``; ``view`` is its byte memoryview.

    ``bytearray`` and ``bytes`` are not aligned, and ``O_DIRECT`` rejects them (EINVAL).
    """

    def __init__(self, nbytes: int) -> None:
        if nbytes <= 0:
            raise ValueError(f"buffer size must be positive, got {nbytes}")
        self.nbytes = nbytes
        self._map = mmap.mmap(-1, -(-nbytes // PAGE_SIZE) * PAGE_SIZE)
        self.view = memoryview(self._map)[:nbytes]

    def close(self) -> None:
        """Unmap now, or (while numpy arrays or slices still export it) when they are gone."""
        try:
            self.view.release()
            self._map.close()
        except BufferError:
            pass


def buffer_address(buf: memoryview) -> int:
    """Start address of a byte memoryview (read-only views included)."""
    if not buf.nbytes:
        return 0
    try:  # a writable buffer: a tenth of numpy's cost (this runs for every request)
        return ctypes.addressof(ctypes.c_char.from_buffer(buf))
    except (TypeError, ValueError, BufferError):  # read-only (or not contiguous)
        return int(np.frombuffer(buf, dtype=np.uint8).__array_interface__["data"][0])


def submit_batch(engine: IOEngine, items: Sequence[tuple[int, memoryview]], *,
                 write: bool = False, on_caller: bool = False,
                 on_item: Callable[[int], None] | None = None) -> Future[None]:
    """Start a read (or ``write``) of every ``(offset, buf)`` of ``items``; one future for
    all of them (see the module docstring): the engine's ``submit_reads``/``submit_writes``
    when it has them, else its ``submit_*`` futures combined. ``on_caller``: the caller
    waits for this future itself, soon (``result``/``exception``, never only a callback):
    an engine that can then complete the batch on the waiting thread does (the O_DIRECT
    engine with native AIO). ``on_item``: passed on to an engine with ``item_callbacks``
    (see the module docstring), ignored by the others: the caller cannot count on it."""
    many = getattr(engine, "submit_writes" if write else "submit_reads", None)
    if many is not None:
        kw: dict[str, Any] = {}
        if on_caller and getattr(engine, "reap", None) is not None:
            kw["on_caller"] = True
        if on_item is not None and getattr(engine, "item_callbacks", False):
            kw["on_item"] = on_item
        fut: Future[None] = many(items, **kw)
        return fut
    one = engine.submit_write if write else engine.submit_read
    return combine([one(offset, buf) for offset, buf in items])


class Countdown:
    """``n`` operations behind one future (:attr:`fut`): each calls :meth:`settle` once,
    with its error or ``None``; the future resolves when the last one has, raising the
    first failure seen (thread-safe: completions arrive on any thread)."""

    __slots__ = ("_first", "_left", "_lock", "fut")

    def __init__(self, n: int) -> None:
        self.fut: Future[None] = Future()
        self._lock = threading.Lock()
        self._left = n
        self._first: BaseException | None = None
        if n == 0:
            self.fut.set_result(None)

    def settle(self, err: BaseException | None) -> None:
        with self._lock:
            if err is not None and self._first is None:
                self._first = err
            self._left -= 1
            if self._left:
                return
        if self._first is not None:
            self.fut.set_exception(self._first)
        else:
            self.fut.set_result(None)


def combine(futures: Sequence[Future[None]]) -> Future[None]:
    """One future for ``futures``: done once all are, with the first failure seen."""
    count = Countdown(len(futures))
    for f in futures:
        f.add_done_callback(lambda f: count.settle(f.exception()))
    return count.fut


def check_extent(offset: int, nbytes: int, lba_size: int, size: int) -> None:
    """Raise ValueError unless the extent is whole logical blocks inside the namespace."""
    if offset < 0 or offset % lba_size or nbytes % lba_size:
        raise ValueError(f"I/O at offset {offset} of {nbytes} bytes is not a multiple of the "
                         f"{lba_size}-byte logical block")
    if offset + nbytes > size:
        raise ValueError(f"I/O at offset {offset} of {nbytes} bytes ends past the namespace "
                         f"({size} bytes)")


class ThreadedEngine:
    """Base class: ``submit_*`` run the blocking calls on a pool of ``qd`` threads.

    Subclasses implement ``read_into``/``write_from``/``flush``/``_release`` and set the
    attributes of :class:`IOEngine`. Blocking calls must release the GIL (``os.preadv``
    does), so ``qd`` threads really keep ``qd`` operations in flight.
    """

    size: int
    lba_size: int
    mem_align: int
    qd: int
    writable: bool

    def __init__(self, qd: int) -> None:
        if qd < 1:
            raise UsageError(f"queue depth must be at least 1, got {qd}", field="qd")
        self.qd = qd
        self._pool: ThreadPoolExecutor | None = None

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=self.qd, thread_name_prefix="kvtool-io")
        return self._pool

    def read_into(self, offset: int, buf: memoryview) -> None:
        raise NotImplementedError

    def write_from(self, offset: int, buf: memoryview) -> None:
        raise NotImplementedError

    def submit_read(self, offset: int, buf: memoryview) -> Future[None]:
        return self._executor().submit(self.read_into, offset, buf)

    def submit_write(self, offset: int, buf: memoryview) -> Future[None]:
        return self._executor().submit(self.write_from, offset, buf)

    def check(self, offset: int, buf: memoryview) -> None:
        """Raise ValueError unless (offset, buf) obeys the alignment contract."""
        n = buf.nbytes
        check_extent(offset, n, self.lba_size, self.size)
        if n and buffer_address(buf) % self.mem_align:
            raise ValueError(f"buffer at {buffer_address(buf):#x} is not aligned to "
                             f"{self.mem_align} bytes (use AlignedBuffer)")

    def flush(self) -> None:
        raise NotImplementedError

    def _release(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._release()

    def __enter__(self) -> ThreadedEngine:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
