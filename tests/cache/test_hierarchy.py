"""Tier hierarchy: attribution, write-through vs write-back accounting, promotion, movers."""

from __future__ import annotations

import pytest

from kvtool.cache import (
    CacheConfig,
    LruPolicy,
    Replayer,
    RoundStats,
    Tier,
    TierHierarchy,
    TierSpec,
)
from kvtool.collapse import collapse_round
from kvtool.units import Capacity
from tests.helpers.cache import req

B = 256


def two_tiers(write_policy: str, gpu: int = 2, dram: int = 10) -> TierHierarchy:
    return TierHierarchy([Tier("gpu", gpu, LruPolicy()), Tier("dram", dram, LruPolicy())],
                         write_policy)  # type: ignore[arg-type]


def serve(h: TierHierarchy, keys: list[int], st: RoundStats, input_length: int | None = None,
          session: int = 0) -> list[int]:
    n = len(keys) * B if input_length is None else input_length
    return h.serve(keys, n, B, session, st)


def test_write_through_writes_every_computed_block_to_every_tier() -> None:
    h, st = two_tiers("write-through"), RoundStats(2)
    serve(h, [1, 2, 3], st)
    assert st.blocks_written == [3, 3]
    assert st.evictions == [1, 0]          # the GPU holds 2: head 1 goes
    assert st.blocks_read == [0, 0]
    assert 1 not in h.tiers[0] and 1 in h.tiers[1]


def test_write_back_writes_down_only_on_eviction() -> None:
    h, st = two_tiers("write-back"), RoundStats(2)
    serve(h, [1, 2, 3], st)
    assert st.blocks_written == [3, 1]     # 1 demoted into DRAM on GPU eviction
    assert st.blocks_read == [1, 0]        # the demotion reads it out of the GPU
    assert st.evictions == [1, 0]
    assert set(h.tiers[1].policy.index) == {1}


def test_promotion_on_lower_tier_hit_write_back() -> None:
    h, st = two_tiers("write-back"), RoundStats(2)
    serve(h, [1, 2, 3], st)
    st2 = RoundStats(2)
    per_tier = serve(h, [1, 2, 3], st2)
    # 1 from DRAM, 2 and 3 from the GPU; the highest tier holding a block gets it.
    assert per_tier == [2, 1]
    assert st2.hit_tokens == [2 * B, B] and st2.recompute_tokens == 0
    assert st2.blocks_read[1] == 1         # the DRAM load
    assert st2.blocks_written[0] == 1      # promoted into the GPU
    # the GPU overflows again (3 > 2) and evicts head 1, which DRAM still holds: no write
    assert st2.blocks_written[1] == 0


def test_promotion_write_through_copies_into_every_tier_above() -> None:
    h = TierHierarchy([Tier("gpu", 1, LruPolicy()), Tier("dram", 1, LruPolicy()),
                       Tier("nvme", 100, LruPolicy())], "write-through")
    st = RoundStats(3)
    serve(h, [1, 2], st)                   # GPU and DRAM keep only 2
    st2 = RoundStats(3)
    assert serve(h, [1, 2], st2) == [1, 0, 1]   # 1 from NVMe (only there), 2 from the GPU
    assert st2.blocks_written == [1, 1, 0]      # 1 copied into GPU and DRAM
    assert st2.blocks_read == [1, 0, 1]


def test_write_through_does_not_copy_upper_hits_down() -> None:
    h = TierHierarchy([Tier("gpu", 10, LruPolicy()), Tier("dram", 10, LruPolicy())],
                      "write-through")
    st = RoundStats(2)
    serve(h, [1, 2], st)
    h.tiers[1].policy.evict(2)             # DRAM loses them; the GPU still has them
    st2 = RoundStats(2)
    serve(h, [1, 2, 3], st2)
    assert st2.hit_tokens == [2 * B, 0]
    assert st2.blocks_written == [1, 1]    # only the computed block 3 goes down
    assert set(h.tiers[1].policy.index) == {3}


def test_partial_last_block_caps_hit_tokens() -> None:
    h, st = two_tiers("write-through", gpu=10), RoundStats(2)
    serve(h, [1, 2, 3], st, input_length=2 * B + 10)
    st2 = RoundStats(2)
    serve(h, [1, 2, 3], st2, input_length=2 * B + 10)
    assert sum(st2.hit_tokens) == 2 * B + 10 and st2.recompute_tokens == 0


def test_prefix_stops_at_first_block_in_no_tier() -> None:
    h, st = two_tiers("write-through", gpu=10), RoundStats(2)
    serve(h, [1, 2, 3], st)
    h.tiers[0].policy.index.pop(2)
    h.tiers[1].policy.index.pop(2)
    st2 = RoundStats(2)
    serve(h, [1, 2, 3], st2)
    assert sum(st2.hit_tokens) == B        # 3 is cached but unreachable


class Recorder:
    """A TierMover that records calls (it is the hook under test, not a mock of it)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, list[int]]] = []

    def on_write(self, tier: str, keys: list[int]) -> None:
        self.calls.append(("write", tier, list(keys)))

    def on_read(self, tier: str, keys: list[int]) -> None:
        self.calls.append(("read", tier, list(keys)))

    def on_evict(self, tier: str, keys: list[int]) -> None:
        self.calls.append(("evict", tier, list(keys)))


def test_backend_hook_sees_every_metadata_change() -> None:
    rec = Recorder()
    cfg = CacheConfig([TierSpec("gpu", Capacity.parse("2blk")),
                       TierSpec("dram", Capacity.parse("10blk"))], "write-back")
    r = Replayer(cfg, B, movers={"gpu": rec, "dram": rec})
    r.feed(req([1, 2, 3], session="a"))
    r.feed(req([1, 2, 3], session="a"))
    assert rec.calls[:3] == [("write", "gpu", [1, 2, 3]), ("evict", "gpu", [1]),
                             ("write", "dram", [1])]
    assert ("read", "dram", [1]) in rec.calls and ("read", "gpu", [2, 3]) in rec.calls
    # same accounting as without movers
    plain = Replayer(cfg, B)
    plain.feed(req([1, 2, 3], session="a"))
    plain.feed(req([1, 2, 3], session="a"))
    assert plain.result()["blocks_written"] == r.result()["blocks_written"]


class Silent:
    """A TierMover that ignores every call: it only forces the general serve path."""

    def on_write(self, tier: str, keys: list[int]) -> None:
        pass

    def on_read(self, tier: str, keys: list[int]) -> None:
        pass

    def on_evict(self, tier: str, keys: list[int]) -> None:
        pass


@pytest.mark.parametrize("write_policy", ["write-through", "write-back"])
@pytest.mark.parametrize("caps", [("4blk",), ("2blk", "5blk"), ("2blk", "4blk", "8blk")])
def test_general_path_counts_like_the_fast_paths(caps: tuple[str, ...],
                                                 write_policy: str) -> None:
    """With a mover every request takes the general serve path; the counts must not change.

    Short last blocks (input_length < k·B) exercise the hit-token cap.
    """
    names = ("gpu", "dram", "nvme")[:len(caps)]
    cfg = CacheConfig([TierSpec(n, Capacity.parse(c)) for n, c in zip(names, caps, strict=True)],
                      write_policy)  # type: ignore[arg-type]
    chains = [[1, 2, 3], [1, 2, 3, 4], [5, 6], [1, 2, 3, 4, 7], [5, 6, 8], [1, 2], [9, 10, 11]]
    results = []
    for movers in (None, {n: Silent() for n in names}):
        r = Replayer(cfg, B, movers=movers)  # type: ignore[arg-type]
        for _ in range(2):
            for i, keys in enumerate(chains):
                r.feed(req(keys, session=i % 3, input_length=len(keys) * B - 100))
        results.append(r.result())
    assert results[0]["hit_tokens"]["total"] > 0 and sum(results[0]["evictions"].values()) > 0
    assert results[0] == results[1]


@pytest.mark.parametrize(("rounds", "expected"), [
    ({1: (0, 10), 2: (5, 10), 3: (3, 10)}, 3),
    ({1: (0, 10), 2: (8, 10), 3: (6, 10)}, 3),      # exactly 25 % lower
    ({1: (0, 10), 2: (8, 10), 3: (61, 100)}, None),  # 23.75 % lower
    ({1: (10, 10), 2: (1, 10), 3: (1, 10)}, None),   # a drop at round 2 does not count
    ({1: (0, 10), 2: (5, 10), 4: (0, 10)}, None),    # round 3 missing
    ({1: (0, 10), 2: (0, 10), 3: (0, 10)}, None),
    ({1: (0, 10), 2: (8, 10), 3: (8, 10), 4: (8, 10), 5: (1, 10), 6: (0, 10)}, 5),
])
def test_cliff_round(rounds: dict[int, tuple[int, int]], expected: int | None) -> None:
    assert collapse_round(rounds) == expected


def test_per_round_accounting_without_a_clock() -> None:
    cfg = CacheConfig([TierSpec("dram", Capacity.parse("inf"))])
    r = Replayer(cfg, B, block_bytes=10**6)
    r.feed(req([1, 2], session="s", round=1, output_length=5))
    r.feed(req([1, 2, 3], session="s", round=2, output_length=5))
    res = r.result()
    r1, r2 = res["rounds"]
    assert (r1["round"], r1["token_hit_ratio"], r1["recompute_tokens"]) == (1, 0.0, 2 * B)
    assert r2["hit_tokens"]["dram"] == 2 * B and r2["recompute_tokens"] == B
    assert r2["bytes_read"]["dram"] == 2 * 10**6 and r2["bytes_written"]["dram"] == 10**6
    # the cache keeps no clock: times are the serving model's (kvtool.replay.timing)
    assert r2["ttft_p50_s"] is None and r2["wall_s"] is None and res["time_model"] is None
    assert res["hit_tokens"]["total"] == 2 * B


def test_write_through_promotes_mixed_prefix_into_middle_tier() -> None:
    """Head hits in the GPU, tail hits only in NVMe: the tail is copied into DRAM and GPU,
    the head is not copied down again (checked on the fast and the general path)."""
    from kvtool.cache import LruTailFirstPolicy, NullMover

    for mover in (None, NullMover()):
        h = TierHierarchy([Tier("gpu", 2, LruTailFirstPolicy(), mover=mover),
                           Tier("dram", 2, LruTailFirstPolicy()),
                           Tier("nvme", 100, LruTailFirstPolicy())], "write-through")
        serve(h, [1, 2, 3, 4], RoundStats(3))
        assert set(h.tiers[1].policy.index) == {1, 2}
        st = RoundStats(3)
        assert serve(h, [1, 2, 3, 4], st) == [2, 0, 2]
        assert st.blocks_written == [2, 2, 0]
        assert st.blocks_read == [2, 0, 2]
