"""``kvtool replay --simulate --iolog``: the NVMe tier's block I/O as a fio iolog, replayed
by real fio against a file (bytes and operations as fio reports them)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from kvtool.cache.iolog import IologWriter
from tests.conftest import run, run_json
from tests.helpers.cache import write_multi_turn
from tests.helpers.cli import one_error_line

BB = 16384


def replay(*args: str) -> dict[str, Any]:
    doc: dict[str, Any] = run_json("replay", "--simulate", *args)
    return doc


def parse(path: Path) -> tuple[str, list[tuple[int, str, int, int]]]:
    """(header, [(time ms, action, offset, length)]) of a version-3 log's I/O lines."""
    lines = path.read_text().splitlines()
    ops = []
    for line in lines[1:]:
        parts = line.split()
        if len(parts) == 5:
            ops.append((int(parts[0]), parts[2], int(parts[3]), int(parts[4])))
    return lines[0], ops


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    return write_multi_turn(tmp_path / "mt.jsonl", sessions=12, rounds=6, input_tokens=600,
                            output_tokens=100)


def test_log_counts_equal_the_nvme_tier_counters(trace: Path, tmp_path: Path) -> None:
    log = tmp_path / "nvme.iolog"
    doc = replay(str(trace), "--dram", "20blk", "--nvme", "60blk", "--block-bytes", str(BB),
                 "--iolog", str(log))
    lg = doc["iolog"]
    assert lg["reads"] == doc["blocks_read"]["nvme"] > 0
    assert lg["writes"] == doc["blocks_written"]["nvme"] > 0
    header, ops = parse(log)
    assert header == "fio version 3 iolog"
    assert sum(op == "read" for _, op, _, _ in ops) == lg["reads"]
    assert sum(op == "write" for _, op, _, _ in ops) == lg["writes"]
    assert all(n == BB and off % BB == 0 and off + n <= lg["device_bytes"] for _, _, off, n in ops)
    times = [t for t, _, _, _ in ops]
    assert times == sorted(times)
    # every read addresses the slot its block was last written to (no read of an empty slot)
    written = {off for _, op, off, _ in ops if op == "write"}
    assert all(off in written for _, op, off, _ in ops if op == "read")


def test_slots_are_reused_after_eviction(tmp_path: Path) -> None:
    with IologWriter(str(tmp_path / "l"), block_bytes=4096, version=2) as w:
        w.on_write("nvme", [1, 2, 3])
        w.on_evict("nvme", [2])
        w.on_write("nvme", [4])
        w.on_read("nvme", [4, 1])
        w.on_write("dram", [9])          # other tiers are not logged
    lines = (tmp_path / "l").read_text().splitlines()
    assert lines == ["fio version 2 iolog", "kvtool-nvme add", "kvtool-nvme open",
                     "kvtool-nvme write 0 4096", "kvtool-nvme write 4096 4096",
                     "kvtool-nvme write 8192 4096", "kvtool-nvme write 4096 4096",
                     "kvtool-nvme read 4096 4096", "kvtool-nvme read 0 4096", "kvtool-nvme close"]
    assert w.device_bytes == 3 * 4096


@pytest.mark.parametrize("version", ["2", "3"])
@pytest.mark.skipif(shutil.which("fio") is None, reason="fio is not installed")
def test_fio_replays_the_log(trace: Path, tmp_path: Path, version: str) -> None:
    log = tmp_path / "nvme.iolog"
    lg = replay(str(trace), "--dram", "20blk", "--nvme", "60blk", "--block-bytes", str(BB),
                "--iolog", str(log), "--iolog-version", version)["iolog"]
    dev = tmp_path / "dev.img"
    with open(dev, "wb") as f:
        f.truncate(lg["device_bytes"])
    out = subprocess.run(
        ["fio", "--name=kv", f"--read_iolog={log}", f"--replay_redirect={dev}",
         "--replay_no_stall=1", "--ioengine=psync", "--output-format=json"],
        capture_output=True, text=True, timeout=300, check=True).stdout
    job = json.loads(out[out.index("{"):])["jobs"][0]
    assert job["error"] == 0
    assert job["read"]["total_ios"] == lg["reads"] > 0
    assert job["write"]["total_ios"] == lg["writes"] > 0
    assert job["read"]["io_bytes"] == lg["read_bytes"]
    assert job["write"]["io_bytes"] == lg["write_bytes"]


def test_iolog_refusals(trace: Path, tmp_path: Path) -> None:
    log = str(tmp_path / "l")
    one_error_line(run("replay", "--simulate", str(trace), "--dram", "20blk",
                       "--block-bytes", "4096", "--iolog", log), "--nvme")
    one_error_line(run("replay", "--simulate", str(trace), "--nvme", "20blk", "--iolog", log),
                   "--block-bytes")
    one_error_line(run("replay", str(trace), "--nvme", "20blk", "--block-bytes", "4096",
                       "--iolog", log), "--simulate")
    one_error_line(run("replay", "--simulate", str(trace), "--nvme", "20blk",
                       "--block-bytes", "4096", "--compare", "nvme=10blk", "--iolog", log),
                   "--compare")
