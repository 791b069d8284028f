"""Deterministic payloads and object keys."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvtool.errors import InputError
from kvtool.store.keys import SESSION_BLOCKS, object_keys
from kvtool.store.payload import FilePayload, make_payload
from kvtool.trace.hashing import chain_hashes


def _fill(p, key: int) -> np.ndarray:  # type: ignore[no-untyped-def]
    out = np.empty(p.object_bytes, dtype=np.uint8)
    p.fill(key, out)
    return out


@pytest.mark.parametrize("size", [1, 7, 8, 4096, 1_002_240])
def test_same_key_same_bytes_other_key_other_bytes(size: int) -> None:
    a, b = make_payload(size, 3), make_payload(size, 3)
    assert np.array_equal(_fill(a, 11), _fill(b, 11))
    if size >= 8:
        assert not np.array_equal(_fill(a, 11), _fill(a, 12))
        assert not np.array_equal(_fill(a, 11), _fill(make_payload(size, 4), 11))


def test_fill_into_unaligned_view_matches() -> None:
    p = make_payload(1000, 1)
    raw = np.zeros(1001, dtype=np.uint8)
    p.fill(5, raw[1:])
    assert np.array_equal(raw[1:], _fill(p, 5))


def test_first_difference_names_the_byte() -> None:
    p = make_payload(4096, 1)
    data = _fill(p, 9)
    assert p.first_difference(9, data, np.empty(4096, np.uint8)) is None
    data[1234] ^= 1
    assert p.first_difference(9, data, np.empty(4096, np.uint8)) == 1234


def test_file_payload_tiles_real_bytes(tmp_path: Path) -> None:
    tensor = np.arange(1000, dtype=np.float16)
    np.save(tmp_path / "kv.npy", tensor)
    p = FilePayload(5000, 0, tmp_path / "kv.npy")
    out = _fill(p, 77)
    src = tensor.view(np.uint8)
    assert int.from_bytes(out[:8].tobytes(), "little") == 77
    # after the key stamp, the bytes are a rotation of the tensor's bytes
    start = np.flatnonzero(np.all([np.roll(np.tile(src, 3), -s)[8:40] == out[8:40]
                                   for s in range(src.size)], axis=1))
    assert start.size >= 1
    assert p.source_bytes == 2000 and p.source_crc != 0


def test_missing_payload_file(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="no such file"):
        make_payload(100, 0, tmp_path / "nope.bin")


def test_keys_are_the_cache_engines_chain_hashes() -> None:
    keys = object_keys(5, SESSION_BLOCKS + 3, block_tokens=16)
    assert keys == object_keys(5, SESSION_BLOCKS + 3, block_tokens=16)
    assert len(set(keys)) == len(keys)
    rng = np.random.Generator(np.random.PCG64([5, 0]))
    from kvtool.store.keys import VOCAB
    tokens = rng.integers(0, VOCAB, size=SESSION_BLOCKS * 16, dtype=np.int64)
    assert keys[:SESSION_BLOCKS] == chain_hashes(tokens.tolist(), 16)
    assert object_keys(6, 3, block_tokens=16) != keys[:3]


@pytest.mark.parametrize("size", [8, 13, 4096, 100_003])
def test_differences_in_place(size: int) -> None:
    p = make_payload(size, 2)
    scratch = np.empty(size, np.uint8)
    assert p.differences_in_place(4, _fill(p, 4), scratch) is None
    assert p.differences_in_place(5, _fill(p, 4), scratch) is not None
    for at in {0, size // 2, size - 1}:
        bad = _fill(p, 4)
        bad[at] ^= 0x10
        assert p.differences_in_place(4, bad, scratch) == (1, at)
        unaligned = np.empty(size + 1, np.uint8)[1:]
        unaligned[:] = _fill(p, 4)
        unaligned[at] ^= 1
        assert p.differences_in_place(4, unaligned, scratch) == (1, at)


@pytest.mark.parametrize("size", [1, 8, 13, 4096, 1_002_240])
def test_expected_crc_equals_the_crc_of_the_bytes(size: int) -> None:
    from kvtool.store.checksum import crc32c

    p = make_payload(size, 9)
    for key in (0, 1, 2**64 - 1, 0x1234_5678_9ABC_DEF0):
        assert p.expected_crc(key) == crc32c(_fill(p, key))
