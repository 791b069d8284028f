"""Power loss at random points of the commit protocol (kvtool/store/objectstore.py).

The SIGKILL tests (test_crash.py) kill the process, but the kernel still writes back what
it was given, so they cannot catch a missing flush barrier. Here the engine itself loses
every write that no flush made durable (tests/helpers/powerloss.py), at a random operation
of a random mix of ``put``, ``delete`` and batched writes; in the ``torn`` mode a random
subset of the un-flushed sectors reaches the medium, in any order.

After each cut the store is reopened from what survived, and for every key: an
acknowledged state (the bytes of the last acknowledged put, or absence after an
acknowledged delete) survives unless a later, unacknowledged operation on that key
replaced it; anything else is absent or detected — never silently wrong bytes.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvtool.store.layout import BadSuperblock, NotAStore, new_superblock
from kvtool.store.objectstore import ObjectStore
from tests.helpers.powerloss import PowerCut, PowerLossEngine

SIZE = 2 << 20
KEYS = 6
TRIALS = 120


class History:
    """Every state each key was given, in order, and how far each is acknowledged."""

    def __init__(self) -> None:
        self.states: dict[int, list[bytes | None]] = {k: [None] for k in range(KEYS)}
        self.acked: dict[int, int] = dict.fromkeys(range(KEYS), 0)  # index into states
        self.versions: dict[int, tuple[int, int]] = {}  # ordinal -> (key, state index)

    def attempt(self, key: int, data: bytes | None) -> int:
        self.states[key].append(data)
        return len(self.states[key]) - 1

    def ack(self, key: int, index: int) -> None:
        self.acked[key] = max(self.acked[key], index)

    def allowed(self, key: int) -> list[bytes | None]:
        return self.states[key][self.acked[key]:]


def _workload(store: ObjectStore, h: History, rng: random.Random, obj: int) -> None:
    ordinal = 0
    for _ in range(10):
        r = rng.random()
        key = rng.randrange(KEYS)
        if r < 0.45:
            data = rng.randbytes(obj)
            i = h.attempt(key, data)
            store.put(key, data)
            h.ack(key, i)
        elif r < 0.6:
            if key in store:
                i = h.attempt(key, None)
                store.delete(key)
                h.ack(key, i)
        else:
            def acked(pairs: list[tuple[int, int]]) -> None:
                for _key, ordn in pairs:
                    k, idx = h.versions[ordn]
                    h.ack(k, idx)

            w = store.writer(qd=2, batch_objects=2, on_commit=acked)
            try:
                for _ in range(rng.randint(1, 4)):
                    k = rng.randrange(KEYS)
                    data = rng.randbytes(obj)
                    ordinal += 1
                    h.versions[ordinal] = (k, h.attempt(k, data))
                    arr = np.frombuffer(data, dtype=np.uint8)
                    w.put(k, lambda out, arr=arr: out.__setitem__(slice(None), arr), ordinal)
            finally:
                w.close()


@pytest.mark.parametrize("torn", [False, True], ids=["drop-unflushed", "torn-unflushed"])
def test_power_cut_anywhere_loses_nothing_acknowledged(torn: bool) -> None:
    rng = random.Random(9 + torn)
    # How many operations a whole run takes, to spread the cut points over it.
    outcomes = {"cut": 0, "completed": 0, "unformatted": 0}
    for trial in range(TRIALS):
        obj = rng.choice([1000, 4096])  # the bounce path and the zero-copy path
        seed = rng.randrange(1 << 30)
        cut = rng.randrange(1, 90)
        eng = PowerLossEngine(SIZE, cut_after=cut)
        h = History()
        formatted = False
        try:
            sb = new_superblock(device_bytes=SIZE, object_bytes=obj, lba_size=512,
                                physical_block_size=512, seed=1, created_ns=0)
            store = ObjectStore.format(eng, sb)
            formatted = True
            _workload(store, h, random.Random(seed), obj)
            outcomes["completed"] += 1
        except PowerCut:
            outcomes["cut"] += 1
        finally:
            eng.close()
        after = PowerLossEngine(SIZE, durable=eng.after_power_loss(rng, torn=torn))
        try:
            reopened = ObjectStore.open(after)
        except (NotAStore, BadSuperblock):
            assert not formatted, f"trial {trial}: a formatted store did not reopen"
            outcomes["unformatted"] += 1
            continue
        assert not reopened.scan.problems, (trial, reopened.scan.problems)
        for key in range(KEYS):
            found = reopened.get(key) if key in reopened else None
            allowed = h.allowed(key)
            assert found in allowed, (
                f"trial {trial} (cut after {cut} ops): key {key} holds "
                f"{'nothing' if found is None else f'{len(found)} unexpected bytes'}; "
                f"acknowledged state #{h.acked[key]} of {len(h.states[key]) - 1}")
        reopened.close()
        after.close()
    assert outcomes["cut"] > TRIALS // 2 and outcomes["completed"] > 0, outcomes


def test_the_engine_loses_unflushed_writes() -> None:
    """The model itself: what was flushed survives, what was not is gone (or torn)."""
    eng = PowerLossEngine(4096, cut_after=3)
    one, two = memoryview(b"\x01" * 512), memoryview(b"\x02" * 1024)
    eng.write_from(0, one)
    eng.flush()
    eng.write_from(512, two)
    with pytest.raises(PowerCut):
        eng.flush()
    with pytest.raises(PowerCut):
        eng.read_into(0, memoryview(bytearray(512)))
    rng = random.Random(1)
    assert eng.after_power_loss(rng, torn=False) == b"\x01" * 512 + bytes(3584)
    torn = {eng.after_power_loss(rng, torn=True)[512:1536] for _ in range(40)}
    assert torn == {bytes(1024), b"\x02" * 512 + bytes(512), bytes(512) + b"\x02" * 512,
                    b"\x02" * 1024}
