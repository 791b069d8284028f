"""kvtool.store.checksum: the two ways into google-crc32c give the same CRC32C."""

from __future__ import annotations

import google_crc32c
import numpy as np
import pytest

from kvtool.store import checksum
from kvtool.store.checksum import GIL_FREE_BYTES, crc32c


def test_known_value_and_continuation() -> None:
    assert crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value
    assert crc32c(b"") == 0
    assert crc32c(b"56789", crc32c(b"1234")) == 0xE3069283


@pytest.mark.parametrize("size", [1, 4096, 32768, GIL_FREE_BYTES - 1, GIL_FREE_BYTES,
                                  GIL_FREE_BYTES + 4096])
def test_both_sides_of_the_gil_threshold_agree(size: int) -> None:
    """Below the threshold the extension's call, from it the GIL-free ctypes call: the
    same CRC either way, as the reference ``value`` of the bytes gives it."""
    data = np.random.default_rng(size).integers(0, 256, size=size, dtype=np.uint8)
    want = google_crc32c.value(data.tobytes())
    assert crc32c(data) == crc32c(memoryview(data)) == crc32c(data.tobytes()) == want
    assert checksum._EXTEND is not None  # the wheel links crc32c_extend: both ways run
    head, tail = data[: size // 2], data[size // 2:]
    assert crc32c(tail, crc32c(head)) == want


def test_views_and_other_dtypes_are_their_bytes() -> None:
    rng = np.random.default_rng(3)
    rows = rng.random((16, 1024)).astype(np.float32)
    assert crc32c(rows) == google_crc32c.value(rows.tobytes())
    col = rows[:, 3]  # not contiguous: checksummed as the bytes it holds
    assert crc32c(col) == google_crc32c.value(np.ascontiguousarray(col).tobytes())
    entries = np.zeros(4, dtype=[("key", "<u8"), ("crc", "<u4")])
    entries["key"] = [1, 2, 3, 4]
    assert crc32c(entries) == google_crc32c.value(entries.tobytes())
