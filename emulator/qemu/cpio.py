"""Write a ``newc`` cpio archive (the initramfs format) from a directory tree.

Written by hand because it is 40 lines and removes a host tool from the build; entries are
sorted and owned by root, so the same tree always gives the same bytes.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import BinaryIO


def _pad4(n: int) -> bytes:
    return b"\0" * (-n % 4)


def _entry(out: BinaryIO, name: str, st_mode: int, data: bytes, ino: int, mtime: int) -> None:
    encoded = name.encode() + b"\0"
    fields = (ino, st_mode, 0, 0, 1, mtime, len(data), 0, 0, 0, 0, len(encoded), 0)
    header = b"070701" + b"".join(b"%08X" % f for f in fields)
    out.write(header + encoded + _pad4(len(header) + len(encoded)))
    out.write(data + _pad4(len(data)))


def write_newc(root: Path, out: BinaryIO) -> None:
    """Archive every directory, regular file and symlink under ``root`` into ``out``."""
    ino = 1
    paths = sorted(root.rglob("*"))
    for path in paths:
        rel = path.relative_to(root).as_posix()
        st = path.lstat()
        mode = st.st_mode
        if stat.S_ISLNK(mode):
            data = os.readlink(path).encode()
        elif stat.S_ISREG(mode):
            data = path.read_bytes()
        elif stat.S_ISDIR(mode):
            data = b""
        else:
            continue
        _entry(out, rel, mode, data, ino, 0)
        ino += 1
    _entry(out, "TRAILER!!!", 0, b"", 0, 0)
