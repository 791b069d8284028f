"""The device probe against real loop devices and real files (no mocks)."""

from __future__ import annotations

import mmap
import os
import stat
from collections.abc import Callable
from pathlib import Path

import pytest

from kvtool.align import probe_device, statx_dioalign
from kvtool.errors import UsageError


@pytest.mark.root
@pytest.mark.integration
@pytest.mark.parametrize("sector", [512, 4096])
def test_loop_device(loop_device: Callable[..., str], sector: int) -> None:
    dev = loop_device(64 << 20, sector)
    limits = probe_device(dev)
    assert stat.S_ISBLK(os.stat(dev).st_mode)
    assert limits.kind == "block" and limits.path == dev
    assert limits.logical_block_size == sector
    assert limits.physical_block_size >= sector
    assert limits.size_bytes == 64 << 20
    assert limits.dio_offset_align == sector
    assert limits.dio_mem_align >= 1 and limits.dio_supported
    assert limits.dio_source in ("statx", "blksszget")
    # prove the limits are real: O_DIRECT at the probed alignment works, and half of it
    # (offset) is refused by the kernel with EINVAL
    buf = mmap.mmap(-1, 2 * sector)
    fd = os.open(dev, os.O_RDONLY | os.O_DIRECT)
    try:
        assert os.preadv(fd, [memoryview(buf)[:sector]], sector) == sector
        if sector > 512:
            with pytest.raises(OSError):
                os.preadv(fd, [memoryview(buf)[:sector]], 512)
    finally:
        os.close(fd)
        buf.close()


def test_regular_file(tmp_path: Path) -> None:
    p = tmp_path / "ns.img"
    p.write_bytes(b"\0" * 10_000)
    limits = probe_device(p)
    assert limits.kind == "file" and limits.size_bytes == 10_000
    dio = statx_dioalign(p)
    if dio is not None and dio.offset_align:
        assert limits.dio_source == "statx"
        assert limits.dio_offset_align == limits.logical_block_size == dio.offset_align
        assert limits.dio_mem_align == dio.mem_align
    else:
        assert limits.dio_offset_align == 4096
    assert limits.logical_block_size & (limits.logical_block_size - 1) == 0


def test_statx_matches_kernel_version() -> None:
    """statx STATX_DIOALIGN exists on Linux ≥ 6.1; on older kernels this returns None."""
    release = tuple(int(x) for x in os.uname().release.split(".")[:2] if x.isdigit())
    dio = statx_dioalign(Path(__file__))
    if release >= (6, 1):
        assert dio is not None
        assert dio.offset_align in (0, 512, 1024, 2048, 4096)
    else:
        assert dio is None


def test_missing_path() -> None:
    with pytest.raises(UsageError) as err:
        probe_device("/nonexistent/dev/nvme9n9")
    assert err.value.field == "device"


def test_directory_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(UsageError) as err:
        probe_device(tmp_path)
    assert err.value.field == "device" and "neither" in str(err.value)
