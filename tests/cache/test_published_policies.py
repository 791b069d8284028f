"""Textbook ARC, S3-FIFO, LFU and admission, step by step against their published rules
(docs/replay.md cites them). A tier of a few blocks is driven one reference at a time."""

from __future__ import annotations

from kvtool.cache import CacheConfig, Replayer, TierSpec
from kvtool.cache.policies import ArcPolicy, LfuPolicy, S3FifoPolicy
from kvtool.cache.replayer import RequestOutcome
from kvtool.cache.tier import Tier
from kvtool.units import Capacity
from tests.helpers.cache import req


def ref(tier: Tier, *keys: int) -> list[int]:
    """One request touching ``keys`` head → tail, then the tier's eviction."""
    tier.policy.access(list(keys), 0)
    out = tier.evict_to_capacity()
    assert len(tier) <= tier.capacity
    return out


def test_arc_follows_the_paper_cases() -> None:
    tier = Tier("dram", 4, ArcPolicy())
    arc = tier.policy
    assert isinstance(arc, ArcPolicy)
    for k in (1, 2):
        assert ref(tier, k) == []
    ref(tier, 1)                                      # case I: 1 moves to T2
    assert list(arc.t2) == [1] and list(arc.t1) == [2]
    ref(tier, 3)
    ref(tier, 4)
    assert ref(tier, 5) == [2]                        # case IV.B: REPLACE takes T1's LRU
    assert list(arc.b1) == [2] and arc.p == 0
    assert ref(tier, 2) == [3]                        # case II: p += 1, REPLACE, 2 → T2
    assert arc.p == 1 and list(arc.t2) == [1, 2] and list(arc.t1) == [4, 5]
    assert ref(tier, 6) == [4]                        # |T1| = 2 > p = 1: T1's LRU again
    ref(tier, 5)                                      # 5 → T2, T1 = [6]
    assert ref(tier, 7) == [1]                        # |T1| = 1, not > p: T2's LRU goes to B2
    assert list(arc.b2) == [1]
    assert ref(tier, 1) != [] and arc.p == 0           # case III: p falls back to 0
    assert 1 in arc.t2


def test_arc_keeps_a_frequent_block_through_a_scan() -> None:
    tier = Tier("dram", 4, ArcPolicy())
    for _ in range(3):
        ref(tier, 100)
    for k in range(1, 50):                            # a one-pass scan of 49 blocks
        ref(tier, k)
    assert 100 in tier


def test_s3fifo_small_queue_ghost_and_main() -> None:
    tier = Tier("dram", 10, S3FifoPolicy())
    s3 = tier.policy
    assert isinstance(s3, S3FifoPolicy)
    for k in range(1, 11):
        assert ref(tier, k) == []
    assert ref(tier, 11) == [1]                       # one-hit wonder leaves S for G
    assert list(s3.g) == [1]
    ref(tier, 2)
    ref(tier, 2)                                      # freq 2 (capped at 3)
    assert ref(tier, 12) == [3]                       # 2 is promoted to M, 3 goes
    assert 2 in s3.m and s3.m[2] == 2
    ref(tier, 1)                                      # ghost hit: re-inserted into M
    assert 1 in s3.m and 1 not in s3.g
    for _ in range(4):
        ref(tier, 2)
    assert s3.m[2] == 3


def test_s3fifo_main_queue_reinserts_until_frequency_runs_out() -> None:
    tier = Tier("dram", 10, S3FifoPolicy())
    for k in range(1, 11):
        ref(tier, k)
        ref(tier, k)
        ref(tier, k)          # freq 2: every block moves to M when S is evicted
    # S overflows: every block (freq 2) moves to M; M over its 9 blocks cycles, each
    # pass taking one off every frequency, until 1 reaches 0 and goes; EVICTS goes on
    # (a move to M is not an eviction) and sends 11 (freq 0) to G.
    assert ref(tier, 11) == [1, 11]
    s3 = tier.policy
    assert isinstance(s3, S3FifoPolicy)
    assert list(s3.g) == [11] and not s3.s and set(s3.m.values()) == {0}


def test_lfu_least_frequent_first_oldest_among_equals() -> None:
    tier = Tier("dram", 3, LfuPolicy())
    ref(tier, 1, 2, 3)
    ref(tier, 1)
    ref(tier, 1)
    ref(tier, 2)
    assert ref(tier, 4) == [3]                        # 3 and 4 have frequency 1; 3 is older
    assert ref(tier, 5) == [4]
    ref(tier, 5)
    ref(tier, 5)
    ref(tier, 5)                                      # 5: frequency 4, now above 1 (3) and 2 (2)
    assert ref(tier, 6) == [6]                        # a new block is the least frequent
    assert ref(tier, 7) == [7] and set(tier.policy.index) == {1, 2, 5}


def run(specs: list[TierSpec], stream: list[list[int]], B: int = 16) -> list[RequestOutcome]:
    out: list[RequestOutcome] = []
    rep = Replayer(CacheConfig(specs), B, on_request=out.append)
    for keys in stream:
        rep.feed(req(keys, block_tokens=B))
    return out


def test_admission_by_reuse_count_stores_on_the_nth_offer() -> None:
    for policy in ("lru", "s3fifo", "vllm-lru"):
        spec = TierSpec("dram", Capacity.parse("8blk"), policy, admit_after=2)
        o = run([spec], [[1, 2], [1, 2], [1, 2]])
        assert [x.blocks_written["dram"] for x in o] == [0, 2, 0], policy
        assert [x.hit_tokens["dram"] for x in o] == [0, 0, 32], policy


def test_admission_ttl_forgets_old_offers() -> None:
    spec = TierSpec("dram", Capacity.parse("8blk"), "lru", admit_after=2, admit_ttl=1)
    o = run([spec], [[1], [9], [1], [1]])
    # 1 is offered at requests 1, 3 and 4: 3 is 2 requests after 1 (> ttl), 4 is 1 after 3
    assert [x.blocks_written["dram"] for x in o] == [0, 0, 0, 1]
    spec = TierSpec("dram", Capacity.parse("8blk"), "lru", admit_after=2, admit_ttl=2)
    o = run([spec], [[1], [9], [1]])
    assert [x.blocks_written["dram"] for x in o] == [0, 0, 1]


def test_admission_in_a_lower_tier_only_counts_what_reaches_it() -> None:
    gpu = TierSpec("gpu", Capacity.parse("1blk"), "lru")
    dram = TierSpec("dram", Capacity.parse("8blk"), "lru", admit_after=2)
    o = run([gpu, dram], [[1, 2], [3], [1, 2]])
    assert [x.blocks_written["dram"] for x in o] == [0, 0, 2]


def test_every_policy_is_a_replay_choice() -> None:
    import click

    from kvtool.cache import POLICIES
    from kvtool.cache.names import POLICY_NAMES
    from kvtool.cli.replay import command

    assert tuple(POLICIES) == POLICY_NAMES
    [opt] = [p for p in command.params if p.name == "policy"]
    assert isinstance(opt.type, click.Choice) and tuple(opt.type.choices) == POLICY_NAMES
