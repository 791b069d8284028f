"""Store-test helpers; the real-storage fixtures (``store_dir``, ``blank_file``,
``loop_device``) are shared by every package and live in tests/conftest.py."""

from __future__ import annotations

import os
from pathlib import Path


def flip_byte(path: str | Path, offset: int) -> int:
    """Invert one byte on the medium, outside kvtool (buffered write + fsync); returns
    the byte's old value."""
    fd = os.open(path, os.O_RDWR)
    try:
        old = os.pread(fd, 1, offset)[0]
        os.pwrite(fd, bytes([old ^ 0xFF]), offset)
        os.fsync(fd)
        return old
    finally:
        os.close(fd)
