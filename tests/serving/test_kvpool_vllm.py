"""KVPool against vLLM's own KVCacheManager, call by call (the oracle: tests/helpers/vllm_oracle.py).

Both implementations get the same call sequences (hand-written scenarios and hypothesis
programs); after every call the test asserts equal hit tokens, hit blocks, returned block
ids, allocation success, free-block count, usage, the free queue in order, each request's
blocks, the hash index and the prefix-cache statistics. Skipped when vllm is not installed
(tox's ``tests`` environment installs it: ``pip install --no-deps vllm==0.33.0``).
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtool.serving.kvpool import KVPool
from tests.helpers.vllm_oracle import Seq, VLLMCore, block_hasher_for, key_bytes, load_vllm_core


@pytest.fixture(scope="module")
def core() -> VLLMCore:
    try:
        return load_vllm_core()
    except ImportError as exc:  # pragma: no cover - depends on the environment
        pytest.skip(f"vLLM's code is not available ({exc}); tox installs vllm==0.33.0 --no-deps")


class Twin:
    """A KVPool and a vLLM KVCacheManager driven by the same calls, compared after each."""

    def __init__(self, core: VLLMCore, num_blocks: int, block_tokens: int, *,
                 max_model_len: int = 1 << 20, watermark: float = 0.0, caching: bool = True) -> None:
        self.core = core
        self.B = block_tokens
        self.pool = KVPool(num_blocks, block_tokens, caching, max_model_len=max_model_len,
                           watermark=watermark)
        self.mgr = core.make_manager(num_blocks, block_tokens, max_model_len=max_model_len,
                                     enable_caching=caching, watermark=watermark)
        self.seqs: dict[str, Seq] = {}
        self.reqs: dict[str, Any] = {}
        self.keys_seen: set[int] = set()
        self.hits: list[int] = []

    # -- requests -------------------------------------------------------------------------

    def new(self, rid: str, keys: list[int], prompt_tokens: int) -> None:
        """A waiting request whose token stream has block keys ``keys``."""
        self.seqs[rid] = Seq(rid, keys, prompt_tokens, self.B)
        self.keys_seen.update(keys)
        sp = self.core.request.SamplingParams(max_tokens=1 << 20)
        self.reqs[rid] = self.core.request.Request(
            rid, [0] * prompt_tokens, sp, None,
            block_hasher=block_hasher_for([key_bytes(k) for k in keys], self.B))
        assert [key_bytes(k) for k in self.seqs[rid].block_hashes] == self.reqs[rid].block_hashes

    @property
    def running(self) -> bool:
        return any(r.status == self.core.request.RequestStatus.RUNNING for r in self.reqs.values())

    def admit(self, rid: str, chunk: int | None = None, *, full_sequence_must_fit: bool = True,
              lookahead: int = 0) -> bool:
        """The scheduler's waiting path: look up, allocate, count; return success."""
        seq, req = self.seqs[rid], self.reqs[rid]
        blocks_a, hit_a = self.pool.get_computed_blocks(seq)
        blocks_b, hit_b, _ = self.mgr.get_computed_blocks(req)
        assert hit_a == hit_b
        assert blocks_a == blocks_b.get_block_ids()[0]
        todo = seq.num_tokens - seq.num_computed_tokens - hit_a
        n = todo if chunk is None else max(1, min(chunk, todo))
        scheduled = self.running
        new_a = self.pool.allocate_slots(seq, n, hit_a, blocks_a, lookahead,
                                         full_sequence_must_fit=full_sequence_must_fit,
                                         has_scheduled_reqs=scheduled)
        new_b = self.mgr.allocate_slots(req, n, num_new_computed_tokens=hit_b,
                                        new_computed_blocks=blocks_b, num_lookahead_tokens=lookahead,
                                        full_sequence_must_fit=full_sequence_must_fit,
                                        has_scheduled_reqs=scheduled)
        self.same_new(new_a, new_b)
        if new_a is not None:
            preempted = req.num_preemptions > 0
            self.pool.record_prefix_cache_stats(seq, hit_a, preempted)
            self.mgr.record_prefix_cache_stats(req, hit_b)
            req.status = self.core.request.RequestStatus.RUNNING
            self.hits.append(hit_a)
            self._advance(rid, hit_a + n)
        self.check()
        return new_a is not None

    def step(self, rid: str, n: int | None = None, lookahead: int = 0) -> bool:
        """The scheduler's running path: ``n`` more tokens (default: the rest, or one decode)."""
        seq, req = self.seqs[rid], self.reqs[rid]
        todo = seq.num_tokens - seq.num_computed_tokens
        n = todo if n is None else max(1, min(n, todo))
        new_a = self.pool.allocate_slots(seq, n, num_lookahead_tokens=lookahead)
        new_b = self.mgr.allocate_slots(req, n, num_lookahead_tokens=lookahead)
        self.same_new(new_a, new_b)
        if new_a is not None:
            self._advance(rid, seq.num_computed_tokens + n)
        self.check()
        return new_a is not None

    def _advance(self, rid: str, computed: int) -> None:
        """The step ran: ``computed`` tokens; a finished prefill or decode samples one token."""
        seq, req = self.seqs[rid], self.reqs[rid]
        seq.num_computed_tokens = req.num_computed_tokens = computed
        if computed == seq.num_tokens:
            seq.num_tokens += 1
            req.append_output_token_ids(0)
            assert [key_bytes(k) for k in seq.block_hashes] == req.block_hashes

    def free(self, rid: str) -> None:
        """The request finished."""
        self.pool.free(self.seqs.pop(rid))
        req = self.reqs.pop(rid)
        req.status = self.core.request.RequestStatus.FINISHED_STOPPED
        self.mgr.free(req)
        self.check()

    def preempt(self, rid: str) -> None:
        """Preemption by recompute: free everything, back to waiting."""
        seq, req = self.seqs[rid], self.reqs[rid]
        self.pool.free(seq)
        self.mgr.free(req)
        seq.num_computed_tokens = req.num_computed_tokens = 0
        req.status = self.core.request.RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.check()

    # -- comparison -----------------------------------------------------------------------

    @staticmethod
    def same_new(new_a: list[int] | None, new_b: Any) -> None:
        assert (new_a is None) == (new_b is None), (new_a, new_b)
        if new_a is not None:
            assert new_a == new_b.get_block_ids()[0]

    def check(self) -> None:
        pool, bp = self.pool, self.mgr.block_pool
        pool.check()
        assert pool.num_free_blocks == bp.get_num_free_blocks()
        assert pool.usage == pytest.approx(self.mgr.usage)
        assert pool.free_queue() == [b.block_id for b in bp.free_block_queue.get_all_free_blocks()]
        for rid in self.seqs:
            assert pool.get_block_ids(rid) == self.mgr.get_block_ids(rid)[0], rid
        kvu = self.core.kv_cache_utils
        for k in self.keys_seen:
            blk = bp.cached_block_hash_to_block.get_one_block(
                kvu.make_block_hash_with_group_id(key_bytes(k), 0))
            assert pool.hash_index.get(k) == (blk.block_id if blk is not None else None), k
        for b in range(1, pool.num_gpu_blocks):
            h = bp.blocks[b].block_hash
            mine_key = pool.block_key(b)
            assert (None if h is None else kvu.get_block_hash(h)) == (
                None if mine_key is None else key_bytes(int(mine_key)))  # type: ignore[call-overload]
        stats = self.mgr.prefix_cache_stats
        mine = pool.prefix_cache_stats
        assert (mine.requests, mine.queries, mine.hits) == (stats.requests, stats.queries, stats.hits)
        assert (mine.preempted_requests, mine.preempted_queries, mine.preempted_hits) == (
            stats.preempted_requests, stats.preempted_queries, stats.preempted_hits)


def session_keys(session: int, n_blocks: int, shared: int = 0) -> list[int]:
    """Chained keys of a session's stream: ``shared`` leading blocks common to all sessions."""
    return [1_000_000 + i if i < shared else session * 10_000 + i for i in range(n_blocks)]


# -- hand-written scenarios ---------------------------------------------------------------


def test_exact_multiple_recomputes_last_block_and_caches_a_second_copy(core: VLLMCore) -> None:
    t = Twin(core, 10, 4)
    keys = session_keys(1, 4)
    t.new("a", keys, 12)
    assert t.admit("a")
    t.free("a")
    t.new("b", keys, 12)          # same 12 tokens: hit capped at 8, block 3 recomputed
    assert t.admit("b")
    assert t.hits == [0, 8]
    assert t.pool.num_cached_blocks == 4     # keys 0, 1, 2 and a second copy of key 2
    t.free("b")
    t.new("c", keys, 13)          # a later hit gets the first-cached copy
    assert t.admit("c")
    assert t.hits[-1] == 12


def test_multi_turn_sessions_sharing_a_system_prompt(core: VLLMCore) -> None:
    t = Twin(core, 40, 4)
    lengths = {1: 0, 2: 0, 3: 0}
    for turn in range(4):
        for s in (1, 2, 3):
            prompt = lengths[s] + 7 + s
            rid = f"s{s}t{turn}"
            t.new(rid, session_keys(s, prompt // 4 + 8, shared=3), prompt)
            assert t.admit(rid, chunk=6)
            while t.seqs[rid].num_computed_tokens < prompt:
                assert t.step(rid, 6)
            for _ in range(5):   # decode grows the stream and its keys
                assert t.step(rid)
            lengths[s] = t.seqs[rid].num_tokens
            t.free(rid)
    assert max(t.hits) > 12


def test_pool_pressure_refuses_without_change_then_retries(core: VLLMCore) -> None:
    t = Twin(core, 8, 4)             # 7 usable blocks
    t.new("a", session_keys(1, 6), 20)
    assert t.admit("a")                # 6 blocks (20 + 1 output token)
    t.new("b", session_keys(2, 4), 10)
    assert not t.admit("b")            # needs 3, 1 free: None, nothing changed
    assert not t.admit("b", full_sequence_must_fit=False)
    t.free("a")
    assert t.admit("b")                # evicts a's blocks from the queue's head


def test_hit_blocks_in_the_free_queue_count_as_consumed(core: VLLMCore) -> None:
    t = Twin(core, 8, 4)             # 7 usable blocks
    t.new("a", session_keys(1, 4), 12)
    assert t.admit("a")                # 3 blocks, cached
    t.free("a")
    t.new("b", session_keys(2, 5), 16)
    assert t.admit("b")                # 4 fresh blocks: the 3 free ones are a's cached blocks
    t.new("c", session_keys(1, 4), 13)
    assert not t.admit("c")            # hit 12 tokens (3 free blocks) + 1 new block > 3 free
    t.free("b")
    assert t.admit("c")


def test_watermark_only_while_others_run(core: VLLMCore) -> None:
    t = Twin(core, 8, 4, watermark=0.25)     # keep 2 blocks free when others run
    t.new("a", session_keys(1, 8), 27)
    assert t.admit("a")                      # 7 blocks: nothing else runs, no watermark
    t.free("a")
    t.new("b", session_keys(2, 2), 5)
    assert t.admit("b")                      # 2 blocks
    t.new("c", session_keys(3, 4), 14)
    assert not t.admit("c")                  # 4 blocks + watermark 2 > 5 free
    assert not t.admit("c", 13, full_sequence_must_fit=False)   # the chunk alone: same
    assert t.admit("c", 8, full_sequence_must_fit=False)   # 2 + 2 <= 5


def test_three_copies_of_a_block_are_used_oldest_first(core: VLLMCore) -> None:
    t = Twin(core, 12, 4)
    keys = session_keys(1, 3)
    for rid in ("a", "b", "c"):        # each recomputes the last block: three copies
        t.new(rid, keys, 8)
        assert t.admit(rid)
    assert t.pool.num_cached_blocks == 4
    t.free("a")
    t.new("d", session_keys(2, 9), 32)
    assert t.admit("d")                # takes every free block, a's copy last
    t.free("d")
    t.new("e", keys, 9)                # b's copy is now the one found
    assert t.admit("e")
    assert t.hits[-1] == 8


def test_requests_freed_in_different_orders(core: VLLMCore) -> None:
    for order in (("a", "b", "c"), ("c", "b", "a"), ("b", "a", "c")):
        t = Twin(core, 30, 4)
        for i, rid in enumerate(("a", "b", "c")):
            t.new(rid, session_keys(i + 1, 6, shared=2), 17)
            assert t.admit(rid)
        for rid in order:
            t.free(rid)
        for i, rid in enumerate(("x", "y")):   # reuse: which cached blocks survive
            t.new(rid, session_keys(9 + i, 8), 30)
            assert t.admit(rid)
        for i in range(3):
            t.new(f"again{i}", session_keys(i + 1, 6, shared=2), 17)
            assert t.admit(f"again{i}")


def test_preemption_free_and_retry(core: VLLMCore) -> None:
    t = Twin(core, 12, 4, watermark=0.2)
    t.new("a", session_keys(1, 8), 18)
    t.new("b", session_keys(2, 8), 14)
    assert t.admit("a", chunk=8)
    assert t.admit("b", chunk=8)
    while t.step("a"):
        pass                               # grows until the pool is full
    t.preempt("b")
    assert t.step("a")
    t.free("a")
    assert t.admit("b")                    # resumed request: counted as preempted
    assert t.pool.prefix_cache_stats.preempted_requests == 1


def test_lookahead_and_external_tokens(core: VLLMCore) -> None:
    t = Twin(core, 20, 4)
    t.new("a", session_keys(1, 5), 9)
    assert t.admit("a", lookahead=3)
    assert t.step("a", lookahead=5)
    seq, req = t.seqs["a"], t.reqs["a"]
    t.free("a")
    # A connector-loaded prefix (external tokens) gets fresh blocks and is cached.
    t.new("b", session_keys(2, 6), 22)
    seq, req = t.seqs["b"], t.reqs["b"]
    new_a = t.pool.allocate_slots(seq, 6, 0, [], num_external_computed_tokens=16)
    new_b = t.mgr.allocate_slots(req, 6, num_external_computed_tokens=16)
    t.same_new(new_a, new_b)
    t.check()


def test_max_model_len_and_no_caching(core: VLLMCore) -> None:
    t = Twin(core, 16, 4, max_model_len=10)
    t.new("a", session_keys(1, 3), 9)
    assert t.admit("a")
    assert t.step("a")
    t = Twin(core, 16, 4, caching=False)
    t.new("a", session_keys(1, 3), 9)
    assert t.admit("a")
    t.free("a")
    t.new("b", session_keys(1, 3), 9)
    assert t.admit("b")
    assert t.hits == [0, 0]


# -- random programs ----------------------------------------------------------------------


PROGRAMS = dict(data=st.data(), num_blocks=st.integers(2, 40),
                block_tokens=st.sampled_from([1, 2, 4, 16]), watermark=st.sampled_from([0.0, 0.1]),
                must_fit=st.booleans())


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**PROGRAMS)
def test_random_programs_match_vllm(core: VLLMCore, data: st.DataObject, num_blocks: int,
                                    block_tokens: int, watermark: float, must_fit: bool) -> None:
    random_program(core, data, num_blocks, block_tokens, watermark, must_fit)


@pytest.mark.slow
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**PROGRAMS)
def test_many_random_programs_match_vllm(core: VLLMCore, data: st.DataObject, num_blocks: int,
                                         block_tokens: int, watermark: float, must_fit: bool) -> None:
    random_program(core, data, num_blocks, block_tokens, watermark, must_fit)


def random_program(core: VLLMCore, data: st.DataObject, num_blocks: int, block_tokens: int,
                   watermark: float, must_fit: bool) -> None:
    """Sessions come and go: new requests, admissions (chunked, with lookahead), prefill
    and decode steps, finishes and preemptions, in an order hypothesis draws."""
    t = Twin(core, num_blocks, block_tokens, watermark=watermark)
    B = block_tokens
    lengths = [0] * 6
    waiting: list[str] = []
    busy: set[int] = set()
    serial = 0
    session_of: dict[str, int] = {}
    for _ in range(data.draw(st.integers(1, 40), label="ops")):
        running = [r for r in t.seqs if r not in waiting]
        op = data.draw(st.sampled_from(["new", "new", "admit", "admit", "step", "step", "free",
                                        "preempt"]), label="op")
        if op == "new":
            free_sessions = [s for s in range(6) if s not in busy]
            if not free_sessions:
                continue
            s = data.draw(st.sampled_from(free_sessions), label="session")
            prompt = lengths[s] + data.draw(st.integers(1, 3 * B + 1), label="new tokens")
            serial += 1
            rid = f"r{serial}"
            t.new(rid, session_keys(s, prompt // B + 12, shared=data.draw(st.integers(0, 2))), prompt)
            session_of[rid] = s
            busy.add(s)
            waiting.append(rid)
        elif op == "admit" and waiting:
            rid = waiting[0]
            chunk = data.draw(st.one_of(st.none(), st.integers(1, 3 * B)), label="chunk")
            if t.admit(rid, chunk, full_sequence_must_fit=must_fit,
                       lookahead=data.draw(st.sampled_from([0, 0, 1, B]), label="lookahead")):
                waiting.pop(0)
        elif op == "step" and running:
            rid = data.draw(st.sampled_from(running), label="running")
            t.step(rid, data.draw(st.one_of(st.none(), st.integers(1, 2 * B)), label="n"))
        elif op == "free" and running:
            rid = data.draw(st.sampled_from(running), label="finished")
            s = session_of[rid]
            lengths[s] = t.seqs[rid].num_tokens
            busy.discard(s)
            t.free(rid)
        elif op == "preempt" and running:
            rid = data.draw(st.sampled_from(running), label="preempted")
            t.preempt(rid)
            waiting.insert(0, rid)
