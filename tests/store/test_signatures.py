"""Foreign-content detection, on real filesystem images where the tools exist."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from kvtool.store.layout import new_superblock
from kvtool.store.signatures import PROBE_BYTES, identify


def test_blank_is_none() -> None:
    assert identify(bytes(PROBE_BYTES)) is None


def test_kvtool_superblock() -> None:
    sb = new_superblock(device_bytes=1 << 30, object_bytes=4096, lba_size=512,
                        physical_block_size=512, seed=0, created_ns=0)
    assert identify(sb.encode() + bytes(PROBE_BYTES)) == "kvtool"


@pytest.mark.parametrize(("offset", "magic", "name"), [
    (0, b"LUKS\xba\xbe", "LUKS"), (0, b"XFSB", "XFS"), (512, b"EFI PART", "GPT"),
    (65536 + 64, b"_BHRfS_M", "btrfs"), (4086, b"SWAPSPACE2", "swap"),
])
def test_known_signatures(offset: int, magic: bytes, name: str) -> None:
    head = bytearray(PROBE_BYTES)
    head[offset:offset + len(magic)] = magic
    assert name in (identify(bytes(head)) or "")


def test_mbr() -> None:
    head = bytearray(PROBE_BYTES)
    head[446:462] = b"\x80" + bytes(3) + b"\x83" + bytes(11)
    head[510:512] = b"\x55\xaa"
    assert identify(bytes(head)) == "MBR partition table"


def test_any_non_zero_byte_is_foreign() -> None:
    head = bytearray(PROBE_BYTES)
    head[777_777] = 1
    assert identify(bytes(head)) == "non-zero data (first non-zero byte at offset 777777)"
    rnd = np.random.default_rng(0).integers(1, 256, size=PROBE_BYTES, dtype=np.uint8)
    assert identify(rnd.tobytes()) is not None


@pytest.mark.integration
@pytest.mark.parametrize(("tool", "args", "name"), [
    ("mkfs.ext4", ["-q", "-F"], "ext2/3/4"), ("mkswap", [], "swap"),
])
def test_real_images(tmp_path: Path, tool: str, args: list[str], name: str) -> None:
    if shutil.which(tool) is None:
        pytest.skip(f"{tool} is not installed")
    img = tmp_path / "fs.img"
    img.write_bytes(bytes(16 << 20))
    subprocess.run([tool, *args, str(img)], check=True, capture_output=True)
    assert name in (identify(img.read_bytes()[:PROBE_BYTES]) or "")
