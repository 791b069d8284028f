"""Probe a block device or file for its real O_DIRECT limits.

* Block devices: ``BLKSSZGET`` (logical block size), ``BLKPBSZGET`` (physical block size),
  ``BLKGETSIZE64`` (bytes) through :func:`fcntl.ioctl`.
* DIO alignment: ``statx(STATX_DIOALIGN)`` (Linux ≥ 6.1) through ctypes, because
  :func:`os.statx` only exists from Python 3.15. glibc's ``statx`` is used when exported,
  else the raw syscall (x86_64: 332, aarch64: 291). When the kernel lacks it, block
  devices fall back to the logical block size for offsets and the queue's
  ``dma_alignment + 1`` (sysfs) or the logical block size for buffers; files fall back
  to 4096 B, which every device accepts.

A ``dio_source`` of ``statx`` means the kernel itself reported the limits.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import platform
import stat
import struct
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

from kvtool.errors import InputError, UsageError

BLKSSZGET = 0x1268
BLKPBSZGET = 0x127B
BLKGETSIZE64 = 0x80081272
BLKIOMIN = 0x1278
BLKIOOPT = 0x1279

STATX_DIOALIGN = 0x2000
AT_FDCWD = -100
_STATX_SIZE = 256
_STATX_SYSCALL = {"x86_64": 332, "amd64": 332, "aarch64": 291, "arm64": 291}

DeviceKind = Literal["block", "file"]
DioSource = Literal["statx", "blksszget", "fallback"]

#: Offset/buffer alignment assumed for a file when the kernel cannot tell (safe everywhere).
FALLBACK_ALIGN = 4096


@dataclass(frozen=True)
class DioAlign:
    """``statx`` DIO alignment: both 0 means the file does not support O_DIRECT."""

    mem_align: int
    offset_align: int


@dataclass(frozen=True)
class DeviceLimits:
    """What a device or file accepts for O_DIRECT I/O.

    ``dio_offset_align`` is the alignment offsets and lengths need (the logical block size
    on a block device); ``dio_mem_align`` the alignment of the buffer address.
    ``dio_supported`` is False when the kernel says the file cannot do O_DIRECT at all.
    """

    path: str
    kind: DeviceKind
    logical_block_size: int
    physical_block_size: int
    size_bytes: int
    dio_mem_align: int
    dio_offset_align: int
    dio_source: DioSource
    dio_supported: bool = True
    min_io: int | None = None
    optimal_io: int | None = None
    notes: tuple[str, ...] = field(default=())

    def to_dict(self) -> dict[str, object]:
        d = asdict(self)
        d["notes"] = list(self.notes)
        return d


def statx_dioalign(path: str | os.PathLike[str]) -> DioAlign | None:
    """The kernel's DIO alignment for ``path``, or ``None`` when it does not report it."""
    buf = ctypes.create_string_buffer(_STATX_SIZE)
    raw = os.fsencode(path)
    rc = _call_statx(raw, buf)
    if rc is None or rc != 0:
        return None
    mask = struct.unpack_from("<I", buf.raw, 0x00)[0]
    if not mask & STATX_DIOALIGN:
        return None
    mem, off = struct.unpack_from("<II", buf.raw, 0x98)
    return DioAlign(mem_align=mem, offset_align=off)


def _call_statx(raw: bytes, buf: ctypes.Array[ctypes.c_char]) -> int | None:
    try:
        # the interpreter's own C library (dlopen(NULL)); find_library would run ldconfig
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    fn = getattr(libc, "statx", None)
    if fn is not None:
        fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_uint,
                       ctypes.c_void_p]
        fn.restype = ctypes.c_int
        rc = int(fn(AT_FDCWD, raw, 0, STATX_DIOALIGN, buf))
    else:
        nr = _STATX_SYSCALL.get(platform.machine().lower())
        if nr is None:
            return None
        libc.syscall.restype = ctypes.c_long
        rc = int(libc.syscall(ctypes.c_long(nr), ctypes.c_int(AT_FDCWD), ctypes.c_char_p(raw),
                              ctypes.c_int(0), ctypes.c_uint(STATX_DIOALIGN), buf))
    if rc != 0 and ctypes.get_errno() in (errno.ENOSYS, errno.EINVAL):
        return None
    return rc


def _ioctl_uint(fd: int, request: int, fmt: str) -> int:
    size = struct.calcsize(fmt)
    out = fcntl.ioctl(fd, request, bytes(size))
    return int(struct.unpack(fmt, out)[0])


def _sysfs_queue(st: os.stat_result, name: str) -> int | None:
    base = Path(f"/sys/dev/block/{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}")
    for queue in (base / "queue", base / ".." / "queue"):  # a partition's queue is its disk's
        try:
            return int((queue / name).read_text().strip())
        except (OSError, ValueError):
            continue
    return None


def probe_device(path: str | os.PathLike[str]) -> DeviceLimits:
    """Probe ``path`` (a block device or a regular file); errors name ``--device``."""
    p = str(path)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        raise UsageError(f"no such file or device: {p}", field="device") from None
    except OSError as exc:
        raise UsageError(f"cannot stat {p}: {exc.strerror}", field="device") from None
    if stat.S_ISBLK(st.st_mode):
        return _probe_block(p, st)
    if stat.S_ISREG(st.st_mode):
        return _probe_file(p, st)
    raise UsageError(f"{p} is neither a block device nor a regular file", field="device")


def _probe_block(p: str, st: os.stat_result) -> DeviceLimits:
    try:
        fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise InputError(f"cannot open {p}: {exc.strerror}", field="device") from None
    try:
        logical = _ioctl_uint(fd, BLKSSZGET, "i")
        physical = _ioctl_uint(fd, BLKPBSZGET, "I")
        size = _ioctl_uint(fd, BLKGETSIZE64, "Q")
        min_io = _ioctl_uint(fd, BLKIOMIN, "I")
        opt_io = _ioctl_uint(fd, BLKIOOPT, "I")
    except OSError as exc:
        raise InputError(f"block-device ioctl failed on {p}: {exc.strerror}",
                         field="device") from None
    finally:
        os.close(fd)
    dio = statx_dioalign(p)
    notes: list[str] = []
    source: DioSource
    if dio is not None and dio.offset_align > 0:
        mem, off, source = dio.mem_align, dio.offset_align, "statx"
    else:
        dma = _sysfs_queue(st, "dma_alignment")
        mem = dma + 1 if dma is not None else logical
        off, source = logical, "blksszget"
        notes.append("kernel lacks statx STATX_DIOALIGN; offset alignment = logical block size, "
                     + ("buffer alignment = sysfs dma_alignment + 1" if dma is not None
                        else "buffer alignment = logical block size (pre-6.0 rule)"))
    return DeviceLimits(path=p, kind="block", logical_block_size=logical,
                        physical_block_size=physical, size_bytes=size, dio_mem_align=mem,
                        dio_offset_align=off, dio_source=source,
                        min_io=min_io or None, optimal_io=opt_io or None, notes=tuple(notes))


def _probe_file(p: str, st: os.stat_result) -> DeviceLimits:
    dio = statx_dioalign(p)
    blksize = st.st_blksize or FALLBACK_ALIGN
    if dio is not None and dio.offset_align > 0:
        return DeviceLimits(path=p, kind="file", logical_block_size=dio.offset_align,
                            physical_block_size=max(blksize, dio.offset_align),
                            size_bytes=st.st_size, dio_mem_align=dio.mem_align,
                            dio_offset_align=dio.offset_align, dio_source="statx",
                            notes=("physical block size of a file = the filesystem's "
                                   "preferred I/O size (st_blksize)",))
    if dio is not None:  # the kernel answered: this filesystem has no O_DIRECT
        return DeviceLimits(path=p, kind="file", logical_block_size=FALLBACK_ALIGN,
                            physical_block_size=max(blksize, FALLBACK_ALIGN),
                            size_bytes=st.st_size, dio_mem_align=FALLBACK_ALIGN,
                            dio_offset_align=FALLBACK_ALIGN, dio_source="statx",
                            dio_supported=False,
                            notes=("the filesystem does not support O_DIRECT (statx reports "
                                   "DIO alignment 0); alignment shown is the 4096-B fallback",))
    return DeviceLimits(path=p, kind="file", logical_block_size=FALLBACK_ALIGN,
                        physical_block_size=max(blksize, FALLBACK_ALIGN), size_bytes=st.st_size,
                        dio_mem_align=FALLBACK_ALIGN, dio_offset_align=FALLBACK_ALIGN,
                        dio_source="fallback",
                        notes=("kernel lacks statx STATX_DIOALIGN; assuming 4096-B alignment, "
                               "which every device accepts",))
