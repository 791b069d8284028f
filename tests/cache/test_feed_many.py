"""``Replayer.feed_many``'s single-tier loop (the hierarchy's serve inlined, counters kept
per round in locals) reports exactly what ``feed`` reports one request at a time, for
every policy that takes that path and for those that do not; and ``discard`` evicts
exactly what ``evict`` does."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from kvtool.cache import CacheConfig, Replayer, TierSpec
from kvtool.cache.policies import POLICIES, LruPolicy, LruTailFirstPolicy, make_policy
from kvtool.trace import Request
from kvtool.units import Capacity


def trace(seed: int, n: int = 1500) -> list[Request]:
    """Sessions of chained keys, some without a session, some with explicit rounds,
    periods that change every few requests and revisit earlier ones."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        path = [rng.randrange(5) for _ in range(rng.randrange(0, 12))]
        keys = [hash((seed, *path[: j + 1])) & 0xFFFFFFFF for j in range(len(path))]
        session = None if rng.random() < 0.3 else rng.randrange(40)
        rnd = rng.choice([None, None, 1, 2, 3])
        period = None if rnd is not None else rng.choice([i // 50 + 1, max(1, i // 50 - 3)])
        inp = max(0, len(keys) * 16 - rng.randrange(0, 24))
        out.append(Request(float(i), inp, rng.randrange(0, 40), keys, 16, session, rnd,
                           i + 1, period))
    return out


SINGLE = [p for p in POLICIES if p != "vllm"]  # vllm manages a GPU tier: below


@pytest.mark.parametrize("policy", SINGLE)
@pytest.mark.parametrize("admit_after", [None, 2])
def test_feed_many_equals_feed(policy: str, admit_after: int | None) -> None:
    for seed in range(2):
        reqs = trace(seed)
        cfg = CacheConfig([TierSpec("dram", Capacity.parse("37blk"), policy=policy,
                                    admit_after=admit_after)])
        one = Replayer(cfg, 16, 4096)
        for r in reqs:
            one.feed(r)
        many = Replayer(cfg, 16, 4096)
        assert many.feed_many(reqs) == len(reqs)
        assert many.result() == one.result()
        assert many.real_rounds and many.cliff_round() == one.cliff_round()


def test_the_replayer_keeps_no_clock() -> None:
    """One time model (issue 38): the cache counts, its times are the serving model's."""
    for specs in ([TierSpec("dram", Capacity.parse("37blk"))],       # inline loop
                  [TierSpec("gpu", Capacity.parse("9blk")), TierSpec("dram", Capacity.parse("30blk"))]):
        rep = Replayer(CacheConfig(specs), 16, 4096)
        rep.feed_many(trace(3))
        res = rep.result()
        assert res["time_model"] is None
        for d in [res, *res["rounds"]]:
            assert all(d[k] is None for k in Replayer.TIME_KEYS)


def test_feed_many_takes_the_inline_path_for_one_plain_tier_only() -> None:
    def single(specs: list[TierSpec]) -> bool:
        return Replayer(CacheConfig(specs), 16).cache.single_tier() is not None

    dram = Capacity.parse("37blk")
    assert single([TierSpec("dram", dram)])
    assert single([TierSpec("dram", dram, policy="radix")])
    assert not single([TierSpec("dram", dram, policy="mooncake")])      # a watermark
    assert not single([TierSpec("dram", dram, policy="vllm-lru")])      # full blocks only
    assert not single([TierSpec("gpu", dram, policy="vllm")])           # a pooled policy
    assert not single([TierSpec("gpu", dram), TierSpec("dram", dram)])  # two tiers


@pytest.mark.parametrize("specs", [
    [TierSpec("gpu", Capacity.parse("30blk"), policy="vllm")],
    [TierSpec("gpu", Capacity.parse("9blk")), TierSpec("dram", Capacity.parse("30blk"))],
    [TierSpec("dram", Capacity.parse("30blk"), policy="mooncake")],
])
def test_feed_many_falls_back_to_feed(specs: list[TierSpec]) -> None:
    reqs = trace(7, 600)
    one = Replayer(CacheConfig(specs), 16)
    for r in reqs:
        one.feed(r)
    many = Replayer(CacheConfig(specs), 16)
    many.feed_many(reqs)
    assert many.result() == one.result()


@pytest.mark.parametrize("specs", [
    [TierSpec("dram", Capacity.parse("30blk"))],
    [TierSpec("gpu", Capacity.parse("9blk")), TierSpec("dram", Capacity.parse("30blk"))],
])
def test_feed_many_reports_progress_every_1024_requests(specs: list[TierSpec]) -> None:
    seen: list[int] = []
    rep = Replayer(CacheConfig(specs), 16)
    assert rep.feed_many(trace(3, 2100), seen.append) == 2100
    assert seen == [1024, 1024]


def test_feed_many_continues_a_replay_fed_before() -> None:
    reqs = trace(5, 900)
    cfg = CacheConfig([TierSpec("dram", Capacity.parse("25blk"))])
    one = Replayer(cfg, 16)
    for r in reqs:
        one.feed(r)
    mixed = Replayer(cfg, 16)
    for r in reqs[:300]:
        mixed.feed(r)
    mixed.feed_many(reqs[300:600])
    for r in reqs[600:]:
        mixed.feed(r)
    assert mixed.result() == one.result()


@pytest.mark.parametrize("name", sorted(set(POLICIES) - {"vllm"}))
def test_discard_evicts_what_evict_does(name: str) -> None:
    rng = random.Random(name)
    a, b = make_policy(name), make_policy(name)
    for p in (a, b):
        if hasattr(p, "capacity"):
            p.capacity = 50
    for i in range(3000):
        keys = [rng.randrange(300) for _ in range(rng.randrange(1, 9))]
        keys = list(dict.fromkeys(keys))
        assert a.access(keys, i % 7) == b.access(keys, i % 7)
        if len(a) > 50:
            want = a.evict(len(a) - 50)
            assert b.discard(len(b) - 50) == len(want)
        assert a.index.keys() == b.index.keys()


@pytest.mark.parametrize("cls", [LruPolicy, LruTailFirstPolicy])
def test_lru_discard_keeps_the_lru_order(cls: type[LruPolicy]) -> None:
    a, b = cls(), cls()
    rng = random.Random(11)
    for _ in range(5000):
        keys = [rng.randrange(400) for _ in range(rng.randrange(1, 6))]
        a.access(keys, 0)
        b.access(keys, 0)
        n = rng.randrange(0, 4)
        a.evict(n)
        b.discard(n)
        if rng.random() < 0.01:  # a key removed by hand leaves stale references
            a.index.pop(keys[0], None)
            b.index.pop(keys[0], None)
        assert a.index == b.index
    assert a.evict(len(a)) == b.evict(len(b))


def test_an_interrupted_feed_many_counts_what_it_served() -> None:
    reqs = trace(9, 700)
    cfg = CacheConfig([TierSpec("dram", Capacity.parse("25blk"))])

    def until_ctrl_c() -> Iterator[Request]:
        yield from reqs[:450]
        raise KeyboardInterrupt

    many = Replayer(cfg, 16)
    with pytest.raises(KeyboardInterrupt):
        many.feed_many(until_ctrl_c())
    one = Replayer(cfg, 16)
    for r in reqs[:450]:
        one.feed(r)
    assert many.result() == one.result()
