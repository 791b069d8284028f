"""The data tiers on their own: DRAM pool, GPU block pool, NVMe tier on a real O_DIRECT
file, and the tier option syntax."""

from __future__ import annotations

import numpy as np
import pytest

from kvtool.errors import UsageError
from kvtool.store.engine import open_engine
from kvtool.store.payload import Payload
from kvtool.tiers import DramTier, GpuBlockPool, TierOption
from kvtool.tiers.nvme import NvmeTier

BB = 1_002_240  # DeepSeek-V4-Flash FP8, 256 tokens: ≡ 256 (mod 512), the bounce path


def blocks(keys: list[int], nbytes: int = BB) -> list[np.ndarray]:
    p = Payload(nbytes, 7)
    out = []
    for k in keys:
        a = np.empty(nbytes, dtype=np.uint8)
        p.fill(k, a)
        out.append(a)
    return out


def test_dram_round_trip_and_eviction() -> None:
    t = DramTier(3, 4096)
    src = blocks([1, 2, 3], 4096)
    t.complete_store(t.prepare_store([1, 2, 3], src))
    assert t.lookup([1, 2, 3, 4]) == 3
    dst = [np.zeros(4096, np.uint8) for _ in range(3)]
    assert t.complete_load(t.prepare_load([3, 9, 1], dst)) == [True, False, True]
    assert np.array_equal(dst[0], src[2]) and np.array_equal(dst[2], src[0])
    with pytest.raises(RuntimeError):
        t.prepare_store([4], blocks([4], 4096))
    t.evict([2])
    t.prepare_store([4], blocks([4], 4096))
    assert 4 in t and 2 not in t


def test_gpu_pool_reference_counts_and_free_queue() -> None:
    pool = GpuBlockPool(4, 64)
    a, b = pool.allocate(2)
    pool.cache(10, a)
    pool.cache(11, b)
    pool.release([a, b])  # cached, no request holds them: neither is free
    assert pool.free_blocks == 2
    pool.touch([a])  # a request uses block a
    pool.uncache(10)  # evicted while in use: freed when the request lets go
    assert pool.free_blocks == 2 and 10 not in pool
    pool.release([a])
    assert pool.free_blocks == 3
    pool.uncache(11)
    assert pool.free_blocks == 4
    with pytest.raises(RuntimeError):
        pool.allocate(5)


def test_nvme_tier_on_odirect_file(blank_file) -> None:  # type: ignore[no-untyped-def]
    path = blank_file(64 << 20)
    engine = open_engine(str(path), write=True, qd=8)
    tier = NvmeTier(engine, block_bytes=BB, url=str(path), read_qd=4, write_qd=4)
    try:
        keys = list(range(100, 120))
        src = blocks(keys)
        job = tier.prepare_store(keys, src)
        for a in src:  # the tier copied them: the caller's rows may change at once
            a[:] = 0
        tier.complete_store(job)
        dst = [np.empty(BB, np.uint8) for _ in keys]
        assert all(tier.complete_load(tier.prepare_load(keys, dst)))
        for k, d in zip(keys, dst, strict=True):
            assert np.array_equal(d, blocks([k])[0])
        tier.evict(keys[:5])
        assert tier.lookup(keys) == 0 and tier.lookup(keys[5:]) == 15
        # a read right after a write of the same key waits for that write
        new = blocks([999])
        tier.prepare_store([999], new)
        out = [np.empty(BB, np.uint8)]
        assert tier.complete_load(tier.prepare_load([999], out)) == [True]
        assert np.array_equal(out[0], new[0])
    finally:
        tier.close()


@pytest.mark.parametrize(("text", "cap", "place"), [
    ("1GiB", "1 GiB", None),
    ("300blk", "300blk", None),
    ("nvme+tcp://127.0.0.1:4420/nqn.2026-01.io.kvtool:demo/1", None,
     "nvme+tcp://127.0.0.1:4420/nqn.2026-01.io.kvtool:demo/1"),
    ("/dev/loop3", None, "/dev/loop3"),
    ("2GiB@/var/tmp/kv.img", "2 GiB", "/var/tmp/kv.img"),
    ("2GiB@nvme+tcp://127.0.0.1:4420/n/1", "2 GiB", "nvme+tcp://127.0.0.1:4420/n/1"),
])
def test_tier_option_syntax(text: str, cap: str | None, place: str | None) -> None:
    opt = TierOption.parse(text, tier="nvme")
    assert (str(opt.capacity) if opt.capacity else None) == cap
    assert opt.place == place


def test_tier_option_errors() -> None:
    with pytest.raises(UsageError, match="mooncake://"):
        TierOption.parse("1GiB@tmp/x", tier="dram")  # a relative path
    with pytest.raises(UsageError, match="mooncake://"):
        TierOption.parse("1GiB@nvme+tcp://127.0.0.1:4420/nqn.x/1", tier="dram")
    shm = TierOption.parse("1GiB@/dev/shm/kv", tier="dram")  # a shared-memory pool
    assert shm.place == "/dev/shm/kv" and str(shm.capacity) == "1 GiB"
    with pytest.raises(UsageError, match="local pool"):
        TierOption.parse("1GiB@/tmp/x", tier="gpu")
    assert TierOption.parse("mooncake://127.0.0.1:50051", tier="dram").capacity is None
    with pytest.raises(UsageError, match="nvme\\+tcp"):
        TierOption.parse("mooncake://127.0.0.1:50051", tier="nvme")
    opt = TierOption.parse("1GiB@mooncake://127.0.0.1:50051", tier="dram")
    assert opt.place == "mooncake://127.0.0.1:50051" and str(opt.capacity) == "1 GiB"
    with pytest.raises(UsageError, match="SIZE@PLACE"):
        TierOption.parse("@/tmp/x", tier="nvme")
    with pytest.raises(UsageError, match="not a size"):
        TierOption.parse("lots", tier="dram")
    assert str(TierOption.parse("2GiB@/x.img", tier="nvme")) == "2 GiB@/x.img"


def test_nvme_tier_batches_reads_into_aligned_rows_and_stages_the_rest(
        blank_file, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A block of whole LBAs is read straight into an aligned row, through the read_qd
    staging buffers otherwise (in several batches when there are more such rows); a
    request storing more blocks than staging buffers exist grows them up to the cap,
    then sends what is staged and waits for buffers to come back."""
    from kvtool.store.io import AlignedBuffer
    from kvtool.tiers import nvme as nvme_mod

    bb = 32768
    monkeypatch.setattr(nvme_mod, "WRITE_STAGING_BYTES", 6 * bb)  # 6 staging buffers at most
    path = blank_file(64 << 20)
    engine = open_engine(str(path), write=True, qd=4)
    tier = NvmeTier(engine, block_bytes=bb, url=str(path), read_qd=3, write_qd=2)
    try:
        keys = list(range(1, 16))
        src = blocks(keys, bb)
        job = tier.prepare_store(keys, src)
        assert len(job.futures) >= 3  # 15 blocks, 6 buffers: at least three batches
        tier.complete_store(job)
        arena = AlignedBuffer(len(keys) * bb)
        rows = np.frombuffer(arena.view, dtype=np.uint8).reshape(len(keys), bb)
        assert tier._direct(rows[0]) is not None
        odd = [np.empty(bb + 1, np.uint8)[1:] for _ in keys]  # misaligned: staged
        assert tier._direct(odd[0]) is None
        dsts = [rows[i] if i % 2 else odd[i] for i in range(len(keys))]
        assert tier.complete_load(tier.prepare_load([*keys, 999], [*dsts, odd[0]])) == [
            True] * len(keys) + [False]
        for k, d in zip(keys, dsts, strict=True):
            assert np.array_equal(d, blocks([k], bb)[0])
    finally:
        tier.close()


class _FailingWrites:
    """An engine whose batched writes land but report a failure (a medium error)."""

    def __init__(self, engine) -> None:  # type: ignore[no-untyped-def]
        self._e = engine
        self.fail = False

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return getattr(self._e, name)

    def submit_writes(self, items, **kw):  # type: ignore[no-untyped-def]
        from concurrent.futures import Future

        fut = self._e.submit_writes(items, **kw)
        if not self.fail:
            return fut
        fut.exception(10)  # the writes land (waiting drives their completion) ...
        out: Future[None] = Future()
        out.set_exception(OSError(5, "medium error"))  # ... and report a medium error
        return out


def test_durable_nvme_tier_failed_batch_loses_nothing_acknowledged(
        blank_file) -> None:  # type: ignore[no-untyped-def]
    """A committed batch survives a later batch whose writes fail: that batch fails the
    tier and is never committed, and the reopened store holds exactly the first one,
    each block matching the CRC32C it was committed with."""
    from kvtool.store.checksum import crc32c
    from kvtool.tiers.base import TierError

    bb = 32768
    path = blank_file(64 << 20)
    engine = _FailingWrites(open_engine(str(path), write=True, qd=4))
    tier = NvmeTier(engine, block_bytes=bb, url=str(path), durable=True)  # type: ignore[arg-type]
    first = list(range(1, 10))
    tier.complete_store(tier.prepare_store(first, blocks(first, bb)))
    assert tier.commit_pending() == len(first)
    engine.fail = True
    job = tier.prepare_store([50, 51, 52], blocks([50, 51, 52], bb))
    with pytest.raises(TierError, match="medium error"):
        tier.complete_store(job)
    with pytest.raises(TierError):
        tier.commit_pending()
    tier.close()
    again = NvmeTier(open_engine(str(path), write=True, qd=4), block_bytes=bb, url=str(path),
                     durable=True)
    try:
        assert sorted(again.persisted_crcs()) == first
        dst = [np.empty(bb, np.uint8) for _ in first]
        assert all(again.complete_load(again.prepare_load(first, dst)))
        for k, d in zip(first, dst, strict=True):
            assert crc32c(d) == again.persisted_crcs()[k] == crc32c(blocks([k], bb)[0])
    finally:
        again.close()


def test_nvme_tier_full_mid_request_keeps_what_it_staged(
        blank_file) -> None:  # type: ignore[no-untyped-def]
    """The slots run out halfway through a request's blocks: the ones staged before are
    written and held (as if stored one by one), the error is the caller's."""
    bb = 32768
    path = blank_file(64 << 20)
    tier = NvmeTier(open_engine(str(path), write=True, qd=4), block_bytes=bb, url=str(path),
                    max_slots=5)
    try:
        keys = list(range(1, 9))
        with pytest.raises(RuntimeError, match="slots in use"):
            tier.prepare_store(keys, blocks(keys, bb))
        assert len(tier) == 5
        dst = [np.empty(bb, np.uint8) for _ in range(5)]
        assert all(tier.complete_load(tier.prepare_load(keys[:5], dst)))
        for k, d in zip(keys, dst, strict=False):
            assert np.array_equal(d, blocks([k], bb)[0])
    finally:
        tier.close()


def test_nvme_tier_records_the_callers_checksums(blank_file) -> None:  # type: ignore[no-untyped-def]
    """Given the CRC32C of each source block (the data mover's), the tier commits those:
    a reopened store's entries hold them, and they match the bytes on the medium."""
    from kvtool.store.checksum import crc32c

    bb = 32768
    path = blank_file(64 << 20)
    keys = [5, 6, 7]
    src = blocks(keys, bb)
    want = [crc32c(a) for a in src]
    tier = NvmeTier(open_engine(str(path), write=True, qd=4), block_bytes=bb, url=str(path),
                    durable=True)
    tier.complete_store(tier.prepare_store(keys, src, crcs=want))
    assert tier.commit_pending() == 3
    tier.close()
    again = NvmeTier(open_engine(str(path), write=True, qd=4), block_bytes=bb, url=str(path),
                     durable=True)
    try:
        assert again.persisted_crcs() == dict(zip(keys, want, strict=True))
        dst = [np.empty(bb, np.uint8) for _ in keys]
        assert all(again.complete_load(again.prepare_load(keys, dst)))
        assert [crc32c(d) for d in dst] == want
    finally:
        again.close()


def test_shm_pool_records_the_callers_checksums(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The shared DRAM pool records the CRC32C the caller took of each source block (the
    data mover's, which loads are checked against) rather than a second pass over the row;
    without them it takes its own. A reopened pool keeps what was recorded."""
    from kvtool.store.checksum import crc32c
    from kvtool.tiers.shm import ShmDramTier

    bb = 4096
    place = str(tmp_path / "pool")
    tier = ShmDramTier(place, 8, bb)
    keys = [11, 12, 13]
    src = blocks(keys, bb)
    given = [crc32c(a) for a in src]
    given[1] ^= 1  # not the row's: recorded as given (a load checked against it fails)
    tier.complete_store(tier.prepare_store(keys, src, crcs=given))
    tier.complete_store(tier.prepare_store([14], blocks([14], bb)))
    tier.close()
    again = ShmDramTier(place, 8, bb)
    try:
        assert again.persisted_crcs() == {**dict(zip(keys, given, strict=True)),
                                          14: crc32c(blocks([14], bb)[0])}
    finally:
        again.close()


class _CountingReads:
    """An engine that records the number of reads in each batch it is given."""

    def __init__(self, engine) -> None:  # type: ignore[no-untyped-def]
        self._e = engine
        self.batches: list[int] = []

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return getattr(self._e, name)

    def submit_reads(self, items, **kw):  # type: ignore[no-untyped-def]
        self.batches.append(len(items))
        return self._e.submit_reads(items, **kw)


def test_nvme_tcp_tier_checksums_blocks_as_they_arrive(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Over NVMe/TCP (kvtool's target, a real socket) a load asked for checksums gets the
    CRC32C of every block it read, taken on the engine's thread as each one arrived —
    straight-read rows and staged ones alike, missing keys none — and the first reads go
    to the engine on their own, before the rest. The data mover checks loads against
    those: a block changed on the medium is caught as corrupt, the others verified."""
    from kvtool.store.checksum import crc32c
    from kvtool.store.io import AlignedBuffer
    from kvtool.tiers import nvme as nvme_mod
    from kvtool.tiers.mover import DataCounters, DataMover
    from tests.helpers.engines import emulator_target

    bb = 32768
    keys = list(range(1, 12))
    src = blocks(keys, bb)
    with emulator_target("nqn.2026-01.io.kvtool:crcs", tmp_path) as t:
        engine = _CountingReads(open_engine(t["url"], write=True, qd=8))
        tier = NvmeTier(engine, block_bytes=bb, url=t["url"], read_qd=3, durable=True)
        try:
            tier.complete_store(tier.prepare_store(keys, src))
            arena = AlignedBuffer(len(keys) * bb)
            rows = np.frombuffer(arena.view, dtype=np.uint8).reshape(len(keys), bb)
            odd = [np.empty(bb + 1, np.uint8)[1:] for _ in keys]  # not writable in place
            dsts = [rows[i] if i % 3 else odd[i] for i in range(len(keys))]
            job = tier.prepare_load([*keys, 999], [*dsts, odd[0]], checksum=True)
            assert tier.complete_load(job) == [True] * len(keys) + [False]
            assert job.crcs == [crc32c(a) for a in src] + [None]
            assert engine.batches[0] == nvme_mod.EARLY_READS < len(keys)
            assert sum(engine.batches) == len(keys)
            # without checksum=True nothing is taken
            job = tier.prepare_load(keys[:3], dsts[:3])
            tier.complete_load(job)
            assert job.crcs is None

            mover = DataMover(["nvme"], {"nvme": tier}, holds=lambda _j, k: k in tier,
                              source="engine", checksums=True)
            assert mover.crcs is not None
            mover.crcs["nvme"].update({k: crc32c(a) for k, a in zip(keys, src, strict=True)})
            bad = np.full(bb, 0x5A, np.uint8)
            engine.write_from(tier.sb.slot_offset(tier.slot_of[keys[4]]), memoryview(bad))
            counters = DataCounters()
            problems: list[tuple[str, int, str]] = []
            got = mover.load(keys, ["nvme"] * len(keys), dsts, None, counters,
                             lambda kind, key, name: problems.append((kind, key, name)))
            assert [(f.pos, f.kind, f.served) for f in got] == [(4, "corrupt", None)]
            assert problems == [("corrupt", keys[4], "nvme")]
            assert counters.verified_blocks == len(keys) - 1
        finally:
            tier.close()
