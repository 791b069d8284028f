"""Invariants on random request streams (hypothesis), and the fast paths against the
general path of the hierarchy (a no-op mover forces the general path)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtool.cache import POLICIES, CacheConfig, NullMover, Replayer, TierSpec, make_policy
from kvtool.units import Capacity
from tests.helpers.cache import req

B = 16

# Requests: chains drawn from a small prefix tree, so prefixes are shared and reused.
chains = st.lists(st.integers(0, 3), min_size=1, max_size=8).map(
    lambda path: [hash(tuple(path[: i + 1])) & 0xFFFFFFFF for i in range(len(path))])
streams = st.lists(st.tuples(chains, st.integers(0, 4), st.integers(0, B - 1)),
                   min_size=1, max_size=60)
capacity = st.one_of(st.integers(1, 12).map(lambda n: f"{n}blk"), st.just("inf"))
tier_sets = st.lists(st.sampled_from(["gpu", "dram", "nvme"]), min_size=1, max_size=3,
                     unique=True)


def build(tiers: list[str], caps: list[str], policy: str, write_policy: str) -> CacheConfig:
    return CacheConfig([TierSpec(t, Capacity.parse(c), tier_policy(policy, t, c))
                        for t, c in zip(tiers, caps, strict=False)],
                       write_policy)  # type: ignore[arg-type]


def tier_policy(policy: str, tier: str, cap: str) -> str:
    """``vllm`` is the GPU tier's block pool (finite, with a null block): other tiers, and a
    GPU tier too small or unbounded for it, get ``lru`` in a ``vllm`` configuration."""
    if policy == "vllm" and (tier != "gpu" or cap in ("inf", "1blk")):
        return "lru"
    return policy


def run(cfg: CacheConfig, stream: list[tuple[list[int], int, int]], general: bool) -> Replayer:
    movers = {t.name: NullMover() for t in cfg.tiers} if general else None
    r = Replayer(cfg, B, movers=movers)  # type: ignore[arg-type]
    for keys, session, cut in stream:
        r.feed(req(keys, session=session, block_tokens=B,
                   input_length=len(keys) * B - cut))
        for tier in r.cache.tiers:
            assert len(tier) <= tier.capacity
    return r


@pytest.mark.slow
@settings(max_examples=150, deadline=None)
@given(stream=streams, tiers=tier_sets, caps=st.lists(capacity, min_size=3, max_size=3),
       policy=st.sampled_from(sorted(POLICIES)),
       write_policy=st.sampled_from(["write-through", "write-back"]))
def test_invariants_and_fast_paths(stream: list[tuple[list[int], int, int]], tiers: list[str],
                                   caps: list[str], policy: str, write_policy: str) -> None:
    cfg = build(tiers, caps, policy, write_policy)
    fast = run(cfg, stream, general=False).result()
    slow = run(cfg, stream, general=True).result()
    assert fast == slow
    assert fast["hit_tokens"]["total"] + fast["recompute_tokens"] == fast["input_tokens"]
    assert fast["hit_tokens"]["total"] == sum(fast["hit_tokens"][t] for t in cfg_names(cfg))
    assert all(v >= 0 for v in fast["hit_tokens"].values())


def cfg_names(cfg: CacheConfig) -> list[str]:
    return [t.name for t in cfg.tiers]


@pytest.mark.slow
@settings(max_examples=100, deadline=None)
@given(stream=streams, policy=st.sampled_from(sorted(POLICIES)))
def test_unbounded_tier_reaches_the_maximum_whatever_the_policy(
        stream: list[tuple[list[int], int, int]], policy: str) -> None:
    other = run(build(["dram"], ["inf"], policy, "write-through"), stream, False).result()
    if getattr(make_policy(policy), "full_blocks_only", False):
        # vLLM's offloading stores full blocks only: its maximum is LRU's on full blocks
        # (same input lengths, the partial last block dropped)
        stream = [(keys[:-1], s, cut - B) if cut else (keys, s, cut) for keys, s, cut in stream]
    best = run(build(["dram"], ["inf"], "lru", "write-through"), stream, False).result()
    assert other["token_hit_ratio"] == best["token_hit_ratio"]
    # and a bounded tier never beats it
    small = run(build(["dram"], ["3blk"], policy, "write-through"), stream, False).result()
    assert small["hit_tokens"]["total"] <= best["hit_tokens"]["total"]


@pytest.mark.slow
@settings(max_examples=100, deadline=None)
@given(stream=streams, cap=st.integers(1, 12))
def test_write_through_lower_tier_alone_predicts_the_hierarchy(
        stream: list[tuple[list[int], int, int]], cap: int) -> None:
    """With write-through and LRU, an unbounded NVMe under any GPU behaves like NVMe alone
    for the total hit ratio (it holds every block ever computed)."""
    alone = run(build(["nvme"], ["inf"], "lru", "write-through"), stream, False).result()
    both = run(build(["gpu", "nvme"], [f"{cap}blk", "inf"], "lru", "write-through"), stream,
               False).result()
    assert both["hit_tokens"]["total"] == alone["hit_tokens"]["total"]


@pytest.mark.parametrize("caps", [("3blk", "6blk"), ("2blk", "5blk", "9blk"),
                                  ("2blk", "5blk", "inf"), ("4blk", "inf"), ("1blk", "2blk")])
@pytest.mark.parametrize("policy", ["lru", "mooncake", "lru-tail-first"])
def test_fused_and_general_paths_agree_on_long_streams(caps: tuple[str, ...],
                                                       policy: str) -> None:
    import random

    rng = random.Random(f"{caps}{policy}")
    stream = []
    for _ in range(400):
        path = [rng.randrange(3) for _ in range(rng.randrange(1, 9))]
        stream.append(([hash(tuple(path[: i + 1])) & 0xFFFFFFFF for i in range(len(path))],
                       rng.randrange(5), rng.randrange(B)))
    cfg = build(["gpu", "dram", "nvme"][: len(caps)], list(caps), policy, "write-through")
    assert run(cfg, stream, general=False).result() == run(cfg, stream, general=True).result()


@pytest.mark.slow
@settings(max_examples=100, deadline=None)
@given(stream=streams, tiers=tier_sets, caps=st.lists(capacity, min_size=3, max_size=3),
       # vllm (the GPU block pool) takes no admission rule: vLLM's pool caches what it runs
       policy=st.sampled_from(sorted(p for p in POLICIES if p != "vllm")), after=st.integers(2, 3),
       ttl=st.one_of(st.none(), st.integers(1, 6)),
       write_policy=st.sampled_from(["write-through", "write-back"]))
def test_admission_invariants(stream: list[tuple[list[int], int, int]], tiers: list[str],
                              caps: list[str], policy: str, after: int, ttl: int | None,
                              write_policy: str) -> None:
    """Admission (reuse count, TTL) on any policy: capacities hold, fast and general paths
    agree, and an unbounded tier behind admission never hits more than without it."""
    cfg = build(tiers, caps, policy, write_policy)
    for spec in cfg.tiers:
        spec.admit_after, spec.admit_ttl = after, ttl
    fast = run(cfg, stream, general=False).result()
    assert fast == run(cfg, stream, general=True).result()
    assert fast["hit_tokens"]["total"] + fast["recompute_tokens"] == fast["input_tokens"]
    free = build(["dram"], ["inf"], policy, "write-through")
    gated = build(["dram"], ["inf"], policy, "write-through")
    gated.tiers[0].admit_after, gated.tiers[0].admit_ttl = after, ttl
    assert (run(gated, stream, False).result()["hit_tokens"]["total"]
            <= run(free, stream, False).result()["hit_tokens"]["total"])
