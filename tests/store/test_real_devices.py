"""load → verify → corrupt → verify on real storage: loop devices with 512 B and 4096 B
sectors and a regular file, objects on the bounce path (1,002,240 B) and the aligned path
(32 MiB). Bytes are flipped by the test itself, outside kvtool."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from kvtool.store.layout import ENTRY_BYTES
from tests.conftest import run
from tests.store.conftest import flip_byte

DSV4 = 1_002_240
BIG = 32 << 20
SIZE = 160 << 20

TARGETS = [
    pytest.param(("file", 512), id="file"),
    pytest.param(("loop", 512), id="loop512", marks=[pytest.mark.root, pytest.mark.integration]),
    pytest.param(("loop", 4096), id="loop4096",
                 marks=[pytest.mark.root, pytest.mark.integration]),
]


@pytest.fixture
def target(request: pytest.FixtureRequest, blank_file: Callable[[int], Path]) -> tuple[str, int]:
    kind, sector = request.param
    if kind == "file":
        return str(blank_file(SIZE)), 512
    loop = request.getfixturevalue("loop_device")
    return loop(SIZE, sector), sector


def _verify(path: str) -> tuple[int, dict]:  # type: ignore[type-arg]
    r = run("--json", "verify", path, "--qd", "4")
    return r.exit_code, json.loads(r.stdout)


@pytest.mark.slow
@pytest.mark.parametrize("target", TARGETS, indirect=True)
@pytest.mark.parametrize(("obj", "count"), [(DSV4, 30), (BIG, 3)], ids=["bounce", "aligned"])
def test_load_verify_and_catch_flipped_bytes(target: tuple[str, int], obj: int,
                                             count: int) -> None:
    path, sector = target
    r = run("--json", "load", path, "--object-bytes", str(obj), "--count", str(count),
            "--qd", "4", "--seed", "3")
    assert r.exit_code == 0, r.stderr
    res = json.loads(r.stdout)
    sb = res["store"]
    assert res["written"] == count and sb["lba_size"] == sector
    assert sb["slot_bytes"] == -(-obj // sector) * sector
    assert res["io_path"] == ("bounce" if obj % sector else "zero-copy")
    if obj == DSV4:
        assert sb["slot_bytes"] == {512: 1_002_496, 4096: 1_003_520}[sector]

    code, rep = _verify(path)
    assert code == 0 and rep["ok"] and rep["objects_checked"] == count
    assert rep["content_checked"] == count

    info = run("--json", "store", "inspect", path, "--objects", str(count))
    objects = json.loads(info.stdout)["objects"]
    victim = objects[count // 2]

    # 1. a data byte: both the checksum and the content check fail, the object is named
    at = victim["offset"] + obj // 3
    flip_byte(path, at)
    code, rep = _verify(path)
    assert code == 1 and not rep["ok"]
    assert {b["check"] for b in rep["bad"]} == {"checksum", "content"}
    assert all(b["key"] == victim["key"] and b["offset"] == victim["offset"]
               for b in rep["bad"])
    content = next(b for b in rep["bad"] if b["check"] == "content")
    assert f"device offset {at}" in content["detail"]
    human = run("verify", path)
    assert human.exit_code == 1 and victim["key"] in human.stdout
    assert "problem" in human.stderr
    flip_byte(path, at)
    assert _verify(path)[0] == 0

    # 2. a pad byte (bounce objects only)
    if obj % sector:
        pad_at = victim["offset"] + obj + 5
        flip_byte(path, pad_at)
        code, rep = _verify(path)
        assert code == 1 and [b["check"] for b in rep["bad"]] == ["padding"]
        assert rep["bad"][0]["key"] == victim["key"]
        flip_byte(path, pad_at)

    # 3. an index entry
    entry_at = sb["index_offset"] + victim["slot"] * ENTRY_BYTES + 40
    flip_byte(path, entry_at)
    code, rep = _verify(path)
    assert code == 1 and [b["check"] for b in rep["bad"]] == ["index"]
    assert rep["bad"][0]["slot"] == victim["slot"] and rep["objects_checked"] == count - 1
    flip_byte(path, entry_at)

    # 4. the superblock
    flip_byte(path, 100)
    code, rep = _verify(path)
    assert code == 1 and rep["bad"][0]["check"] == "superblock"
    flip_byte(path, 100)
    assert _verify(path)[0] == 0
