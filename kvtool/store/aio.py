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
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import platform
import threading
from collections import deque
from concurrent.futures import Future

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


_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long


class AioUnavailable(OSError):
    """Native AIO cannot be used here (unknown architecture, io_setup refused)."""


class AioQueue:
    """One AIO context on one O_DIRECT file descriptor with at most ``qd`` requests in
    flight. ``submit`` is thread-safe and never blocks on the device."""

    def __init__(self, fd: int, qd: int) -> None:
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
        self._inflight: dict[int, tuple[_Iocb, Future[None], int]] = {}
        self._waiting: deque[tuple[int, int, memoryview, Future[None]]] = deque()
        self._token = 0
        self._stop = False
        self._destroyed = False
        self._reaper = threading.Thread(target=self._reap, name="kvtool-aio", daemon=True)
        self._reaper.start()

    def submit(self, op: int, offset: int, buf: memoryview) -> Future[None]:
        fut: Future[None] = Future()
        with self._lock:
            if len(self._inflight) >= self.qd:
                self._waiting.append((op, offset, buf, fut))
                return fut
            failed = self._start(op, offset, buf, fut)
        if failed is not None:
            fut.set_exception(failed)
        return fut

    def _start(self, op: int, offset: int, buf: memoryview, fut: Future[None]) -> OSError | None:
        """io_submit one request (lock held); returns the error instead of raising."""
        cb = _Iocb()
        self._token += 1
        cb.aio_data = self._token
        cb.aio_lio_opcode = op
        cb.aio_fildes = self.fd
        cb.aio_buf = buffer_address(buf)
        cb.aio_nbytes = buf.nbytes
        cb.aio_offset = offset
        ptr = (ctypes.POINTER(_Iocb) * 1)(ctypes.pointer(cb))
        while True:
            r = _syscall(self._submit, self._ctx, ctypes.c_long(1), ptr)
            if r == 1:
                # the buffer is referenced through the future's owner; keep cb alive
                self._inflight[self._token] = (cb, fut, buf.nbytes)
                return None
            err = ctypes.get_errno()
            if err in (errno.EINTR, errno.EAGAIN):
                continue
            return OSError(err, f"io_submit: {os.strerror(err)}")

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
            done: list[tuple[Future[None], BaseException | None]] = []
            starts: list[tuple[Future[None], OSError]] = []
            with self._lock:
                for k in range(n):
                    ev = events[k]
                    item = self._inflight.pop(ev.data, None)
                    if item is None:
                        # a Ctrl-C landed between io_submit and recording the request: its
                        # submitter already gave up on it, so nobody waits for this completion
                        continue
                    _, fut, nbytes = item
                    res = ev.res
                    if res == nbytes:
                        done.append((fut, None))
                    elif res < 0:
                        done.append((fut, OSError(-res, os.strerror(-res))))
                    else:
                        done.append((fut, OSError(errno.EIO, f"short transfer: {res} of "
                                                  f"{nbytes} bytes")))
                while self._waiting and len(self._inflight) < self.qd:
                    op, offset, buf, fut = self._waiting.popleft()
                    failed = self._start(op, offset, buf, fut)
                    if failed is not None:
                        starts.append((fut, failed))
                idle = not self._inflight and not self._waiting
            for fut, exc in done:
                if exc is None:
                    fut.set_result(None)
                else:
                    fut.set_exception(exc)
            for fut, exc in starts:
                fut.set_exception(exc)
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
            pending = [f for _, f, _ in self._inflight.values()]
            pending += [w[3] for w in self._waiting]
        for fut in pending:
            with contextlib.suppress(Exception):
                fut.exception()  # wait; the owner of the future sees the outcome
        self._destroyed = True
        threading.Thread(target=_syscall, args=(self._destroy, self._ctx),
                         name="kvtool-aio-destroy", daemon=True).start()
        self._reaper.join()
