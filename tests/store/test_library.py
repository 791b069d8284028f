"""load / verify / inspect / bench as library calls (no CLI), on real O_DIRECT files."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from kvtool.errors import UsageError
from kvtool.store.bench import bench, plan_cases
from kvtool.store.inspect import inspect
from kvtool.store.load import LoadSpec, load
from kvtool.store.verify import Sample, choose_sample, verify
from tests.store.conftest import flip_byte


def test_load_verify_inspect(blank_file: Callable[[int], Path]) -> None:
    path = str(blank_file(24 << 20))
    acks: list[dict] = []  # type: ignore[type-arg]
    seen: list[int] = []
    res = load(path, LoadSpec(object_bytes=300_000, count=50, qd=3, batch_objects=8),
               ack=acks.append, progress=seen.append)
    assert res["written"] == 50 and sum(seen) == 50 and acks[-1]["objects"] == 50
    rep = verify(path, qd=2)
    assert rep["ok"] and rep["objects_checked"] == 50 and rep["content_checked"] == 50
    info = inspect(path, list_objects=2)
    assert info["index"]["live"] == 50 and len(info["objects"]) == 2
    flip_byte(path, info["objects"][1]["offset"] + 299_999)  # the object's last byte
    rep = verify(path)
    assert not rep["ok"] and {b["check"] for b in rep["bad"]} == {"checksum", "content"}
    assert "object byte 299999" in next(b for b in rep["bad"] if b["check"] == "content")[
        "detail"]


def test_load_4k_layout_on_a_512_file(blank_file: Callable[[int], Path]) -> None:
    path = str(blank_file(16 << 20))
    res = load(path, LoadSpec(object_bytes=1_002_240, count=3, lba=4096))
    assert res["store"]["lba_size"] == 4096 and res["store"]["slot_bytes"] == 1_003_520
    assert verify(path)["ok"]
    with pytest.raises(UsageError, match="4096-byte blocks, not 512"):
        load(path, LoadSpec(object_bytes=1_002_240, count=4))


def test_choose_sample() -> None:
    slots = list(range(100))
    assert choose_sample(slots, None) == slots
    picked = choose_sample(slots, Sample(fraction=0.25), seed=3)
    assert len(picked) == 25 and picked == sorted(set(picked))
    assert choose_sample(slots, Sample(fraction=0.25), seed=3) == picked
    assert choose_sample(slots, Sample(count=500)) == slots
    for bad in ({"count": 0}, {"fraction": 0.0}, {"fraction": 1.5}, {}, {"count": 1, "fraction": 0.5}):
        with pytest.raises(UsageError) as err:
            Sample(**bad)  # type: ignore[arg-type]
        assert err.value.field == "sample"


def test_plan_cases_orders_writes_first_and_pairs_paths() -> None:
    cases = plan_cases(1_002_240, 512, ["rand-read", "seq-write"], [1, 8])
    assert [c.pattern for c in cases] == ["seq-write"] * 4 + ["rand-read"] * 4
    assert {(c.path, c.object_bytes) for c in cases} == {("aligned", 1_002_496),
                                                        ("bounce", 1_002_240)}
    assert {c.path for c in plan_cases(1 << 20, 512, ["seq-read"], [1])} == {"aligned"}


def test_bench_library(blank_file: Callable[[int], Path]) -> None:
    path = str(blank_file(8 << 20))
    doc = bench(path, object_bytes=100_000, qds=[2], patterns=["seq-write", "rand-read"],
                max_ops=10, seconds=10, region_bytes=4 << 20)
    assert [r["ops"] for r in doc["results"]] == [10, 10, 10, 10]
    assert doc["wrote"] and len(doc["bounce_cost"]) == 2


def test_cli_constants_mirror_the_library() -> None:
    """The CLI modules avoid importing the store library at start-up, so they repeat a few
    constants; keep them in step."""
    from kvtool.cli import bench as cli_bench
    from kvtool.cli import load as cli_load
    from kvtool.store import bench as lib_bench
    from kvtool.store import engine

    assert cli_load.DEFAULT_QD == engine.DEFAULT_QD
    assert cli_bench.PATTERNS == lib_bench.PATTERNS and cli_bench.PATHS == lib_bench.PATHS


def test_many_objects_take_the_analytic_crc_path_and_still_catch_everything(
        blank_file: Callable[[int], Path]) -> None:
    from kvtool.store import layout
    from kvtool.store.engine import open_engine
    from kvtool.store.objectstore import ObjectStore
    from kvtool.store.payload import ANALYTIC_CRC_MIN_OBJECTS

    count = ANALYTIC_CRC_MIN_OBJECTS + 72
    path = str(blank_file(16 << 20))
    load(path, LoadSpec(object_bytes=10_001, count=count))
    assert verify(path)["ok"]
    assert verify(path, checksums_only=True)["ok"]  # the stored CRCs are the bytes' CRCs
    objects = inspect(path, list_objects=count)["objects"]
    flip_byte(path, objects[10]["offset"] + 10_000)  # last byte of object 10
    e = open_engine(path, write=True)
    try:
        s = ObjectStore.open(e)
        slot = objects[20]["slot"]
        s.entries["data_crc"][slot] ^= 0x100  # object 20: only its stored CRC is wrong
        layout.seal(s.entries[slot:slot + 1])
        s.write_index([slot])
        e.flush()
        s.close()
    finally:
        e.close()
    rep = verify(path)
    got = sorted((b["key"], b["check"]) for b in rep["bad"])
    assert got == sorted([(objects[10]["key"], "checksum"), (objects[10]["key"], "content"),
                          (objects[20]["key"], "checksum")])
