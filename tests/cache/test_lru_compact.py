"""``lru``'s compact representation (reference counts and a deque of touches) keeps exact
LRU order through many touches, deque rebuilds and evictions: checked against a plain
OrderedDict LRU on long streams, in one tier and in the fused 2- and 3-tier paths."""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Callable

import pytest

from kvtool.cache import CacheConfig, Replayer, TierSpec
from kvtool.cache.policies import LruPolicy, LruTailFirstPolicy
from kvtool.cache.replayer import RequestOutcome
from kvtool.units import Capacity
from tests.helpers.cache import req


def reference(stream: list[list[int]], caps: list[int], B: int = 16) -> list[int]:
    """Hit blocks per request of write-through head-first LRU tiers (OrderedDicts)."""
    tiers: list[OrderedDict[int, None]] = [OrderedDict() for _ in caps]
    hits = []
    for keys in stream:
        k = 0
        for key in keys:
            if not any(key in t for t in tiers):
                break
            k += 1
        hits.append(k)
        for t, cap in zip(tiers, caps, strict=True):
            for key in keys:
                if key in t:
                    t.move_to_end(key)
                else:
                    t[key] = None
            while len(t) > cap:
                t.popitem(last=False)
    return hits


def stream(seed: int, n: int = 4000) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        path = [rng.randrange(4) for _ in range(rng.randrange(1, 10))]
        out.append([hash(tuple(path[: i + 1])) & 0xFFFFFFFF for i in range(len(path))])
    return out


def repeating(seed: int, n: int = 4000) -> list[list[int]]:
    """Requests that name a block more than once (one reference per mention: the
    counts are tallied a request at a time)."""
    rng = random.Random(seed)
    return [[rng.randrange(60) for _ in range(rng.randrange(1, 12))] for _ in range(n)]


@pytest.mark.parametrize("make", [stream, repeating])
@pytest.mark.parametrize("caps", [[5], [40], [3, 12], [4, 9, 30]])
def test_compact_lru_equals_an_ordereddict_lru(
        caps: list[int], make: Callable[[int], list[list[int]]]) -> None:
    names = ["gpu", "dram", "nvme"][: len(caps)]
    specs = [TierSpec(n, Capacity.parse(f"{c}blk")) for n, c in zip(names, caps, strict=True)]
    for seed in range(3):
        s = make(seed)
        outcomes: list[RequestOutcome] = []
        rep = Replayer(CacheConfig(specs), 16, on_request=outcomes.append)
        for keys in s:
            rep.feed(req(keys, block_tokens=16))
        assert [sum(o.hit_tokens.values()) // 16 for o in outcomes] == reference(s, caps)
        for tier in rep.cache.tiers:
            pol = tier.policy
            assert isinstance(pol, LruPolicy)
            # the deque was rebuilt along the way and stays bounded
            assert len(pol.order) <= 2 * len(pol.index) + 1024
            assert sum(pol.index.values()) == len(pol.order)


def test_rebuild_keeps_order_and_counts() -> None:
    for cls in (LruPolicy, LruTailFirstPolicy):
        p = cls()
        for i in range(3000):
            p.access([i % 7, 100 + i % 5], 0)
        assert len(p.order) <= 2 * len(p.index) + 1024
        p.compact()
        assert p.evict(12) == p_order_reference(cls)   # every key, least recent first
        assert not p.index and not p.order


def p_order_reference(cls: type[LruPolicy]) -> list[int]:
    od: OrderedDict[int, None] = OrderedDict()
    for i in range(3000):
        keys = [i % 7, 100 + i % 5]
        for key in (reversed(keys) if cls.tail_first else keys):
            od[key] = None
            od.move_to_end(key)
    return list(od)
