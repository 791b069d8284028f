"""Each policy's eviction order on tiny hand-built cases."""

from __future__ import annotations

import math

import pytest

from kvtool.cache import (
    LruPolicy,
    LruTailFirstPolicy,
    OraclePolicy,
    PrefixFairPolicy,
    RadixPolicy,
    Tier,
    Watermark,
    make_policy,
)


def play(policy, cap: int, requests: list[tuple[list[int], int]]) -> list[int]:
    """Access each (keys, session) then evict to ``cap``; return all evicted keys in order."""
    tier = Tier("dram", cap, policy)
    evicted: list[int] = []
    for keys, session in requests:
        policy.access(keys, session)
        evicted += tier.evict_to_capacity()
    return evicted


def test_lru_evicts_chain_heads_first_and_leaves_dead_suffix() -> None:
    p = LruPolicy()
    assert play(p, 3, [([1, 2, 3], 0), ([6, 7], 1)]) == [1, 2]
    assert set(p.index) == {3, 6, 7}  # 3 is dead: its prefix is gone


def test_lru_tail_first_evicts_tails_first() -> None:
    p = LruTailFirstPolicy()
    assert play(p, 3, [([1, 2, 3], 0), ([6, 7], 1)]) == [3, 2]
    assert set(p.index) == {1, 6, 7}


def test_lru_touch_refreshes_whole_chain() -> None:
    p = LruPolicy()
    # 1,2 re-touched by the second request, so 3 is now least recent... but 1 was touched
    # first within that request: head-first order puts 1 before 2.
    assert play(p, 3, [([1, 2], 0), ([3], 1), ([1, 2], 0), ([4], 1)]) == [3]
    assert play(p, 2, [([5], 2)]) == [1, 2]


def test_radix_evicts_only_leaves() -> None:
    p = RadixPolicy()
    assert play(p, 3, [([1, 2, 3], 0), ([6, 7], 1)]) == [3, 2]
    assert set(p.index) == {1, 6, 7}


def test_radix_keeps_shared_head_until_children_go() -> None:
    p = RadixPolicy()
    # 1 is the shared head of two chains: the oldest block, but it has children.
    ev = play(p, 4, [([1, 2, 3], 0), ([1, 4, 5], 1), ([9], 2)])
    assert ev == [3, 2]       # the LRU leaf, then its parent once it became a leaf
    ev = Tier("dram", 2, p).evict_to_capacity()
    assert ev == [5, 4]       # chain 1-4-5 shrinks from its tail; head 1 stays
    assert set(p.index) == {1, 9}


def test_radix_never_evicts_a_block_with_a_cached_child() -> None:
    p = RadixPolicy()
    tier = Tier("dram", 5, p)
    import random

    rng = random.Random(3)
    for i in range(300):
        head = rng.randrange(5)
        keys = [head * 1000 + j for j in range(rng.randrange(1, 6))]
        p.access(keys, i)
        tier.evict_to_capacity()
        for k in p.index:
            j = k % 1000
            if j:  # its parent must be cached too
                assert k - 1 in p.index, (i, sorted(p.index))


def test_prefix_fair_trims_deepest_tail_first() -> None:
    p = PrefixFairPolicy()
    assert play(p, 5, [([1, 2, 3, 4], 0), ([5, 6], 1)]) == [4]
    lru = LruPolicy()
    assert play(lru, 5, [([1, 2, 3, 4], 0), ([5, 6], 1)]) == [1]


def test_prefix_fair_chooses_among_the_oldest_window_only() -> None:
    # Chains a (depth 3, oldest), b (depth 1), c (depth 4, newest).
    reqs = [([1, 2, 3], 0), ([10], 1), ([20, 21, 22, 23], 2)]
    wide = PrefixFairPolicy(window=128)
    assert play(wide, 7, reqs) == [23]        # every leaf competes: the deepest goes
    narrow = PrefixFairPolicy(window=2)
    assert play(narrow, 7, reqs) == [3]       # only leaves 3 and 10 compete
    one = PrefixFairPolicy(window=1)
    assert play(one, 7, reqs) == [3]          # window 1 is leaf-only LRU (radix)
    assert play(RadixPolicy(), 7, reqs) == [3]


def test_oracle_keeps_earliest_sessions() -> None:
    p = OraclePolicy()
    ev = play(p, 4, [([1, 2], 0), ([3, 4], 1), ([5, 6], 2)])
    assert ev == [6, 5]
    ev = play(p, 4, [([1, 2, 7], 0)])
    assert ev == [4]          # lowest-ranked holder (session 1), tail first
    assert set(p.index) == {1, 2, 3, 7}


def test_watermark_batch_eviction() -> None:
    tier = Tier("dram", 100, LruPolicy(), watermark=Watermark(0.9, 0.05))
    tier.policy.access(list(range(90)), 0)
    assert tier.overflow() == 0
    tier.policy.access([90], 0)
    # used 91 > 90: fraction max(0.05, 0.91 - 0.9 + 0.05) = 0.06 of 91 → 6
    assert tier.overflow() == 6
    assert tier.evict_to_capacity() == [0, 1, 2, 3, 4, 5]
    assert len(tier) == 85


def test_mooncake_policy_implies_watermark() -> None:
    from kvtool.cache import TierSpec
    from kvtool.units import Capacity

    spec = TierSpec("dram", Capacity.parse("100blk"), "mooncake")
    assert spec.watermark == Watermark(0.9, 0.05)


@pytest.mark.parametrize("name", ["lru", "lru-tail-first", "radix", "prefix-fair", "oracle",
                                  "mooncake"])
def test_every_policy_respects_capacity_and_admission(name: str) -> None:
    p = make_policy(name)
    tier = Tier("dram", 7, p)
    for i in range(50):
        keys = [i % 4 * 100 + j for j in range(i % 6 + 1)]
        p.access(keys, i % 4)
        tier.evict_to_capacity()
        assert len(tier) <= 7
    assert p.access([9999], 0, admit=False) == 0 and 9999 not in p
    assert p.access([9998], 0, skip={9998}) == 0 and 9998 not in p
    rec: list[int] = []
    assert p.access([9997], 0, record=rec) == 1 and rec == [9997]


def test_unbounded_tier_never_evicts() -> None:
    tier = Tier("nvme", math.inf, LruPolicy())
    tier.policy.access(list(range(1000)), 0)
    assert tier.evict_to_capacity() == []


@pytest.mark.parametrize("cls", [RadixPolicy, PrefixFairPolicy])
def test_chain_records_follow_cached_blocks_not_all_blocks_seen(cls) -> None:
    p = cls()
    tier = Tier("dram", 100, p)
    for i in range(20_000):
        p.access([i * 10 + j for j in range(5)], i)   # 100,000 distinct blocks
        tier.evict_to_capacity()
    assert len(p.parent) <= 4 * 100 + 65536 + 5
    assert len(p.depth) <= 4 * 100 + 65536 + 5
    assert p.heap_entries <= 4 * 100 + 4096 + 5
    if isinstance(p, PrefixFairPolicy):
        assert all(k in p.depth for k in p.index)
