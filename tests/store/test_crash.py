"""SIGKILL ``kvtool load`` at random points, many times; every acknowledged object must
verify afterwards (docs/store.md: nothing committed is ever lost)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kvtool.store.engine import open_engine
from kvtool.store.objectstore import ObjectStore
from kvtool.store.verify import verify
from tests.conftest import REPO

OBJ = 1_002_240  # the bounce path
COUNT = 240
BATCH = 3


def _acked(ack_file: Path) -> set[int]:
    if not ack_file.exists():
        return set()
    keys: set[int] = set()
    for line in ack_file.read_text().splitlines():
        keys.update(int(k, 16) for k in json.loads(line)["keys"])
    return keys


def _commits(ack_file: Path) -> int:
    """Acknowledged commits so far: the ack file has one line per commit."""
    try:
        return ack_file.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def _stored(path: str) -> set[int]:
    e = open_engine(path, write=False)
    try:
        s = ObjectStore.open(e)
        keys = set(s.by_key)
        s.close()
        return keys
    finally:
        e.close()


def _wipe_head(path: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, bytes(1 << 20), 0)
        os.fsync(fd)
    finally:
        os.close(fd)


def kill_loop(path: str, ack_file: Path, iterations: int, rng: random.Random) -> dict[str, int]:
    cmd = [sys.executable, "-m", "kvtool", "-q", "load", path, "--object-bytes", str(OBJ),
           "--count", str(COUNT), "--qd", "4", "--batch", str(BATCH), "--seed", "11",
           "--ack-file", str(ack_file)]
    stats = {"killed": 0, "completed": 0, "acked_max": 0}
    for _ in range(iterations):
        commits_before = _commits(ack_file)
        # the kill point is counted in this run's own commits, not in seconds, so that it
        # lands mid-load however fast the machine is: at least one batch is always left
        batches_left = -(-(COUNT - len(_acked(ack_file))) // BATCH)
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE)
        if rng.random() < 0.25:
            time.sleep(rng.uniform(0.0, 0.3))  # anywhere: start-up, format, first writes
        elif batches_left > 1:  # mid-load: after k of this run's commits
            target = commits_before + rng.randint(1, batches_left - 1)
            deadline = time.monotonic() + 30
            while (proc.poll() is None and time.monotonic() < deadline
                   and _commits(ack_file) < target):
                time.sleep(0.002)
        else:  # one batch left: let it finish, so the next runs start over from empty
            proc.wait(timeout=60)
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            stats["killed"] += 1
        _, err = proc.communicate(timeout=60)
        if proc.returncode not in (0, -signal.SIGKILL):
            pytest.fail(f"load failed: {err.decode()}")
        acked = _acked(ack_file)
        stats["acked_max"] = max(stats["acked_max"], len(acked))
        if not acked and proc.returncode == -signal.SIGKILL:
            continue  # killed before anything was acknowledged (maybe before formatting)
        report = verify(path, qd=4)
        assert report["ok"], report["bad"][:5]
        missing = acked - _stored(path)
        assert not missing, f"{len(missing)} acknowledged objects lost"
        if proc.returncode == 0:
            stats["completed"] += 1
            assert len(_stored(path)) == COUNT
            _wipe_head(path)  # start over so later kills land mid-load again
            ack_file.unlink()
    return stats


@pytest.mark.slow
def test_sigkill_during_load_on_a_file(blank_file: Callable[[int], Path], store_dir: Path) -> None:
    path = str(blank_file(COUNT * OBJ + (4 << 20)))
    stats = kill_loop(path, store_dir / "acks.jsonl", 24, random.Random(1234))
    assert stats["killed"] >= 12, stats  # most iterations really were cut short
    assert stats["acked_max"] > 0, stats


@pytest.mark.slow
@pytest.mark.root
@pytest.mark.integration
def test_sigkill_during_load_on_a_4k_loop_device(loop_device: Callable[..., str],
                                                 store_dir: Path) -> None:
    dev = loop_device(COUNT * 1_003_520 + (4 << 20), 4096)
    stats = kill_loop(dev, store_dir / "acks.jsonl", 8, random.Random(99))
    assert stats["killed"] >= 4, stats
