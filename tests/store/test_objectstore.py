"""The object store library on a real O_DIRECT file: format, open, put/get/delete,
generations, batch writer, index scanning."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from kvtool.store.engine import IOEngine, open_engine
from kvtool.store.layout import ENTRY_BYTES, ORDINAL_NONE, NotAStore, new_superblock
from kvtool.store.objectstore import ObjectCorrupt, ObjectStore, StoreFull
from kvtool.store.payload import make_payload

OBJ = 10_000  # not a multiple of 512: the bounce path


@pytest.fixture
def engine(blank_file: Callable[[int], Path]) -> Iterator[IOEngine]:
    e = open_engine(str(blank_file(4 << 20)), write=True, qd=4)
    yield e
    e.close()


def fresh(engine: IOEngine, obj: int = OBJ) -> ObjectStore:
    sb = new_superblock(device_bytes=engine.size, object_bytes=obj, lba_size=engine.lba_size,
                        physical_block_size=engine.lba_size, seed=1, created_ns=time.time_ns())
    return ObjectStore.format(engine, sb)


def test_blank_target_is_not_a_store(engine: IOEngine) -> None:
    with pytest.raises(NotAStore):
        ObjectStore.open(engine)


def test_put_get_survive_reopen(engine: IOEngine) -> None:
    s = fresh(engine)
    assert len(s) == 0 and s.free_slots == s.sb.slot_count
    data = {k: np.random.default_rng(k).integers(0, 256, OBJ, dtype=np.uint8).tobytes()
            for k in (1, 2, 3)}
    for k, v in data.items():
        s.put(k, v)
    s.put(4, b"short object")
    s2 = ObjectStore.open(engine)
    assert len(s2) == 4 and s2.sb == s.sb
    assert all(s2.get(k) == v for k, v in data.items())
    assert s2.get(4) == b"short object"
    out = bytearray(OBJ + 10)
    assert s2.get_into(1, memoryview(out)) == OBJ and bytes(out[:OBJ]) == data[1]


def test_replace_keeps_newest_generation_and_frees_the_old_slot(engine: IOEngine) -> None:
    s = fresh(engine)
    s.put(7, b"old" * 100)
    slot_old = s.by_key[7]
    free_before = s.free_slots
    s.put(7, b"new" * 100)
    assert s.get(7) == b"new" * 100 and s.by_key[7] != slot_old
    assert s.free_slots == free_before  # the old slot came back
    s2 = ObjectStore.open(engine)
    assert s2.get(7) == b"new" * 100 and len(s2) == 1 and s2.scan.superseded == 0


def test_crash_between_new_and_retire_keeps_the_newest(engine: IOEngine) -> None:
    """Simulate a crash after the new entry was durable but before the old one was retired:
    both entries valid on the medium, the higher generation must win."""
    s = fresh(engine)
    s.put(9, b"v1" * 50)
    old_slot = s.by_key[9]
    old_entry = s.entries[old_slot].copy()
    s.put(9, b"v2" * 50)
    s.entries[old_slot] = old_entry  # resurrect the retired entry on the medium
    s.write_index([old_slot])
    engine.flush()
    s2 = ObjectStore.open(engine)
    assert s2.scan.superseded == 1
    assert s2.get(9) == b"v2" * 50
    s2.put(10, b"x")  # the next commit retires the loser durably
    s3 = ObjectStore.open(engine)
    assert s3.scan.superseded == 0 and s3.get(9) == b"v2" * 50 and len(s3) == 2


def test_delete_is_durable(engine: IOEngine) -> None:
    s = fresh(engine)
    s.put(1, b"a")
    s.put(2, b"b")
    s.delete(1)
    s2 = ObjectStore.open(engine)
    assert 1 not in s2 and s2.get(2) == b"b"
    with pytest.raises(KeyError):
        s2.get(1)


def test_store_full(engine: IOEngine) -> None:
    s = fresh(engine, obj=1 << 20)
    for k in range(s.sb.slot_count):
        s.put(k, b"z")
    with pytest.raises(StoreFull):
        s.put(10_000, b"z")


def test_batch_writer_commits_and_acknowledges(engine: IOEngine) -> None:
    s = fresh(engine)
    p = make_payload(OBJ, 1)
    acks: list[list[tuple[int, int]]] = []
    w = s.writer(qd=3, batch_objects=5, on_commit=acks.append)
    for i in range(23):
        w.put(1000 + i, lambda out, k=1000 + i: p.fill(k, out), i)
    w.close()
    assert [len(a) for a in acks] == [5, 5, 5, 5, 3]
    assert sorted(o for a in acks for _, o in a) == list(range(23))
    s2 = ObjectStore.open(engine)
    assert len(s2) == 23
    expect = np.empty(OBJ, dtype=np.uint8)
    for i in range(23):
        p.fill(1000 + i, expect)
        assert s2.get(1000 + i) == expect.tobytes()
        assert int(s2.entries[s2.by_key[1000 + i]]["ordinal"]) == i


def test_flipped_data_byte_fails_get(engine: IOEngine) -> None:
    s = fresh(engine)
    s.put(5, b"q" * OBJ)
    off = s.sb.slot_offset(s.by_key[5]) + 17
    with open(engine.describe()["target"], "r+b") as f:
        f.seek(off)
        f.write(b"Q")
    with pytest.raises(ObjectCorrupt, match="checksum mismatch"):
        ObjectStore.open(engine).get(5)
    with pytest.raises(ObjectCorrupt, match="checksum mismatch"):
        ObjectStore.open(engine).get_into(5, memoryview(bytearray(OBJ)))


def test_damaged_index_entry_is_a_problem_not_an_object(engine: IOEngine) -> None:
    s = fresh(engine)
    s.put(5, b"q" * OBJ)
    s.put(6, b"r" * OBJ)
    slot = s.by_key[5]
    with open(engine.describe()["target"], "r+b") as f:
        f.seek(s.sb.index_offset + slot * ENTRY_BYTES + 3)
        f.write(b"\x99")
    s2 = ObjectStore.open(engine)
    assert 5 not in s2 and s2.get(6) == b"r" * OBJ
    assert [(p.slot, p.reason) for p in s2.scan.problems] == [
        (slot, "index entry checksum mismatch")]
    assert not s2.is_free(slot)  # evidence is not overwritten


def test_reformat_orphans_old_entries(engine: IOEngine) -> None:
    s = fresh(engine)
    s.put(1, b"a")
    s2 = fresh(engine)
    assert len(ObjectStore.open(engine)) == 0 and s2.sb.uuid != s.sb.uuid
    assert int(s.entries[0]["ordinal"]) == ORDINAL_NONE


def test_batch_writer_replacing_keys_retires_old_versions(engine: IOEngine) -> None:
    s = fresh(engine)
    s.put(1, b"first")
    w = s.writer(qd=2, batch_objects=2)
    w.put(1, lambda out: out.fill(7), 0)
    w.close()
    s2 = ObjectStore.open(engine)
    assert len(s2) == 1 and s2.scan.superseded == 0
    assert s2.get(1) == bytes([7]) * OBJ
    assert s2.free_slots == s2.sb.slot_count - 1


def test_same_key_twice_in_one_batch_keeps_the_later(engine: IOEngine) -> None:
    s = fresh(engine)
    w = s.writer(qd=4, batch_objects=10)
    w.put(5, lambda out: (time.sleep(0.2), out.fill(1)), 0)  # slow: completes last
    w.put(5, lambda out: out.fill(2), 1)
    w.close()
    s2 = ObjectStore.open(engine)
    assert len(s2) == 1 and s2.get(5) == bytes([2]) * OBJ
    assert s2.free_slots == s2.sb.slot_count - 1
