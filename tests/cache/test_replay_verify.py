"""A data-mode replay leaves its NVMe place a committed kvtool store: ``kvtool verify`` of
the place afterwards checks every block the tier held (content and CRC), and finds a
block damaged after the run."""

from __future__ import annotations

import json
import os
from pathlib import Path

from kvtool.store.engine import open_engine
from kvtool.store.objectstore import ObjectStore
from tests.conftest import REPO, run, run_json

TRACE = REPO / "fixtures" / "traces" / "multiturn-8x12.jsonl"


def test_verify_after_replay_checks_every_block_and_finds_damage(tmp_path: Path) -> None:
    place = tmp_path / "nvme.img"
    doc = run_json("replay", TRACE, "--gpu", "8blk", "--dram", "16blk",
                   "--nvme", f"300blk@{place}", "--block-bytes", "65536")
    nvme = next(t for t in doc["tiers"] if t["name"] == "nvme")
    held = nvme["committed_objects"]
    assert doc["corrupt_blocks"] == 0 and held > 16  # more than DRAM holds: evictions ran

    v = run_json("verify", place)
    assert v["ok"] and v["bad"] == []
    assert v["objects_indexed"] == v["objects_checked"] == v["content_checked"] == held
    assert v["bytes_checked"] == held * 65536

    with open_engine(str(place), write=False) as eng:
        store = ObjectStore.open(eng)
        slot = store.live_slots()[held // 2]
        at = store.sb.slot_offset(slot) + 1000
        store.close()
    fd = os.open(place, os.O_RDWR)
    try:
        byte = os.pread(fd, 1, at)
        os.pwrite(fd, bytes([byte[0] ^ 0xFF]), at)
    finally:
        os.close(fd)
    bad = run("--json", "verify", place)
    assert bad.exit_code == 1, bad.stderr
    found = json.loads(bad.stdout)
    assert found["objects_checked"] == held
    assert {b["slot"] for b in found["bad"]} == {slot}
    assert {b["check"] for b in found["bad"]} == {"checksum", "content"}
