"""Linux native AIO (``io_submit``/``io_getevents``) through ctypes: the submission path
of the O_DIRECT engine.

Why: a pool of threads each blocked in ``preadv``/``pwritev`` reached only 0.75–0.9 of
fio's throughput on this project's loop devices (every completion has to wake a thread and
win the GIL back before the next request of that thread can start). Submitting from one
place and reaping completions in batches is what fio's libaio engine does; from Python it
matched fio (BENCHMARKS.md, "KV object store"). It needs no library: the four syscalls
are called through ``ctypes``, which releases the GIL while they run.

Requests beyond ``qd`` wait in a queue and are submitted as earlier ones complete.
Completions are delivered on one reaper thread, which runs the futures' callbacks.
Requests submitted together (:meth:`AioQueue.submit_many`) go to the kernel several per
``io_submit`` and complete as one future: on a busy two-core machine each ctypes syscall
and each completion hand-off to another thread costs tens of microseconds, more than a
32 KiB transfer itself (BENCHMARKS.md, issue 36).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import platform
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np

from kvtool.store.io import buffer_address

# x86_64 and aarch64 (asm-generic) syscall numbers.
_NR = {"x86_64": (206, 207, 209, 208), "amd64": (206, 207, 209, 208),
       "aarch64": (0, 1, 2, 4), "arm64": (0, 1, 2, 4)}
IOCB_CMD_PREAD, IOCB_CMD_PWRITE = 0, 1
_REAP_TIMEOUT_NS = 50_000_000  # the reaper looks at its stop flag this often when idle


class _Iocb(ctypes.Structure):
    _fields_ = [("aio_data", ctypes.c_uint64), ("aio_key", ctypes.c_uint32),
                ("aio_rw_flags", ctypes.c_int32), ("aio_lio_opcode", ctypes.c_uint16),
                ("aio_reqprio", ctypes.c_int16), ("aio_fildes", ctypes.c_uint32),
                ("aio_buf", ctypes.c_uint64), ("aio_nbytes", ctypes.c_uint64),
                ("aio_offset", ctypes.c_int64), ("aio_reserved2", ctypes.c_uint64),
                ("aio_flags", ctypes.c_uint32), ("aio_resfd", ctypes.c_uint32)]


class _Event(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64), ("obj", ctypes.c_uint64), ("res", ctypes.c_int64),
                ("res2", ctypes.c_int64)]


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_IOCB_DTYPE = np.dtype([("aio_data", "<u8"), ("aio_key", "<u4"), ("aio_rw_flags", "<i4"),
                        ("aio_lio_opcode", "<u2"), ("aio_reqprio", "<i2"),
                        ("aio_fildes", "<u4"), ("aio_buf", "<u8"), ("aio_nbytes", "<u8"),
                        ("aio_offset", "<i8"), ("aio_reserved2", "<u8"), ("aio_flags", "<u4"),
                        ("aio_resfd", "<u4")])
"""``_Iocb`` as a numpy record (little-endian: the architectures of ``_NR``)."""
_EVENT_DTYPE = np.dtype([("data", "<u8"), ("obj", "<u8"), ("res", "<i8"), ("res2", "<i8")])
assert _IOCB_DTYPE.itemsize == ctypes.sizeof(_Iocb) == 64
assert [f for f, *_ in _Iocb._fields_] == list(_IOCB_DTYPE.names or ())
assert _EVENT_DTYPE.itemsize == ctypes.sizeof(_Event) == 32

_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long


class AioUnavailable(OSError):
    """Native AIO cannot be used here (unknown architecture, io_setup refused)."""


class _CallerFuture(Future[None]):
    """The future of a batch on a queue without a reaper thread: waiting for it (result,
    exception) takes the queue's completions on the waiting thread."""

    def __init__(self, queue: AioQueue) -> None:
        super().__init__()
        self._queue = queue

    def _drive(self, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.done():
            left = _REAP_TIMEOUT_NS / 1e9 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                return
            self._queue.reap(wait=min(left, _REAP_TIMEOUT_NS / 1e9))

    def result(self, timeout: float | None = None) -> None:
        self._drive(timeout)  # done, or the timeout has passed
        return super().result(0)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._drive(timeout)
        return super().exception(0)


class _Batch:
    """Requests submitted together: one future, resolved once every one of them has
    completed (its exception: the first failure seen, in completion order)."""

    __slots__ = ("error", "fut", "left")

    def __init__(self, n: int, queue: AioQueue | None = None) -> None:
        self.fut: Future[None] = Future() if queue is None else _CallerFuture(queue)
        self.left = n
        self.error: OSError | None = None

    def settle(self, err: OSError | None) -> bool:
        """One request is done (lock held); True when it was the last one."""
        if err is not None and self.error is None:
            self.error = err
        self.left -= 1
        return self.left == 0

    def resolve(self) -> None:
        if self.error is None:
            self.fut.set_result(None)
        else:
            self.fut.set_exception(self.error)


class AioQueue:
    """One AIO context on one O_DIRECT file descriptor with at most ``qd`` requests in
    flight. ``submit`` and ``submit_many`` are thread-safe and never block on the device.

    ``submit_many`` hands the kernel several requests per ``io_submit`` (one syscall for
    as many as the queue depth has room for; the rest follow, again in batches, as
    earlier ones complete) and resolves one future for all of them, so a burst of
    requests costs one completion hand-off instead of one per request.
    """

    def __init__(self, fd: int, qd: int, *, reaper: bool = True) -> None:
        """``reaper`` False: no reaper thread; the thread that waits for a future (its
        ``result`` or ``exception``) or calls :meth:`reap` takes the completions. On a
        busy machine every hand-off between two threads costs the GIL and a wake-up,
        often more than a small transfer itself: a caller that waits for its own batch
        right away (a load; a store committed in the same step) is better off without."""
        nr = _NR.get(platform.machine())
        if nr is None:
            raise AioUnavailable(errno.ENOSYS, f"no AIO syscall numbers for {platform.machine()}")
        self._setup, self._destroy, self._submit, self._getevents = nr
        self.fd = fd
        self.qd = qd
        self._ctx = ctypes.c_ulong(0)
        if _syscall(self._setup, ctypes.c_uint(qd), ctypes.byref(self._ctx)) != 0:
            err = ctypes.get_errno()
            raise AioUnavailable(err, f"io_setup: {os.strerror(err)}")
        self._lock = threading.Lock()
        self._inflight: dict[int, tuple[Any, _Batch, int, memoryview]] = {}
        self._waiting: deque[tuple[int, int, int, int, _Batch, memoryview]] = deque()
        self._token = 0
        self._stop = False
        self._destroyed = False
        self._reaper: threading.Thread | None = None
        if reaper:
            self._reaper = threading.Thread(target=self._reap, name="kvtool-aio", daemon=True)
            self._reaper.start()

    def submit(self, op: int, offset: int, buf: memoryview) -> Future[None]:
        return self.submit_many(op, [(offset, buf)])

    def submit_many(self, op: int, items: Sequence[tuple[int, memoryview]]) -> Future[None]:
        """Start ``op`` for every ``(offset, buffer)``; the future resolves once all of
        them have completed (never earlier, even after a failure: the buffers are the
        kernel's until then) and raises the first failure (OSError)."""
        batch = _Batch(len(items), None if self._reaper is not None else self)
        if not items:
            batch.resolve()
            return batch.fut
        reqs = [(op, offset, buffer_address(buf), buf.nbytes, batch, buf)
                for offset, buf in items]
        with self._lock:
            room = self.qd - len(self._inflight)
            if self._waiting or room <= 0:
                self._waiting.extend(reqs)
                return batch.fut
            self._waiting.extend(reqs[room:])
            done = self._start(reqs[:room])
        for b in done:
            b.resolve()
        return batch.fut

    def _io_submit(self, ptrs: int, n: int) -> int:
        """``io_submit`` of the ``n`` iocbs whose addresses are at ``ptrs``: how many the
        kernel took, or ``-errno``."""
        r = int(_syscall(self._submit, self._ctx, ctypes.c_long(n), ctypes.c_void_p(ptrs)))
        return r if r >= 0 else -ctypes.get_errno()

    def _start(self, reqs: Sequence[tuple[int, int, int, int, _Batch, memoryview]]
               ) -> list[_Batch]:
        """io_submit ``reqs`` (lock held), as many per call as the kernel takes. A request
        the kernel refuses fails alone (its batch records the error); returns the batches
        that thereby completed, to be resolved once the lock is released."""
        n = len(reqs)
        # the iocbs as one numpy array, filled a column at a time (not a ctypes structure
        # and seven attribute writes per request)
        cbs = np.zeros(n, dtype=_IOCB_DTYPE)
        first = self._token + 1
        self._token += n
        cbs["aio_data"] = np.arange(first, first + n, dtype=np.uint64)
        cbs["aio_lio_opcode"] = [r[0] for r in reqs]
        cbs["aio_fildes"] = self.fd
        cbs["aio_offset"] = [r[1] for r in reqs]
        cbs["aio_buf"] = [r[2] for r in reqs]
        cbs["aio_nbytes"] = [r[3] for r in reqs]
        base = ctypes.addressof(ctypes.c_char.from_buffer(cbs))  # type: ignore[arg-type]
        ptrs = np.arange(n, dtype=np.uint64) * np.uint64(_IOCB_DTYPE.itemsize) + np.uint64(base)
        at = ctypes.addressof(ctypes.c_char.from_buffer(ptrs))  # type: ignore[arg-type]
        done: list[_Batch] = []
        k = 0
        while k < n:
            r = self._io_submit(at + k * 8, n - k)
            if r in (-errno.EINTR, -errno.EAGAIN):
                continue
            if r <= 0:  # the k-th iocb was refused: it fails, the rest are tried again
                err = -r if r < 0 else errno.EIO
                if reqs[k][4].settle(OSError(err, f"io_submit: {os.strerror(err)}")):
                    done.append(reqs[k][4])
                k += 1
                continue
            for j in range(k, k + r):
                # the iocbs and the buffer stay referenced until the request completes
                self._inflight[first + j] = (cbs, reqs[j][4], reqs[j][3], reqs[j][5])
            k += r
        del ptrs  # (the kernel has copied the iocbs' addresses; the iocbs stay referenced)
        return done

    def reap(self, wait: float = 0.0) -> None:
        """Take the completions that have arrived on this thread (one ``io_getevents``;
        ``wait``: for at most that many seconds until one has). A caller about to wait
        for a batch calls it first: on a medium that completes requests inside
        ``io_submit`` (tmpfs, the page cache) the batch is then done without a hand-off
        to the reaper thread."""
        if self._destroyed:
            return
        events = (_Event * self.qd)()
        ns = int(wait * 1e9)
        until = _Timespec(ns // 1_000_000_000, ns % 1_000_000_000)
        n = _syscall(self._getevents, self._ctx, ctypes.c_long(1 if wait > 0 else 0),
                     ctypes.c_long(self.qd), events, ctypes.byref(until))
        if n > 0:
            done, _idle = self._consume(events, n)
            for batch in done:
                batch.resolve()

    def _consume(self, events: Any, n: int) -> tuple[list[_Batch], bool]:
        """Settle ``n`` completion events and start waiting requests in the room they
        made; returns the batches now complete (to resolve without the lock) and whether
        nothing is in flight or waiting."""
        done: list[_Batch] = []
        got = np.frombuffer(events, dtype=_EVENT_DTYPE, count=n)
        with self._lock:
            for data, res in zip(got["data"].tolist(), got["res"].tolist(), strict=True):
                item = self._inflight.pop(data, None)
                if item is None:
                    # a Ctrl-C landed between io_submit and recording the request: its
                    # submitter already gave up on it, so nobody waits for this completion
                    continue
                _, batch, nbytes, _ = item
                if res == nbytes:
                    err = None
                elif res < 0:
                    err = OSError(-res, os.strerror(-res))
                else:
                    err = OSError(errno.EIO, f"short transfer: {res} of {nbytes} bytes")
                if batch.settle(err):
                    done.append(batch)
            room = self.qd - len(self._inflight)
            if self._waiting and room > 0:
                reqs = [self._waiting.popleft() for _ in range(min(room, len(self._waiting)))]
                done += self._start(reqs)
            idle = not self._inflight and not self._waiting
        return done, idle

    def _reap(self) -> None:
        events = (_Event * self.qd)()
        timeout = _Timespec(0, _REAP_TIMEOUT_NS)
        while True:
            n = _syscall(self._getevents, self._ctx, ctypes.c_long(1), ctypes.c_long(self.qd),
                         events, ctypes.byref(timeout))
            if n < 0:
                if ctypes.get_errno() == errno.EINTR:
                    continue
                if self._stop and self._destroyed:
                    return  # close() destroyed the context to wake us: nothing is in flight
                n = 0
            done, idle = self._consume(events, n)
            for batch in done:
                batch.resolve()
            if self._stop and idle:
                return

    def close(self) -> None:
        """Wait for every request, then destroy the context.

        Destroying the context wakes the reaper from ``io_getevents`` at once (the kernel's
        kill_ioctx wakes its waiters), so closing costs no reaper timeout. ``io_destroy``
        itself then waits for an RCU grace period (tens of ms) with nothing left to do:
        that wait runs on a daemon thread instead of delaying the command's exit.
        """
        self._stop = True
        with self._lock:
            pending = [item[1].fut for item in self._inflight.values()]
            pending += [w[4].fut for w in self._waiting]
        for fut in pending:
            with contextlib.suppress(Exception):
                fut.exception()  # wait; the owner of the future sees the outcome
        self._destroyed = True
        threading.Thread(target=_syscall, args=(self._destroy, self._ctx),
                         name="kvtool-aio-destroy", daemon=True).start()
        if self._reaper is not None:
            self._reaper.join()
