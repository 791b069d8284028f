"""The block store an engine integration drives (:mod:`kvtool.integrations.blockstore`),
on its own: no engine needed."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvtool.integrations.blockstore import BlockStore
from kvtool.integrations.readonly import held_keys
from kvtool.integrations.spec import StoreSpec
from kvtool.store.layout import Geometry

BB = 32768
IDENTITY = Geometry(model="test", dtype="float32", block_tokens=32, tp=1)


def _store(spec: StoreSpec) -> BlockStore:
    return BlockStore(spec, block_bytes=BB, block_tokens=32, request_blocks=16,
                      identity=IDENTITY)


def _rows(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, BB), dtype=np.uint8)


def _committed(spec: StoreSpec) -> set[int]:
    """The keys the NVMe tier's place holds in its committed index (what a new process,
    or a crashed one's successor, finds)."""
    return dict(held_keys(spec))["nvme"]


@pytest.mark.parametrize("interval", [0.0, 3600.0])
def test_steps_commit_at_most_every_interval(tmp_path: Path, interval: float) -> None:
    """An engine step's blocks are written at once and committed once ``commit_interval``
    has passed since the last commit (0: every step); in between, the store serves them
    (loads checked, from its own index) and the medium's committed index lacks them, so
    a crash then loses them (misses), never serves them wrong. ``close`` commits."""
    spec = StoreSpec.parse({"nvme": f"64MiB@{tmp_path / 'kv.img'}",
                            "commit_interval": interval})
    rows = _rows(4, 1)
    keys = [11, 12, 13, 14]
    st = _store(spec)
    try:
        st.save(keys, 4 * 32, lambda k: rows[keys.index(k)])
        st.step_done()
        assert _committed(spec) == (set(keys) if interval == 0 else set())
        assert st.lookup(keys) == ["nvme"] * 4
        out = np.zeros((4, BB), np.uint8)
        assert st.load(keys, ["nvme"] * 4, list(out)) == [True] * 4
        assert np.array_equal(out, rows)
        assert st.report()["commits"] == (1 if interval == 0 else 0)
    finally:
        st.close()
    assert _committed(spec) == set(keys)
    again = _store(spec)
    try:
        assert again.report()["tiers"][0]["reopened_blocks"] == 4
    finally:
        again.close()


def test_a_step_past_the_interval_commits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first step after ``commit_interval`` seconds commits what every step since the
    last commit stored, in one commit."""
    import time
    from types import SimpleNamespace

    from kvtool.integrations import blockstore

    now = [1000.0]
    # the block store's clock only (not the time module of every thread)
    monkeypatch.setattr(blockstore, "time", SimpleNamespace(
        monotonic=lambda: now[0], perf_counter=time.perf_counter))
    spec = StoreSpec.parse({"nvme": f"64MiB@{tmp_path / 'kv.img'}", "commit_interval": 1})
    rows = _rows(3, 2)
    st = _store(spec)
    try:
        for step, key in enumerate([21, 22, 23]):
            st.save([key], 32, lambda _k, r=rows[step]: r)
            now[0] += 0.4
            st.step_done()
            assert _committed(spec) == ({21, 22, 23} if step == 2 else set())
        assert st.report()["commits"] == 1
    finally:
        st.close()
