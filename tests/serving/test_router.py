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
    """Prompt of 100 tokens, 16-token blocks: 7 blocks (the partial last one counts).

    e0: 6 leading blocks on GPU, 20 blocks active, load 4 → 1·max(0, 7 − 6) + 20 + 7 = 28
    e1: nothing cached, 0 active                             → 1·7 + 0 + 7 = 14
    e2: 2 on GPU, 6 in its node's DRAM (4 beyond the GPU's), 5 active
        → overlap 2 + 0.75·4 = 5; 1·(7 − 5) + 5 + 7 = 14 → tie with e1, lowest index wins.
    """
    keys = [10, 11, 12, 13, 14, 15]
    e0 = View(0, running=4, blocks=20, gpu_keys=set(keys))
    e1 = View(1)
    e2 = View(2, blocks=5, gpu_keys={10, 11}, host_keys=set(keys))
    r = make_router("kv-aware")
    assert isinstance(r, KvAwareRouter)
    req = Req(100, keys)
    assert r.logits(req, [e0, e1, e2]) == {0: 28.0, 1: 14.0, 2: 14.0}
    assert r.route(req, [e0, e1, e2]) == 1
    # a heavier prefill weight (Dynamo's older overlap_score_weight) favours the cache
    r2 = KvAwareRouter(prefill_load_scale=4.0)
    assert make_router("kv-aware", overlap_score_weight=4.0).params() == r2.params()
    assert r2.logits(req, [e0, e1, e2]) == {0: 31.0, 1: 35.0, 2: 20.0}
    assert r2.route(req, [e0, e1, e2]) == 2
    # load counts when asked to (Dynamo's decode_active_request_weight)
    r3 = KvAwareRouter(decode_active_request_weight=1.0, host_cache_hit_weight=1.0)
    assert r3.logits(req, [e0, e1, e2]) == {0: 32.0, 1: 14.0, 2: 13.0}


def test_kv_aware_keys_override_and_block_tokens() -> None:
    e0, e1 = View(0, gpu_keys={7}), View(1)
    req = Req(64, [1, 2, 3, 4])            # the trace's keys: nothing cached anywhere
    r = KvAwareRouter(block_tokens=32)
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
    with pytest.raises(UsageError, match=">= 0") as info:
        make_router("kv-aware", host_cache_hit_weight=-1)
    assert info.value.field == "host_cache_hit_weight"
    with pytest.raises(ValueError, match="no engine"):
        make_router("least-loaded").route(Req(1, []), [View(0, role="decode")], "prefill")
    with pytest.raises(ValueError, match="role"):
        make_router("least-loaded").route(Req(1, []), [View(0)], "both")
