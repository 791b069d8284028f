"""CRC32C (Castagnoli) over memory buffers, from ``google-crc32c``'s C library.

``google_crc32c.value`` accepts only ``bytes``, which would copy every object once more.
The package's extension links the library's ``crc32c_extend``; calling that symbol
through ctypes checksums any buffer in place and releases the GIL while it runs, so
checksums overlap I/O. When the symbol cannot be found the pure ``value`` path is used.
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


def crc32c(data: memoryview | bytes | np.ndarray, crc: int = 0) -> int:
    """CRC32C of ``data`` continuing from ``crc`` (0 to start)."""
    arr = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data
    if _EXTEND is not None:
        if not arr.flags.c_contiguous:
            arr = np.ascontiguousarray(arr)
        return int(_EXTEND(crc, arr.ctypes.data, arr.nbytes))
    return int(google_crc32c.extend(crc, arr.tobytes()))
