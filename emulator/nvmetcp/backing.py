"""Namespace backing stores: anonymous memory, a regular file, or a block device.

All three are byte-addressed and synchronous; the target calls them from its event loop
(page-cache and memory I/O return in microseconds). ``flush`` makes every completed write
durable (``fdatasync``) — the NVMe Flush command and a clean shutdown call it.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import stat
import threading
from pathlib import Path

from kvtool.errors import InputError
from kvtool.units import format_size, parse_size

_ZERO_CHUNK = 1 << 20


class Backing:
    """Interface of a backing store; ``size`` is in bytes."""

    size: int
    kind: str
    description: str

    def read(self, offset: int, length: int) -> bytes:
        raise NotImplementedError

    def write(self, offset: int, data: bytes | bytearray | memoryview) -> None:
        raise NotImplementedError

    def view(self, offset: int, length: int) -> memoryview | None:
        """A writable view of the backing's own memory, or None (then use write())."""
        return None

    def flush(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def resize(self, size: int) -> None:
        """Grow or shrink to ``size`` bytes (new bytes read as zeros)."""
        raise OSError(f"a {self.kind} backing cannot be resized")

    def write_zeroes(self, offset: int, length: int) -> None:
        """Make the range read as zeros (Write Zeroes, and Deallocate, whose blocks read
        as zeros as Identify Namespace's DLFEAT promises)."""
        zeros = bytes(min(length, _ZERO_CHUNK))
        end = offset + length
        while offset < end:
            n = min(len(zeros), end - offset)
            self.write(offset, memoryview(zeros)[:n])
            offset += n


class MemoryBacking(Backing):
    """Zero-filled anonymous memory (pages are allocated on first write)."""

    kind = "memory"

    def __init__(self, size: int) -> None:
        if size <= 0:
            raise ValueError("memory backing needs a positive size")
        self.size = size
        self._map = mmap.mmap(-1, size)
        self.description = f"memory {format_size(size)}"

    def read(self, offset: int, length: int) -> bytes:
        return self._map[offset: offset + length]

    def write(self, offset: int, data: bytes | bytearray | memoryview) -> None:
        self._map[offset: offset + len(data)] = data

    def view(self, offset: int, length: int) -> memoryview:
        return memoryview(self._map)[offset: offset + length]

    def flush(self) -> None:
        return None

    def resize(self, size: int) -> None:
        try:
            self._map.resize(size)
        except BufferError:  # a command in flight holds a view of the memory
            raise OSError("namespace memory is in use by a command; retry") from None
        self.size = size
        self.description = f"memory {format_size(size)}"

    def write_zeroes(self, offset: int, length: int) -> None:
        # Whole pages go back to the kernel (they read as zeros again); edges are written.
        page = mmap.PAGESIZE
        lo = -(-offset // page) * page
        hi = (offset + length) // page * page
        if hi - lo >= page:
            self._map.madvise(mmap.MADV_REMOVE, lo, hi - lo)  # shmem: DONTNEED keeps data
            super().write_zeroes(offset, lo - offset)
            super().write_zeroes(hi, offset + length - hi)
        else:
            super().write_zeroes(offset, length)

    def close(self) -> None:
        # A connection may still hold a view; then the GC frees the memory later.
        with contextlib.suppress(BufferError):
            self._map.close()


class FileBacking(Backing):
    """A regular file or a block device, opened read-write (buffered I/O)."""

    def __init__(self, path: Path, *, create_size: int | None = None,
                 field: str = "backing", file: str | None = None) -> None:
        self.path = path
        flags = os.O_RDWR | os.O_CLOEXEC
        created = create_size is not None and not path.exists()
        if created:
            flags |= os.O_CREAT
        try:
            self._fd = os.open(path, flags, 0o600)
        except OSError as exc:
            raise InputError(f"cannot open backing {path}: {exc.strerror}",
                             file=file, field=field) from None
        st = os.fstat(self._fd)
        if stat.S_ISBLK(st.st_mode):
            self.kind = "block"
            self.size = os.lseek(self._fd, 0, os.SEEK_END)
        elif stat.S_ISREG(st.st_mode):
            self.kind = "file"
            if create_size is not None and st.st_size < create_size:
                try:
                    os.ftruncate(self._fd, create_size)
                except (OSError, OverflowError) as exc:  # beyond the file system's limit
                    os.close(self._fd)
                    if created:
                        path.unlink(missing_ok=True)
                    raise InputError(f"cannot size backing {path} to "
                                     f"{format_size(create_size)}: {_why(exc)}",
                                     file=file, field=field) from None
            self.size = os.fstat(self._fd).st_size
        else:
            os.close(self._fd)
            raise InputError(f"backing {path} is neither a regular file nor a block device",
                             file=file, field=field)
        self._lock = threading.Lock()
        self.description = f"{self.kind} {path} ({format_size(self.size)})"

    def read(self, offset: int, length: int) -> bytes:
        data = os.pread(self._fd, length, offset)
        if len(data) < length:  # a file shorter than the namespace reads as zeros
            data += bytes(length - len(data))
        return data

    def write(self, offset: int, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data)
        done = 0
        while done < len(view):
            done += os.pwrite(self._fd, view[done:], offset + done)

    def flush(self) -> None:
        os.fdatasync(self._fd)

    def resize(self, size: int) -> None:
        if self.kind != "file":
            raise OSError("a block device backing is resized with the device itself")
        os.ftruncate(self._fd, size)
        self.size = size
        self.description = f"{self.kind} {self.path} ({format_size(size)})"

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                try:
                    os.fdatasync(self._fd)
                finally:
                    os.close(self._fd)
                    self._fd = -1


def open_backing(spec: str, *, size: str | int | None = None, field: str = "backing",
                 file: str | None = None) -> Backing:
    """Open a backing from its spec: an existing path, or a size (``64MiB``) for memory.

    With ``size``, a missing path is created as a sparse file of that size.
    """
    path = Path(spec)
    size_field = field[: -len("backing")] + "size" if field.endswith("backing") else "size"
    if size is not None and not path.exists() and _is_size(spec):
        # would otherwise create a file literally named "64MiB" in the working directory
        raise InputError(f"the backing {spec!r} is a memory size; a creation size applies "
                         "only to a file backing", file=file, field=size_field)
    if path.exists() or size is not None:
        create = None if size is None else parse_size(size, field=size_field, allow_zero=False)
        return FileBacking(path, create_size=create, field=field, file=file)
    try:
        nbytes = parse_size(spec, field=field, allow_zero=False)
    except InputError:
        raise InputError(f"{spec!r} is neither an existing file or block device nor a size "
                         "such as 64MiB", file=file, field=field) from None
    try:
        return MemoryBacking(nbytes)
    except (OSError, OverflowError) as exc:
        raise InputError(f"cannot reserve {format_size(nbytes)} of memory for the namespace: "
                         f"{_why(exc)}", file=file, field=field) from None


def _why(exc: OSError | OverflowError) -> str:
    """The reason a size could not be had, in words."""
    if isinstance(exc, OverflowError):
        return "larger than this system can address"
    return exc.strerror or str(exc)


def _is_size(spec: str) -> bool:
    try:
        parse_size(spec, allow_zero=False)
    except InputError:
        return False
    return True
