"""O_DIRECT engine on a block device or a regular file (``os.preadv``/``os.pwritev``).

Every transfer bypasses the page cache, so the kernel's alignment rules apply (open(2)
O_DIRECT, statx STATX_DIOALIGN; docs/store.md): offset and length multiples of the
logical block size, buffer address aligned to ``dio_mem_align`` (page-aligned ``mmap``
buffers always qualify).
``preadv``/``pwritev`` release the GIL, so a pool of ``qd`` threads keeps ``qd`` requests
in flight (from Python this matches io_uring: docs/store.md).
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import struct
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from kvtool.errors import UsageError, param
from kvtool.store.aio import IOCB_CMD_PREAD, IOCB_CMD_PWRITE, AioQueue, AioUnavailable
from kvtool.store.io import PAGE_SIZE, ThreadedEngine, combine

BLKROGET = 0x125E


class DirectEngine(ThreadedEngine):
    """An O_DIRECT file descriptor (see :class:`~kvtool.store.io.IOEngine`).

    Asynchronous submissions go through Linux native AIO (:mod:`kvtool.store.aio`) when
    the kernel allows it, else through the base class's pool of ``qd`` threads;
    ``submission`` ("auto", "aio", "threads") chooses. Blocking calls use
    ``preadv``/``pwritev`` directly.

    ``inline``: the medium completes a request inside the call that submits it — a file
    on tmpfs, where every transfer is a memory copy (:func:`completes_inline`). With
    ``submission`` "auto", a batch whose caller waits for it (``on_caller``) then runs as
    blocking ``preadv``/``pwritev`` calls on that thread: what ``io_submit`` would do
    there, without building iocbs and taking events (32 KiB reads: 1.8 µs against 7.7 µs
    each, BENCHMARKS.md, issue 36).
    """

    def __init__(self, path: str, fd: int, *, kind: str, size: int, lba_size: int,
                 mem_align: int, physical_block_size: int, writable: bool, qd: int,
                 submission: str = "auto", inline: bool = False) -> None:
        super().__init__(qd)
        self.inline = inline and submission == "auto"
        self.path = path
        self.fd = fd
        self.kind = kind
        self.size = size
        self.lba_size = lba_size
        self.mem_align = mem_align
        self.physical_block_size = physical_block_size
        self.writable = writable
        self._aio: AioQueue | None = None
        self._own: AioQueue | None = None
        """Batches whose waiter takes the completions (``on_caller``), made when first
        asked for."""
        if submission not in ("auto", "aio", "threads"):
            raise ValueError(f"unknown submission {submission!r}")
        if submission != "threads":
            try:
                self._aio = AioQueue(fd, qd)
            except AioUnavailable:
                if submission == "aio":
                    raise
        self.submission = "aio" if self._aio is not None else "threads"

    def submit_read(self, offset: int, buf: memoryview) -> Future[None]:
        if self._aio is None:
            return super().submit_read(offset, buf)
        self.check(offset, buf)
        return self._aio.submit(IOCB_CMD_PREAD, offset, buf)

    def submit_write(self, offset: int, buf: memoryview) -> Future[None]:
        if self._aio is None:
            return super().submit_write(offset, buf)
        if not self.writable:
            raise PermissionError(errno.EBADF, f"{self.path} is open read-only")
        self.check(offset, buf)
        return self._aio.submit(IOCB_CMD_PWRITE, offset, buf)

    def reap(self) -> None:
        """Complete, on this thread, the native-AIO requests that are done (see
        :meth:`kvtool.store.aio.AioQueue.reap`); nothing with a thread pool."""
        for q in (self._aio, self._own):
            if q is not None:
                q.reap()

    def _queue(self, on_caller: bool) -> AioQueue | None:
        if not on_caller or self._aio is None:
            return self._aio
        if self._own is None:
            try:
                self._own = AioQueue(self.fd, self.qd, reaper=False)
            except AioUnavailable:
                return self._aio
        return self._own

    def submit_reads(self, items: Sequence[tuple[int, memoryview]], *,
                     on_caller: bool = False) -> Future[None]:
        """Several reads, one future (:func:`kvtool.store.io.submit_batch`): batched
        ``io_submit`` calls with native AIO. ``on_caller``: on a second AIO context
        without a reaper thread, whose completions the thread waiting for the future
        takes itself (:class:`kvtool.store.aio.AioQueue`, ``reaper=False``)."""
        if on_caller and self.inline:
            return self._at_once(os.preadv, "read", items)
        aio = self._queue(on_caller)
        if aio is None:
            return combine([ThreadedEngine.submit_read(self, o, b) for o, b in items])
        for offset, buf in items:
            self.check(offset, buf)
        return aio.submit_many(IOCB_CMD_PREAD, items)

    def submit_writes(self, items: Sequence[tuple[int, memoryview]], *,
                      on_caller: bool = False) -> Future[None]:
        """Several writes, one future (see :meth:`submit_reads`)."""
        if not self.writable:
            raise PermissionError(errno.EBADF, f"{self.path} is open read-only")
        if on_caller and self.inline:
            return self._at_once(os.pwritev, "write", items)
        aio = self._queue(on_caller)
        if aio is None:
            return combine([ThreadedEngine.submit_write(self, o, b) for o, b in items])
        for offset, buf in items:
            self.check(offset, buf)
        return aio.submit_many(IOCB_CMD_PWRITE, items)

    def _at_once(self, op: Callable[[int, list[memoryview], int], int], what: str,
                 items: Sequence[tuple[int, memoryview]]) -> Future[None]:
        """A batch on an ``inline`` medium, on this thread: every item is checked, then
        transferred in turn; the future returned is done (the first failure stops the
        batch: nothing else is in flight)."""
        for offset, buf in items:
            self.check(offset, buf)
        fut: Future[None] = Future()
        try:
            for offset, buf in items:
                self._move(op, what, offset, buf)
        except OSError as exc:
            fut.set_exception(exc)
            return fut
        fut.set_result(None)
        return fut

    @classmethod
    def open(cls, path: str, *, write: bool, qd: int, lba: int | None = None,
             create_bytes: int | None = None, submission: str = "auto") -> DirectEngine:
        """Open ``path`` with O_DIRECT; UsageError (field TARGET) for every user mistake.

        ``lba`` overrides the logical block size (a multiple of the device's, e.g. 4096 on
        a 512-byte device or file); ``create_bytes`` creates a missing regular file.
        """
        try:
            st = os.stat(path)
        except FileNotFoundError:
            if not create_bytes:
                raise UsageError(f"{path}: no such file or device (a new file needs "
                                 f"{param('create')} SIZE)", field="target") from None
            st = _create_file(path, create_bytes)
        except OSError as exc:
            raise UsageError(f"{path}: {exc.strerror}", field="target") from None
        if stat.S_ISBLK(st.st_mode):
            kind = "block"
        elif stat.S_ISREG(st.st_mode):
            kind = "file"
        else:
            raise UsageError(f"{path}: not a block device or regular file", field="target")
        flags = (os.O_RDWR if write else os.O_RDONLY) | os.O_DIRECT | os.O_CLOEXEC
        if write and kind == "block":
            flags |= os.O_EXCL  # a block device: fail if mounted or claimed by another writer
        try:
            fd = os.open(path, flags)
        except OSError as exc:
            if exc.errno == errno.EBUSY:
                raise UsageError(f"{path}: in use (mounted, or held open exclusively by "
                                 "another program)", field="target") from None
            if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM) and write:
                raise UsageError(f"{path}: read-only ({exc.strerror}); kvtool needs to write "
                                 "it", field="target") from None
            if exc.errno == errno.EINVAL:
                raise UsageError(f"{path}: this filesystem does not support O_DIRECT (tmpfs?); "
                                 "use a file on ext4/xfs or a block device",
                                 field="target") from None
            raise UsageError(f"{path}: {exc.strerror}", field="target") from None
        try:
            if write and kind == "block" and _block_read_only(fd):
                raise UsageError(f"{path}: read-only block device; kvtool needs to write it",
                                 field="target")
            limits = _probe(path)
            dev_lba = limits["lba"]
            if lba is not None:
                if lba % dev_lba or lba & (lba - 1):
                    raise UsageError(f"{lba} is not a power-of-two multiple of the device's "
                                     f"{dev_lba}-byte logical block", field="lba")
                dev_lba = lba
            size = limits["size"] // dev_lba * dev_lba
            mem_align = max(1, min(limits["mem_align"], PAGE_SIZE))
            return cls(path, fd, kind=kind, size=size, lba_size=dev_lba, mem_align=mem_align,
                       physical_block_size=max(limits["physical"], dev_lba),
                       writable=write, qd=qd, submission=submission,
                       inline=kind == "file" and completes_inline(st.st_dev))
        except BaseException:
            os.close(fd)
            raise

    def read_into(self, offset: int, buf: memoryview) -> None:
        self._transfer(os.preadv, "read", offset, buf)

    def write_from(self, offset: int, buf: memoryview) -> None:
        if not self.writable:
            raise PermissionError(errno.EBADF, f"{self.path} is open read-only")
        self._transfer(os.pwritev, "write", offset, buf)

    def _transfer(self, op: Callable[[int, list[memoryview], int], int], what: str,
                  offset: int, buf: memoryview) -> None:
        """Run ``op`` (preadv/pwritev) until all of ``buf`` is done; a zero return is EIO."""
        self.check(offset, buf)
        self._move(op, what, offset, buf)

    def _move(self, op: Callable[[int, list[memoryview], int], int], what: str,
              offset: int, buf: memoryview) -> None:
        done, n = 0, buf.nbytes
        while done < n:
            got = op(self.fd, [buf[done:]], offset + done)
            if got <= 0:
                raise OSError(errno.EIO, f"short {what} at offset {offset + done} of {self.path}")
            done += got

    def flush(self) -> None:
        os.fdatasync(self.fd)

    def _release(self) -> None:
        if self._own is not None:
            self._own.close()
            self._own = None
        if self._aio is not None:
            self._aio.close()
            self._aio = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "target": self.path, "engine": "odirect",
                "size_bytes": self.size, "lba_size": self.lba_size,
                "physical_block_size": self.physical_block_size, "mem_align": self.mem_align,
                "qd": self.qd, "submission": self.submission}


INLINE_FILESYSTEMS = ("tmpfs", "ramfs")
"""Filesystems whose reads and writes are memory copies done inside the submitting call."""


def completes_inline(dev: int) -> bool:
    """Whether the filesystem of device ``dev`` (``st_dev`` of a file on it) is one of
    :data:`INLINE_FILESYSTEMS`, from ``/proc/self/mountinfo`` (False when unreadable)."""
    want = f"{os.major(dev)}:{os.minor(dev)}"
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                fields = line.split()
                if len(fields) > 2 and fields[2] == want and " - " in line:
                    return line.split(" - ", 1)[1].split()[0] in INLINE_FILESYSTEMS
    except OSError:
        pass
    return False


def _create_file(path: str, nbytes: int) -> os.stat_result:
    """Create a regular file of ``nbytes`` with its blocks allocated (no sparse holes, so
    writes do not pay allocation and reads do not return holes for free)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise UsageError(f"{path}: cannot create ({exc.strerror})", field="target") from None
    try:
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError:
            os.ftruncate(fd, nbytes)
        return os.fstat(fd)
    finally:
        os.close(fd)


def _block_read_only(fd: int) -> bool:
    try:
        out = fcntl.ioctl(fd, BLKROGET, struct.pack("i", 0))
    except OSError:
        return False
    return bool(struct.unpack("i", out)[0])


def _probe(path: str) -> dict[str, int]:
    """Logical/physical block size, size and buffer alignment through ``kvtool.align``."""
    from kvtool.align import probe_device
    from kvtool.errors import InputError

    try:
        lim = probe_device(path)
    except InputError as exc:
        raise UsageError(exc.message, field="target") from None
    lba = int(lim.dio_offset_align or lim.logical_block_size or 512)
    lba = max(lba, int(lim.logical_block_size or 0))
    return {"lba": lba, "physical": int(lim.physical_block_size or lba),
            "size": int(lim.size_bytes), "mem_align": int(lim.dio_mem_align or PAGE_SIZE)}
