"""The tier hierarchy's timed protocol (find, locate, read, put, lacks, held), which the
serving model's cluster tiers drive (kvtool.serving.sim.TierStack, issue 39's one core).

The oracle for each call is the policies themselves, asked one block at a time; several
hierarchies share their lower tiers, as a cluster's nodes share its pools. And a cluster
run's report counts are the sums of what its nodes' hierarchies counted.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtool.cache.hierarchy import TierHierarchy
from kvtool.cache.policies import make_policy
from kvtool.cache.stats import RoundStats
from kvtool.cache.tier import Tier
from kvtool.serving.load import Load
from kvtool.serving.setup import build_setup
from kvtool.serving.sim import Simulation
from kvtool.trace import read_trace

REPO = Path(__file__).resolve().parents[2]
POLICIES = ("lru", "lru-tail-first", "arc", "s3fifo", "lfu", "mooncake", "vllm")
KEYS = st.lists(st.integers(0, 30), min_size=0, max_size=12)


def _where(tiers: list[Tier], key: int, stale: set[tuple[str, int]]) -> int:
    for j, t in enumerate(tiers):
        if key in t and (t.name, key) not in stale:
            return j
    return -1


@st.composite
def scripts(draw: Any) -> tuple[list[str], list[int], list[tuple[Any, ...]]]:
    policies = [draw(st.sampled_from(POLICIES)) for _ in range(3)]
    caps = [draw(st.integers(2, 12)) for _ in range(3)]
    ops = draw(st.lists(st.tuples(st.sampled_from(("put", "read", "touch", "stale")),
                                  st.integers(0, 1), st.integers(0, 2), KEYS),
                        min_size=1, max_size=40))
    return policies, caps, ops


@pytest.mark.slow
@settings(max_examples=150, deadline=None)
@given(scripts())
def test_timed_protocol_matches_its_policies(script: tuple[Any, ...]) -> None:
    """Two nodes' hierarchies (own DRAM over a shared pool and a shared NVMe tier): every
    lookup is the policies' membership, every put counts its inserts and evictions."""
    policies, caps, ops = script
    pool = Tier("mooncake", caps[1], make_policy(policies[1]))
    nvme = Tier("nvme", caps[2], make_policy(policies[2]))
    drams = [Tier("dram", caps[0], make_policy(policies[0])) for _ in range(2)]
    stale: set[tuple[str, int]] = set()
    hiers = [TierHierarchy([d, pool, nvme], pooled=False, stale=stale) for d in drams]
    stats = [RoundStats(3) for _ in hiers]
    for op, node, i, keys in ops:
        h, tiers = hiers[node], [drams[node], pool, nvme]
        src = [_where(tiers, k, stale) for k in keys]
        lead = src[:src.index(-1)] if -1 in src else src
        assert h.locate(keys) == src
        assert h.find(keys) == lead
        assert h.held(i, keys) == [k for k in keys if k in tiers[i]]
        assert h.lacks(i, keys) == [k for k in keys if k not in tiers[i]
                                           or (tiers[i].name, k) in stale]
        n = 0
        for k in keys:
            if k not in tiers[i]:
                break
            n += 1
        assert h.held_prefix(i, keys) == n
        before = RoundStats(3)
        before.add(stats[node])
        if op == "put":
            name = tiers[i].name
            held_before = set(tiers[i].policy.index)
            stale_before = {k for k in keys if (name, k) in stale}
            repaired = h.repaired
            rec = h.put(i, keys, 0, stats[node], kept=True)
            after = set(tiers[i].policy.index)
            assert set(rec) <= after  # what it returns stayed
            assert not any((name, k) in stale for k in keys)  # rewritten or gone
            assert len(after) <= tiers[i].capacity
            assert h.repaired - repaired == len(stale_before)
            if policies[i] != "vllm":  # (a vLLM pool counts recomputed copies as written)
                written = set(keys) - held_before
                assert stats[node].blocks_written[i] - before.blocks_written[i] == len(written)
                assert stats[node].evictions[i] - before.evictions[i] == \
                    len((held_before | written) - after)
                assert sorted(set(rec)) == sorted((written | stale_before) & after)
        elif op == "read":
            held = h.held(i, keys)
            h.read(i, held, 0, stats[node])
            assert stats[node].blocks_read[i] - before.blocks_read[i] == len(held)
            assert stats[node].hit_blocks[i] - before.hit_blocks[i] == len(held)
            assert h.held(i, keys) == held  # a read admits nothing, evicts nothing
        elif op == "touch":
            held = h.held(i, keys)
            h.touch(i, keys, 0)
            assert h.held(i, keys) == held
        else:
            # a copy that failed its check (the stack marks held copies only)
            stale.update((tiers[i].name, k) for k in keys[:2] if k in tiers[i])


def test_a_pooled_policy_is_an_index_in_the_timed_protocol() -> None:
    """A cluster's pool may use the ``vllm`` policy: its hierarchies take it as an index."""
    pool = Tier("mooncake", 8, make_policy("vllm"))
    h = TierHierarchy([Tier("dram", 4, make_policy("lru")), pool], pooled=False)
    h.put(1, [1, 2, 3], 0, RoundStats(2))
    assert h.find([1, 2, 5, 3]) == [1, 1]


class _Mover:
    """Records what a timed mover is asked; fails the loads of ``bad`` keys."""

    def __init__(self, bad: set[int]) -> None:
        self.bad = bad
        self.calls: list[tuple[Any, ...]] = []

    def on_store(self, tier: str, keys: list[int], by: int) -> None:
        self.calls.append(("store", tier, list(keys), by))

    def on_load(self, tier: str, keys: list[int], by: int) -> list[int]:
        self.calls.append(("load", tier, list(keys), by))
        return [k for k in keys if k in self.bad]

    def on_evict(self, tier: str, keys: list[int]) -> None:
        self.calls.append(("evict", tier, list(keys)))


def test_the_timed_mover_frees_then_stores_and_failed_loads_go_stale() -> None:
    """Data mode's order: a put frees its victims' bytes before it writes the blocks that
    stayed; a load that fails its check makes the copy stale (a miss) until a put
    rewrites it (a repair), in every hierarchy sharing the tier."""
    stale: set[tuple[str, int]] = set()
    pool = Tier("mooncake", 3, make_policy("lru"))
    movers = [_Mover({2}), _Mover(set())]
    hiers = [TierHierarchy([Tier("dram", 2, make_policy("lru")), pool], pooled=False,
                           timed_mover=m, stale=stale) for m in movers]
    st = RoundStats(2)
    assert hiers[0].put(1, [1, 2, 3], 0, st, by=7, kept=True) == [1, 2, 3]
    assert movers[0].calls == [("store", "mooncake", [1, 2, 3], 7)]
    assert hiers[0].load(1, [1, 2], by=7) == [2]
    assert stale == {("mooncake", 2)}
    assert hiers[1].find([1, 2, 3]) == [1]  # the other node sees the stale copy too
    assert hiers[1].lacks(1, [1, 2, 3]) == [2]
    assert hiers[1].put(1, [2], 0, st, by=3, kept=True) == [2]
    assert hiers[1].repaired == 1 and not stale
    assert movers[1].calls == [("store", "mooncake", [2], 3)]
    hiers[1].put(1, [4], 0, st, by=3)  # evicts the oldest (1) first, then stores 4
    assert movers[1].calls[-2:] == [("evict", "mooncake", [1]), ("store", "mooncake", [4], 3)]
    assert st.evictions == [0, 1]


def test_cluster_counts_are_the_hierarchies() -> None:
    """A cluster run's tiers are its nodes' hierarchies: every node's holds the same shared
    tier objects, and what they counted accounts for what the tiers hold (blocks written
    minus blocks evicted is each tier's occupancy, read from the tier itself), for what
    the requests were told they hit (a loaded block is a counted read), and for the
    report's evictions."""
    reader = read_trace(str(REPO / "fixtures" / "traces" / "multiturn-8x12.jsonl"))
    requests = list(reader)
    seen = 0
    for name in ("gp7000-mini", "gp7000-read-dram", "wqs-pd-400-141g"):
        built = build_setup(str(REPO / "fixtures" / "clusters" / f"{name}.toml"),
                            block_tokens=reader.block_tokens)
        sim = Simulation(requests, built.setup, Load("concurrency", 4),
                         block_tokens=built.block_tokens, router=built.make_router(),
                         trace_block_tokens=reader.block_tokens)
        sim.run()
        stack = sim.tiers
        belows = list(stack.below.values())
        assert belows, name
        shared = [t for _n, t, _s in stack.shared]
        for below in belows:
            assert below.hier.tiers[len(below.hier.tiers) - len(shared):] == shared
        held: dict[int, int] = {}  # tier (by identity) -> written - evicted, over the nodes
        tiers: dict[int, Any] = {}
        for below in belows:
            for j, tier in enumerate(below.hier.tiers):
                tiers[id(tier)] = tier
                held[id(tier)] = held.get(id(tier), 0) + below.stats.blocks_written[j] \
                    - below.stats.evictions[j]
        assert held == {k: len(t) for k, t in tiers.items()}, name
        evicted = sum(sum(b.stats.evictions) for b in belows)
        assert sum(stack.to_dict()["evictions"].values()) == evicted
        loaded = sum(sum(b.stats.blocks_read) for b in belows)
        hits = sum(sum(s.ext_by_tier.values()) for s in sim.seqs if s is not None)
        assert loaded * built.block_tokens >= hits
        seen += loaded
    assert seen  # the fixtures load from the tiers below
