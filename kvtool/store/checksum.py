"""CRC32C (Castagnoli) over memory buffers, from ``google-crc32c``'s C library.

Two ways in, both without copying the buffer:

* ``google_crc32c.extend`` takes any C-contiguous buffer a numpy array exports, and is
  the cheaper call (about half the cost on a 32 KiB block), but it holds the GIL while it
  runs;
* the package's extension also links the library's ``crc32c_extend``: called through
  ctypes it releases the GIL, so a checksum of a large buffer overlaps I/O and other
  threads. Used from :data:`GIL_FREE_BYTES` up (when the symbol cannot be found, the
  first way serves every size).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import google_crc32c
import numpy as np


def _c_extend() -> Callable[[int, int, int], int] | None:
    try:
        from google_crc32c import _crc32c  # type: ignore[attr-defined,unused-ignore]

        fn = ctypes.CDLL(_crc32c.__file__).crc32c_extend
    except (ImportError, OSError, AttributeError):
        return None
    fn.restype = ctypes.c_uint32
    fn.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]
    return fn  # type: ignore[no-any-return,unused-ignore]


_EXTEND = _c_extend()


GIL_FREE_BYTES = 1 << 20
"""Buffers from this size are checksummed with the GIL released (a 1 MiB CRC takes about
0.1 ms; below it, the call's cost outweighs what the release lets run meanwhile)."""


def crc32c(data: memoryview | bytes | np.ndarray, crc: int = 0) -> int:
    """CRC32C of ``data`` continuing from ``crc`` (0 to start)."""
    arr = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data
    if not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr)
    if _EXTEND is not None and arr.nbytes >= GIL_FREE_BYTES:
        return int(_EXTEND(crc, arr.ctypes.data, arr.nbytes))
    return int(google_crc32c.extend(crc, arr))
