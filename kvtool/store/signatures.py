"""Recognise what already lives on a target before ``kvtool load`` overwrites it.

``load`` formats only a target whose first MiB is all zeros or holds a kvtool superblock;
anything else (a filesystem, a partition table, swap, LUKS, or any other non-zero bytes)
is *foreign* and needs ``--force``. Known signatures are named so the refusal says what
would have been destroyed.
"""

from __future__ import annotations

from kvtool.store.layout import MAGIC

BENCH_MAGIC = b"KVTBENCH"
"""The first bytes ``kvtool bench`` leaves on a target it wrote: a rerun may overwrite it."""
BENCH = "kvtool bench data"

PROBE_BYTES = 1 << 20
"""How much of the target's head is examined (and must be zero on a blank target)."""

# (name, offset, magic bytes) — the offsets are those blkid uses.
SIGNATURES: list[tuple[str, int, bytes]] = [
    ("LUKS encrypted volume", 0, b"LUKS\xba\xbe"),
    ("XFS filesystem", 0, b"XFSB"),
    ("GPT partition table", 512, b"EFI PART"),
    ("GPT partition table", 4096, b"EFI PART"),
    ("ext2/3/4 filesystem", 1080, b"\x53\xef"),
    ("btrfs filesystem", 65536 + 64, b"_BHRfS_M"),
    ("swap space", 4096 - 10, b"SWAPSPACE2"),
    ("swap space", 4096 - 10, b"SWAP-SPACE"),
    ("swap space", 65536 - 10, b"SWAPSPACE2"),
    ("ZFS member", 128 * 1024 + 8, b"\x0c\xb1\xba\x00\x00\x00\x00\x00"),
    ("LVM2 physical volume", 512 + 24, b"LVM2 001"),
    ("ISO 9660 image", 32769, b"CD001"),
    ("squashfs image", 0, b"hsqs"),
    ("F2FS filesystem", 1024, b"\x10\x20\xf5\xf2"),
    ("NTFS filesystem", 3, b"NTFS    "),
    ("FAT filesystem", 54, b"FAT"),
    ("FAT32 filesystem", 82, b"FAT32"),
]


def identify(head: bytes | memoryview) -> str | None:
    """What ``head`` (the target's first bytes) holds: ``None`` if blank, ``"kvtool"`` for
    a kvtool store, else a description of the foreign content."""
    head = bytes(head)
    if head[:8] == MAGIC:
        return "kvtool"
    if head[:8] == BENCH_MAGIC:
        return BENCH
    for name, off, magic in SIGNATURES:
        if head[off:off + len(magic)] == magic:
            if name.startswith("ext") and head[1024 + 24:1024 + 28] == b"\0\0\0\0" \
                    and not any(head[1024:1080]):
                continue  # the two bytes alone are weak evidence without a superblock
            return name
    if len(head) >= 512 and head[510:512] == b"\x55\xaa" and any(head[446:510]):
        return "MBR partition table"
    first = len(head) - len(head.lstrip(b"\0"))
    if first < len(head):
        return f"non-zero data (first non-zero byte at offset {first})"
    return None
