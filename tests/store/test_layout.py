"""Superblock and index-entry encoding, and the layout arithmetic."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtool.store.layout import (
    DATA_ALIGN,
    ENTRY_BYTES,
    ENTRY_DTYPE,
    META_BLOCK,
    BadSuperblock,
    Geometry,
    NotAStore,
    Superblock,
    entry_crc,
    new_superblock,
    plan_layout,
    seal,
)


def _sb(**kw: int) -> Superblock:
    args = {"device_bytes": 1 << 30, "object_bytes": 1_002_240, "lba_size": 512,
            "physical_block_size": 4096, "seed": 7, "created_ns": 123}
    args.update(kw)
    return new_superblock(geometry=Geometry("deepseek-v4-flash", "fp8", 256, 1), **args)


def test_superblock_round_trips() -> None:
    sb = _sb()
    raw = sb.encode()
    assert len(raw) == META_BLOCK and raw[:8] == b"KVTSTORE"
    assert Superblock.decode(raw) == sb
    assert sb.slot_bytes == 1_002_496  # 1,958 × 512 B, the brief's bounce size


def test_superblock_on_4k_lba_pads_to_1003520() -> None:
    assert _sb(lba_size=4096).slot_bytes == 1_003_520


@pytest.mark.parametrize("offset", [0, 9, 24, 100, 200, META_BLOCK - 5, META_BLOCK - 1])
def test_any_flipped_superblock_byte_is_rejected(offset: int) -> None:
    raw = bytearray(_sb().encode())
    raw[offset] ^= 0x01
    with pytest.raises((BadSuperblock, NotAStore)):
        Superblock.decode(raw)


def test_zeros_are_not_a_store() -> None:
    with pytest.raises(NotAStore):
        Superblock.decode(bytes(META_BLOCK))


@given(device=st.integers(0, 1 << 40), obj=st.integers(1, 64 << 20),
       lba=st.sampled_from([512, 4096]))
def test_plan_layout_fits_and_is_maximal(device: int, obj: int, lba: int) -> None:
    n, ibytes, doff = plan_layout(device, obj, lba)
    slot = -(-obj // lba) * lba
    assert doff % DATA_ALIGN == 0 and doff % lba == 0 and ibytes % lba == 0
    if n:
        assert ibytes >= n * ENTRY_BYTES
        assert doff >= META_BLOCK + ibytes
        assert doff + n * slot <= device
    n2, _, doff2 = plan_layout(device, obj, lba)
    # one more slot never fits
    more_index = -(-((n + 1) * ENTRY_BYTES) // 4096) * 4096
    more_doff = -(-(max(META_BLOCK, lba) + more_index) // DATA_ALIGN) * DATA_ALIGN
    assert more_doff + (n + 1) * slot > device
    assert (n2, doff2) == (n, doff)


def test_entry_crc_covers_every_field() -> None:
    e = np.zeros(1, dtype=ENTRY_DTYPE)
    e["key"], e["length"], e["flags"] = 42, 1000, 1
    seal(e)
    before = int(e["entry_crc"][0])
    raw = e.view(np.uint8)
    for i in range(60):
        raw[i] ^= 0x80
        assert int(entry_crc(e)[0]) != before, f"byte {i} not covered"
        raw[i] ^= 0x80
