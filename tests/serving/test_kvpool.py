"""KVPool's semantics, computed by hand (vLLM's own code checks it in test_kvpool_vllm.py)."""

from __future__ import annotations

import pytest

from kvtool.serving.kvpool import KVPool
from tests.helpers.vllm_oracle import Seq

B = 4


def seq(rid: str, keys: list[int], tokens: int) -> Seq:
    return Seq(rid, keys, tokens, B)


def run(pool: KVPool, s: Seq, **kw: object) -> list[int] | None:
    """Admit ``s`` whole (the scheduler's waiting path), as one prefill step."""
    blocks, hit = pool.get_computed_blocks(s)
    new = pool.allocate_slots(s, s.num_tokens - hit, hit, blocks, **kw)  # type: ignore[arg-type]
    if new is not None:
        s.num_computed_tokens = s.num_tokens
    pool.check()
    return new


def test_null_block_and_fresh_queue() -> None:
    pool = KVPool(6, B)
    assert pool.num_free_blocks == 5
    assert pool.free_queue() == [1, 2, 3, 4, 5]
    assert pool.usage == 0.0
    a = seq("a", [11, 12, 13], 10)
    assert run(pool, a) == [1, 2, 3]             # from the head
    assert pool.usage == pytest.approx(3 / 5)
    pool.free(a)
    # tail first: the partial block 3 (no key) to the front, 2 and 1 (keys) to the back
    assert pool.free_queue() == [3, 4, 5, 2, 1]
    assert [pool.block_key(b) for b in (1, 2, 3)] == [11, 12, None]


def test_hit_capped_below_the_last_token_and_second_copy() -> None:
    pool = KVPool(10, B)
    a = seq("a", [1, 2, 3], 12)
    run(pool, a)
    pool.free(a)                                    # queue: 4..9, 3, 2, 1
    b = seq("b", [1, 2, 3], 12)
    assert pool.get_computed_blocks(b) == ([1, 2], 8)   # ⌊11/4⌋·4 = 8
    assert run(pool, b) == [4]                      # block 3 recomputed into block 4
    assert pool.num_cached_blocks == 4 and pool.block_key(4) == 3
    c = seq("c", [1, 2, 3], 13)
    assert pool.get_computed_blocks(c) == ([1, 2, 3], 12)   # the first-cached copy
    pool.free(b)
    assert pool.free_queue() == [5, 6, 7, 8, 9, 3, 4, 2, 1]   # b's blocks, tail first
    assert pool.cached_prefix_blocks([1, 2, 3, 99]) == 3


def test_reusing_a_slot_evicts_its_key() -> None:
    pool = KVPool(4, B)                             # 3 usable
    a = seq("a", [1, 2], 8)
    run(pool, a)
    pool.free(a)                                    # queue: 3, 2, 1
    x = seq("x", [7], 4)
    assert run(pool, x) == [3]                      # block 3 had no key
    y = seq("y", [8], 4)
    assert run(pool, y) == [2]                      # evicts key 2 (a's tail goes first)
    assert pool.cached_prefix_blocks([1, 2]) == 1
    assert pool.get_computed_blocks(seq("z", [1, 2], 9)) == ([1], 4)


def test_no_room_returns_none_and_changes_nothing() -> None:
    pool = KVPool(4, B)
    a = seq("a", [1, 2], 8)
    run(pool, a)
    before = (pool.free_queue(), pool.num_free_blocks)
    b = seq("b", [5, 6], 8)
    assert run(pool, b) is None
    assert (pool.free_queue(), pool.num_free_blocks) == before
    assert pool.get_block_ids("b") == []


def test_full_sequence_gate_and_reserved_blocks() -> None:
    pool = KVPool(5, B)                             # 4 usable
    s = seq("s", [1, 2, 3, 4, 5], 20)
    assert pool.allocate_slots(s, 4, full_sequence_must_fit=True) is None   # 5 blocks > 4
    assert pool.allocate_slots(s, 4, reserved_blocks=4) is None
    assert pool.allocate_slots(s, 4) == [1]


def test_decode_growth_caches_blocks_as_they_fill() -> None:
    pool = KVPool(8, B)
    s = seq("s", [1, 2, 3], 3)
    run(pool, s)
    for _ in range(6):                              # decode: one token a step
        s.num_tokens += 1
        pool.allocate_slots(s, 1)
        s.num_computed_tokens += 1
    assert s.num_tokens == 9
    assert pool.get_block_ids("s") == [1, 2, 3]
    assert pool.cached_prefix_blocks([1, 2, 3]) == 2    # the third block is not full


def test_prefix_cache_stats() -> None:
    pool = KVPool(8, B)
    pool.record_prefix_cache_stats(seq("a", [], 10), 8)
    pool.record_prefix_cache_stats(seq("b", [], 6), 0, preempted=True)
    stats = pool.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits, stats.hit_rate) == (1, 10, 8, 0.8)
    assert (stats.preempted_requests, stats.preempted_queries) == (1, 6)
    assert pool.prefix_cache_stats.requests == 0


def test_disabled_caching_and_argument_errors() -> None:
    pool = KVPool(8, B, enable_caching=False)
    a = seq("a", [1, 2], 9)
    run(pool, a)
    pool.free(a)
    assert pool.get_computed_blocks(seq("b", [1, 2], 9)) == ([], 0)
    assert pool.free_queue() == [3, 2, 1, 4, 5, 6, 7]     # all to the front, tail first
    with pytest.raises(ValueError, match="num_new_tokens"):
        pool.allocate_slots(seq("c", [], 4), 0)
    with pytest.raises(ValueError):
        KVPool(0, B)


@pytest.mark.parametrize("seed", range(20))
def test_no_caching_stack_is_the_linked_queue(seed: int) -> None:
    """Without prefix caching the free queue is kept as a stack: the same blocks, queue and
    answers as the linked list (forced with ``_unstack``) under random steps and frees."""
    import random

    rnd = random.Random(seed)
    n, bt = rnd.randint(2, 40), rnd.choice([1, 2, 4, 16])
    fast, ref = KVPool(n, bt, enable_caching=False), KVPool(n, bt, enable_caching=False)
    ref._unstack()
    live: dict[str, tuple[Seq, Seq]] = {}
    for step in range(200):
        if live and rnd.random() < 0.35:
            rid = rnd.choice(sorted(live))
            a, b = live.pop(rid)
            fast.free(a)
            ref.free(b)
        elif live and rnd.random() < 0.5:
            rid = rnd.choice(sorted(live))
            a, b = live[rid]
            k = rnd.randint(1, 3 * bt)
            got = fast.allocate_slots(a, k), ref.allocate_slots(b, k)
            assert got[0] == got[1]
            if got[0] is not None:
                for s in (a, b):
                    s.num_computed_tokens += k
                    s.num_tokens = max(s.num_tokens, s.num_computed_tokens)
        else:
            rid = f"r{step}"
            tokens = rnd.randint(1, 5 * bt)
            a, b = (Seq(rid, list(range(10)), tokens, bt) for _ in range(2))
            kw = {"full_sequence_must_fit": rnd.random() < 0.5,
                  "num_external_computed_tokens": rnd.choice([0, 0, bt])}
            first = tokens if not kw["num_external_computed_tokens"] else max(1, tokens - bt)
            got = (fast.allocate_slots(a, first, **kw),  # type: ignore[arg-type]
                   ref.allocate_slots(b, first, **kw))  # type: ignore[arg-type]
            assert got[0] == got[1]
            if got[0] is not None:
                live[rid] = (a, b)
        assert fast._stack is not None
        assert fast.free_queue() == ref.free_queue()
        assert fast.num_free_blocks == ref.num_free_blocks
        assert {r: fast.get_block_ids(r) for r in live} == {r: ref.get_block_ids(r) for r in live}
        fast.check()
        ref.check()


@pytest.mark.parametrize("seed", range(20))
def test_allocate_running_is_allocate_slots(seed: int) -> None:
    """``allocate_running`` (a running request's step) gives what ``allocate_slots`` gives:
    the same answers, blocks, queue and cache, on twin pools under random admissions (with
    hits and loads), steps and frees, with and without prefix caching."""
    import random

    rnd = random.Random(seed)
    n, bt = rnd.randint(2, 40), rnd.choice([1, 2, 4, 16])
    caching = seed % 2 == 0
    fast, ref = KVPool(n, bt, enable_caching=caching), KVPool(n, bt, enable_caching=caching)
    live: dict[str, tuple[Seq, Seq]] = {}
    for step in range(200):
        if live and rnd.random() < 0.3:
            rid = rnd.choice(sorted(live))
            a, b = live.pop(rid)
            fast.free(a)
            ref.free(b)
        elif live and rnd.random() < 0.6:
            rid = rnd.choice(sorted(live))
            a, b = live[rid]
            k = rnd.randint(1, 3 * bt)
            for s in (a, b):  # decoding: the request grows by what it computes
                s.num_tokens = max(s.num_tokens, s.num_computed_tokens + k)
            got = fast.allocate_running(a, k), ref.allocate_slots(b, k)
            assert got[0] == got[1]
            if got[0] is not None:
                for s in (a, b):
                    s.num_computed_tokens += k
        else:
            rid = f"r{step}"
            tokens = rnd.randint(1, 5 * bt)
            keys = [rnd.randrange(6) * 100 + i for i in range(40)]
            a, b = (Seq(rid, list(keys), tokens, bt) for _ in range(2))
            blocks, hit = fast.get_computed_blocks(a)
            assert (blocks, hit) == ref.get_computed_blocks(b)
            ext = rnd.choice([0, 0, bt]) if tokens - hit > bt else 0
            first = tokens - hit - ext
            kw = {"full_sequence_must_fit": rnd.random() < 0.5,
                  "num_external_computed_tokens": ext}
            got = (fast.allocate_slots(a, first, hit, blocks, **kw),  # type: ignore[arg-type]
                   ref.allocate_slots(b, first, hit, list(blocks), **kw))  # type: ignore[arg-type]
            assert got[0] == got[1]
            if got[0] is not None:
                for s in (a, b):
                    s.num_computed_tokens = tokens
                live[rid] = (a, b)
        assert fast.free_queue() == ref.free_queue()
        assert fast.num_free_blocks == ref.num_free_blocks
        assert {r: fast.get_block_ids(r) for r in live} == {r: ref.get_block_ids(r) for r in live}
        assert fast.hash_index == ref.hash_index
        fast.check()
        ref.check()
