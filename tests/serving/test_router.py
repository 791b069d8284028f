"""Routers against hand-made engine views (docs/serving.md, "Routers": EngineView)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest

from kvtool.errors import UsageError
from kvtool.serving.router import KvAwareRouter, make_router


@dataclass
class View:
    """An engine as a router sees it: its load, blocks in use and cached prefixes."""

    index: int
    node: str = "n0"
    running: int = 0
    blocks: int = 0
    gpu_keys: set[int] = field(default_factory=set)
    host_keys: set[int] = field(default_factory=set)
    role: str = "both"

    def load(self) -> int:
        return self.running

    def active_blocks(self) -> int:
        return self.blocks

    @staticmethod
    def _prefix(keys: Sequence[int], have: set[int]) -> int:
        n = 0
        for k in keys:
            if k not in have:
                break
            n += 1
        return n

    def gpu_prefix_blocks(self, keys: Sequence[int]) -> int:
        return self._prefix(keys, self.gpu_keys)

    def host_prefix_blocks(self, keys: Sequence[int]) -> int:
        return self._prefix(keys, self.host_keys)


@dataclass
class Req:
    input_length: int
    block_keys: list[int]
    block_tokens: int = 16
    session: str | None = None


def test_round_robin_cycles_and_keeps_one_cursor_per_role() -> None:
    r = make_router("round-robin")
    engines = [View(0), View(1), View(2)]
    req = Req(16, [1])
    assert [r.route(req, engines) for _ in range(5)] == [0, 1, 2, 0, 1]
    pd = [View(0, role="prefill"), View(1, role="decode"), View(2, role="prefill"),
          View(3, role="both")]
    r = make_router("round-robin")
    assert [r.route(req, pd, "prefill") for _ in range(4)] == [0, 2, 3, 0]
    assert [r.route(req, pd, "decode") for _ in range(3)] == [1, 3, 1]


def test_least_loaded_ties_go_to_the_lowest_index() -> None:
    r = make_router("least-loaded")
    engines = [View(0, running=3), View(1, running=1), View(2, running=1)]
    assert r.route(Req(16, [1]), engines) == 1
    engines[1].running = 5
    assert r.route(Req(16, [1]), engines) == 2
    assert r.route(Req(16, [1]), [View(0, running=2, role="decode"), View(1, running=9)],
                   "prefill") == 1


def test_session_affinity_sticks_and_falls_back_to_least_loaded() -> None:
    r = make_router("session-affinity")
    engines = [View(0, running=2), View(1, running=0)]
    a = Req(16, [1], session="a")
    assert r.route(a, engines) == 1          # first request: least loaded
    engines[1].running = 10
    assert r.route(a, engines) == 1          # sticks though now busier
    assert r.route(Req(16, [1], session="b"), engines) == 0
    assert r.route(Req(16, [1]), engines) == 0   # no session: least loaded
    # per role: the session's decode home is chosen in the decode pool
    pd = [View(0, role="prefill"), View(1, role="decode", running=1),
          View(2, role="decode")]
    assert r.route(a, pd, "prefill") == 0
    assert r.route(a, pd, "decode") == 2


def test_kv_aware_cost_by_hand() -> None:
    """Dynamo 1.6.1's cost, by hand: a prompt of 100 tokens, 16-token blocks (6 full blocks,
    keys 10..15), nothing sent yet to any engine (no tracked prefill, no active blocks).

    raw prefill = (0 + 100) / 16 = 6.25 blocks; decode = the 6 full blocks
    e0: 6 leading blocks on GPU        → max(0, 6.25 − 6) + 6 = 6.25
    e1: nothing cached                 → 6.25 + 6 = 12.25
    e2: 2 on GPU, 6 in its node's DRAM → credit 2 + 0.75·4 = 5 → 1.25 + 6 = 7.25
    """
    keys = [10, 11, 12, 13, 14, 15]
    e0 = View(0, gpu_keys=set(keys))
    e1 = View(1)
    e2 = View(2, gpu_keys={10, 11}, host_keys=set(keys))
    r = make_router("kv-aware")
    assert isinstance(r, KvAwareRouter)
    req = Req(100, keys)
    assert r.logits(req, [e0, e1, e2]) == {0: 6.25, 1: 12.25, 2: 7.25}
    # a heavier prefill weight (Dynamo's older overlap_score_weight) favours the cache more
    r2 = KvAwareRouter(prefill_load_scale=4.0)
    assert make_router("kv-aware", overlap_score_weight=4.0).params() == r2.params()
    assert r2.logits(req, [e0, e1, e2]) == {0: 7.0, 1: 31.0, 2: 11.0}


def test_kv_aware_tracks_what_it_sent_as_dynamo_does() -> None:
    """The load terms are the router's own bookkeeping (Dynamo's active sequences): each
    request adds its uncached tokens to the prefill load until its first token, and its full
    blocks (shared ones once) to the active blocks until it ends."""
    r = KvAwareRouter(tie_break="lowest")
    e0, e1 = View(0), View(1)
    a = Req(4096, list(range(8)), block_tokens=512)
    assert r.logits(a, [e0, e1]) == {0: 16.0, 1: 16.0}       # 8 raw + 8 blocks
    assert r.route(a, [e0, e1]) == 0
    b = Req(2048, list(range(100, 104)), block_tokens=512)
    # e0: (4096 + 2048) / 512 = 12, blocks 8 + 4 = 12 → 24; e1 idle: 4 + 4 = 8
    assert r.logits(b, [e0, e1]) == {0: 24.0, 1: 8.0}
    # b shares a's first four blocks: they count once on e0
    c = Req(4096, [0, 1, 2, 3, 200, 201, 202, 203], block_tokens=512)
    assert r.logits(c, [e0, e1]) == {0: 28.0, 1: 16.0}
    r.prefill_done(a)                                        # a's first token is out
    assert r.logits(c, [e0, e1]) == {0: 20.0, 1: 16.0}       # 8 raw + 8 + 4 new blocks
    # a's prefix is now in e0's GPU cache: the credit makes e0 cheaper
    e0.gpu_keys = set(range(8))
    assert r.logits(c, [e0, e1]) == {0: 16.0, 1: 16.0}       # max(0, 8 − 4) + 12
    # a request charges only its uncached tokens: c on e0 (4 blocks cached) charges 2048
    assert r.route(c, [e0, e1]) == 0
    assert r.logits(b, [e0, e1]) == {0: (2048 + 2048) / 512 + 16, 1: 8.0}
    r.finished(a)
    r.finished(c)
    assert r.logits(b, [e0, e1]) == {0: 8.0, 1: 8.0}         # nothing tracked any more
    # the decode pool (P/D): no overlap credit, no prefill term — the blocks alone
    d0 = View(0, role="decode", gpu_keys=set(range(8)))
    assert r.logits(a, [d0], "decode") == {0: 8.0}


def test_kv_aware_breaks_ties_at_random_and_repeatably() -> None:
    engines = [View(0), View(1), View(2), View(3)]
    picks = []
    for seed in (0, 0, 1):
        r = KvAwareRouter(seed=seed)
        reqs = [Req(16, [i]) for i in range(40)]
        picks.append([r.route(q, engines) for q in reqs])
        for q in reqs:
            r.finished(q)
        assert r.logits(reqs[0], engines) == {0: 2.0, 1: 2.0, 2: 2.0, 3: 2.0}  # none tracked
    assert picks[0] == picks[1] != picks[2]                  # seeded: repeatable
    assert set(picks[0]) == {0, 1, 2, 3}                     # every engine gets some
    lowest = KvAwareRouter(tie_break="lowest")
    assert lowest.route(Req(16, [1]), engines) == 0


def test_kv_aware_keys_override_and_block_tokens() -> None:
    e0, e1 = View(0, gpu_keys={7}), View(1)
    req = Req(64, [1, 2, 3, 4])            # the trace's keys: nothing cached anywhere
    r = KvAwareRouter(block_tokens=32, tie_break="lowest")
    assert r.logits(req, [e0, e1]) == {0: 4.0, 1: 4.0}
    # the engines' own keys (another block size) find e0's cached block
    assert r.logits(req, [e0, e1], keys=[7, 8]) == {0: 3.0, 1: 4.0}
    assert r.route(req, [e0, e1], keys=[7, 8]) == 0


def test_kv_aware_respects_roles() -> None:
    engines = [View(0, role="decode", gpu_keys={1, 2}), View(1, role="prefill", blocks=50)]
    r = make_router("kv-aware")
    assert r.route(Req(32, [1, 2]), engines, "prefill") == 1


def test_bad_routers_and_parameters() -> None:
    with pytest.raises(UsageError, match="unknown router"):
        make_router("random")
    with pytest.raises(UsageError, match="takes no parameters") as info:
        make_router("round-robin", weight=1)
    assert info.value.field == "weight"
    with pytest.raises(UsageError, match="unknown parameter"):
        make_router("kv-aware", temperature=0.5)
    with pytest.raises(UsageError, match="random or lowest") as info:
        make_router("kv-aware", tie_break="first")
    assert info.value.field == "tie_break"
    with pytest.raises(UsageError, match=">= 0") as info:
        make_router("kv-aware", host_cache_hit_weight=-1)
    assert info.value.field == "host_cache_hit_weight"
    with pytest.raises(ValueError, match="no engine"):
        make_router("least-loaded").route(Req(1, []), [View(0, role="decode")], "prefill")
    with pytest.raises(ValueError, match="role"):
        make_router("least-loaded").route(Req(1, []), [View(0)], "both")


def test_every_registered_router_is_made_and_named_as_registered() -> None:
    from kvtool.serving.router import ROUTERS, Router

    for name in ROUTERS:
        r = make_router(name, defaults={"block_tokens": 16})
        assert isinstance(r, Router) and r.name == name
