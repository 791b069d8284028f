"""Extract the uncompressed ELF vmlinux from an x86 bzImage.

Booting the ELF directly (QEMU ``-kernel vmlinux`` through the PVH entry point) skips the
in-guest XZ decompressor, which costs about 3.8 s under TCG for Debian's kernel.
Adapted from the qemu-nvmet recipe (../shared/reference/qemu-nvmet/extract_vmlinux.py).
"""

from __future__ import annotations

import lzma
import shutil
import struct
import subprocess
import zlib
from pathlib import Path

_MAGICS = ((b"\xfd7zXZ\x00", "xz"), (b"\x1f\x8b\x08", "gzip"))


def _try(data: bytes, how: str) -> bytes | None:
    try:
        if how == "xz":
            return lzma.LZMADecompressor(format=lzma.FORMAT_XZ).decompress(data)
        return zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(data)
    except (lzma.LZMAError, zlib.error, EOFError):
        return None


def _zstd_payload(bzimage: bytes) -> bytes | None:
    """A zstd payload (Debian's 6.12), found through the boot header's payload_offset/length.

    Decompressed by the ``zstd`` CLI; the le32 size the kernel appends is cut off first.
    """
    if bzimage[0x202:0x206] != b"HdrS" or not shutil.which("zstd"):
        return None
    pm = ((bzimage[0x1F1] or 4) + 1) * 512
    off, length = struct.unpack_from("<II", bzimage, 0x248)
    payload = bzimage[pm + off: pm + off + length]
    if not payload.startswith(b"\x28\xb5\x2f\xfd"):
        return None
    proc = subprocess.run(["zstd", "-dcq"], input=payload[:-4], capture_output=True, check=False)
    return proc.stdout if proc.stdout.startswith(b"\x7fELF") else None


def extract_elf(bzimage: bytes) -> bytes:
    """The ELF payload of ``bzimage``; raises ValueError when none is found.

    Scans for every XZ/gzip magic: a false hit inside the setup code fails to decompress,
    or decompresses to something that is not an ELF, and the scan moves on.
    """
    for magic, how in _MAGICS:
        off = bzimage.find(magic)
        while off != -1:
            out = _try(bzimage[off:], how)
            if out is not None and out.startswith(b"\x7fELF"):
                return out
            off = bzimage.find(magic, off + 1)
    elf = _zstd_payload(bzimage)
    if elf is not None:
        return elf
    raise ValueError("no XZ-, gzip- or zstd-compressed ELF payload found in the bzImage "
                     "(zstd needs the zstd command)")


def extract_file(bzimage: Path, out: Path) -> int:
    """Write the ELF payload of ``bzimage`` to ``out`` (atomically); returns its size."""
    elf = extract_elf(bzimage.read_bytes())
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_bytes(elf)
    tmp.replace(out)
    return len(elf)
