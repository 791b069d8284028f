"""vLLM v1's prefix-cache KV pool: ``KVCacheManager`` + ``BlockPool`` for one full-attention group.

:class:`KVPool` reproduces, call by call, what vLLM 0.33.0's ``KVCacheManager`` (with a
``UnitaryKVCacheCoordinator``, one ``FullAttentionManager`` and its ``BlockPool``) does to
its block pool (``vllm/v1/core/{kv_cache_manager,kv_cache_coordinator,
single_type_kv_cache_manager,block_pool,kv_cache_utils}.py``). Equality with vLLM's own code,
request by request, is tested in ``tests/serving/test_kvpool_vllm.py``. The semantics:

* Block 0 is the null block: ``num_gpu_blocks`` blocks give ``num_gpu_blocks - 1`` usable.
* The free queue is a doubly linked list in eviction order. New blocks come from its head;
  a newly allocated block that still holds a cached hash is evicted from the hash index
  then (a freed block keeps its hash, and can still hit, until its slot is reused).
* A request's blocks are freed tail-first: those with a hash go to the back of the queue
  (in that order, so a request's last block goes before its first one, and the least
  recently freed request first); those without go to the front. A hit block leaves the
  queue while a request holds it and rejoins at the back when its last holder frees it.
* Only full blocks are cached, under the caller's block keys (``seq.block_hashes``: one per
  full block of the tokens so far; no hashing here). A hit is capped at
  ``num_tokens - 1`` tokens, rounded down to whole blocks: a fully cached prompt of an
  exact multiple of the block size recomputes its last block.
* A recomputed block whose key is already cached is cached again: both copies occupy the
  pool, and a lookup returns the one cached first while it lasts.
* :meth:`KVPool.allocate_slots` returns ``None`` and changes nothing when too few blocks
  are free, counting hit blocks that sit in the free queue as consumed, keeping
  ``reserved_blocks`` free and, for a request being admitted while others run, the
  watermark too.

What is left out, because one full-attention group with ``hash_block_size ==
block_size`` never reaches it in vLLM either: sliding windows, Mamba, cross attention,
partial-block (fine-grained) hits and their copy-on-write, EAGLE's last-block drop, KV
events and multimodal keys.

Invariants (checked by ``check()`` in the tests): every block is exactly one of the null
block, in the free queue (``ref == 0``) or held (``ref > 0``); ``num_free_blocks`` is the
queue's length; a key in the hash index names blocks whose ``key`` is that key.
"""

from __future__ import annotations

import sys
from collections.abc import Hashable, Iterable, Sequence
from typing import Final, Protocol

NULL_BLOCK: Final = 0
"""Block id of vLLM's null block: never allocated, never freed, never cached."""


class SeqLike(Protocol):
    """What the pool reads of a request (the attributes of vLLM's ``Request`` it uses)."""

    @property
    def request_id(self) -> str: ...

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens so far (vLLM ``Request.num_tokens``)."""

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def num_computed_tokens(self) -> int: ...

    @property
    def block_hashes(self) -> Sequence[Hashable]:
        """One key per full block of the tokens so far, head first (chained keys)."""


class PrefixCacheStats:
    """Prefix-cache hit statistics, as vLLM's ``PrefixCacheStats`` (``vllm/v1/metrics/stats.py``).

    ``queries`` counts the tokens of the requests looked up (``num_tokens`` at admission),
    ``hits`` the tokens found cached; a request admitted again after a preemption goes to
    the ``preempted_*`` counters instead.
    """

    __slots__ = (
        "hits",
        "preempted_hits",
        "preempted_queries",
        "preempted_requests",
        "queries",
        "requests",
    )

    def __init__(self) -> None:
        self.requests = 0
        self.queries = 0
        self.hits = 0
        self.preempted_requests = 0
        self.preempted_queries = 0
        self.preempted_hits = 0

    def record(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        """Add one admitted request (vLLM ``PrefixCacheStats.record``)."""
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
            return
        self.requests += 1
        self.queries += num_tokens
        self.hits += num_hits

    @property
    def hit_rate(self) -> float:
        """Hit tokens over queried tokens of the non-preempted requests (0 when none)."""
        return self.hits / self.queries if self.queries else 0.0

    def as_dict(self) -> dict[str, int | float]:
        return {"requests": self.requests, "queries": self.queries, "hits": self.hits,
                "hit_rate": self.hit_rate, "preempted_requests": self.preempted_requests,
                "preempted_queries": self.preempted_queries,
                "preempted_hits": self.preempted_hits}


class KVPool:
    """vLLM v1 ``KVCacheManager`` + ``BlockPool`` for one full-attention KV cache group.

    Blocks are ints (``0 .. num_gpu_blocks - 1``); per-block state lives in parallel
    lists (``_ref``, ``_key``, ``_prev``, ``_next``) rather than objects, for speed. The free
    queue is the doubly linked list of vLLM's ``FreeKVCacheBlockQueue`` with two sentinels
    (ids ``num_gpu_blocks`` and ``num_gpu_blocks + 1``); a block outside it has
    ``_prev == _next == -1``.

    ``max_model_len`` caps the slots of one request as in vLLM (``None``: no cap);
    ``watermark`` is ``SchedulerConfig.watermark`` (a fraction of all blocks kept free when
    admitting a request while others are running).
    """

    __slots__ = (
        "_cached",
        "_dups",
        "_head",
        "_key",
        "_next",
        "_num_cached",
        "_num_free",
        "_prev",
        "_ref",
        "_req_blocks",
        "_stack",
        "_tail",
        "block_tokens",
        "enable_caching",
        "evicted_keys",
        "evictions",
        "max_model_len",
        "num_gpu_blocks",
        "prefix_cache_stats",
        "watermark_blocks",
    )

    def __init__(self, num_gpu_blocks: int, block_tokens: int, enable_caching: bool = True, *,
                 max_model_len: int | None = None, watermark: float = 0.0) -> None:
        if num_gpu_blocks < 1:
            raise ValueError(f"num_gpu_blocks must be at least 1, not {num_gpu_blocks}")
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be at least 1, not {block_tokens}")
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), not {watermark}")
        n = num_gpu_blocks
        self.num_gpu_blocks = n
        self.block_tokens = block_tokens
        self.enable_caching = enable_caching
        self.max_model_len = sys.maxsize if max_model_len is None else max_model_len
        self.watermark_blocks = int(watermark * n)
        self.prefix_cache_stats = PrefixCacheStats()
        self.evictions = 0
        """Cached blocks whose slot was reused (duplicate copies included), since creation."""
        self.evicted_keys: list[Hashable] | None = None
        """When a list, keys that leave the hash index (no copy left) are appended to it."""
        self._ref = [0] * n
        self._key: list[Hashable | None] = [None] * n
        head, tail = n, n + 1
        self._head, self._tail = head, tail
        self._prev: list[int] = []
        self._next: list[int] = []
        # Queue initially 1, 2, …, n-1: block 0 was popped from the head as the null block.
        self._stack: list[int] | None = None
        """Without prefix caching, while no request holds a block twice: the free queue as
        a stack, its head last (``_prev``, ``_next`` and ``_ref`` unused until
        :meth:`_unstack`). No block is ever cached then, so every freed block goes to the
        front: a request's blocks, freed tail first, are pushed in their order."""
        if enable_caching:
            self._link(range(1, n))
        else:
            self._stack = list(range(n - 1, 0, -1))
        self._num_free = n - 1
        self._cached: dict[Hashable, int] = {}       # key -> first-cached block holding it
        self._dups: dict[Hashable, list[int]] = {}   # key -> later copies, oldest first
        self._req_blocks: dict[str, list[int]] = {}  # request -> its blocks, head first
        self._num_cached: dict[str, int] = {}        # request -> how many of them are cached

    # -- vLLM KVCacheManager API ----------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks in the free queue, cached ones included (``BlockPool.get_num_free_blocks``)."""
        return self._num_free

    @property
    def usage(self) -> float:
        """Fraction of the usable blocks held by requests (``BlockPool.get_usage``)."""
        total = self.num_gpu_blocks - 1
        return 1.0 - self._num_free / total if total else 0.0

    def get_computed_blocks(self, seq: SeqLike, max_cache_hit_length: int | None = None
                            ) -> tuple[list[int], int]:
        """The longest cached prefix of ``seq``: its blocks and its length in tokens.

        The hit is at most ``max_cache_hit_length`` tokens (default ``num_tokens - 1``, so
        the last token is always computed) rounded down to whole blocks. No side effect.
        """
        if not self.enable_caching:
            return [], 0
        if max_cache_hit_length is None:
            max_cache_hit_length = seq.num_tokens - 1
        cached = self._cached
        blocks: list[int] = []
        append = blocks.append
        hashes = seq.block_hashes
        for i in range(min(max_cache_hit_length // self.block_tokens, len(hashes))):
            b = cached.get(hashes[i])
            if b is None:
                break
            append(b)
        return blocks, len(blocks) * self.block_tokens

    def allocate_slots(self, seq: SeqLike, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: Sequence[int] | None = None, num_lookahead_tokens: int = 0,
                       num_external_computed_tokens: int = 0, delay_cache_blocks: bool = False, *,
                       full_sequence_must_fit: bool = False, reserved_blocks: int = 0,
                       has_scheduled_reqs: bool = True) -> list[int] | None:
        """Give ``seq`` slots for ``num_new_tokens`` more tokens; return the new block ids.

        Mirrors ``KVCacheManager.allocate_slots``: ``new_computed_blocks`` are the blocks of
        a hit from :meth:`get_computed_blocks` (``num_new_computed_tokens`` tokens), taken
        from the free queue if they sit there; ``num_external_computed_tokens`` are tokens
        a connector loads (given fresh blocks). Returns ``None`` and changes nothing when
        ``free - reserved_blocks`` is short of the blocks needed plus the watermark. The
        watermark applies to a request being admitted (holding no blocks here, vLLM's
        WAITING/PREEMPTED) while ``has_scheduled_reqs``. With ``full_sequence_must_fit``
        (what vLLM's scheduler passes when admitting, ``scheduler_reserve_full_isl``) the
        whole ``num_tokens`` must also fit in the free blocks. Full blocks up to
        ``min(computed + num_new_tokens, num_tokens)`` are cached unless
        ``delay_cache_blocks``.
        """
        if num_new_tokens == 0 and num_external_computed_tokens == 0 and num_new_computed_tokens == 0:
            raise ValueError("num_new_tokens must be greater than 0 when there are no computed "
                             "tokens to adopt")
        computed = new_computed_blocks or ()
        rid = seq.request_id
        req_blocks = self._req_blocks.get(rid)
        num_local = seq.num_computed_tokens + num_new_computed_tokens
        mml = self.max_model_len
        total_computed = num_local + num_external_computed_tokens
        if total_computed > mml:
            total_computed = mml
        watermark = self.watermark_blocks if has_scheduled_reqs and req_blocks is None else 0
        # _num_blocks_to_allocate(rid, req_blocks, tokens, computed) is ceil(tokens / B)
        # less ``less``, at least 0, plus ``evictable`` (written out: it runs for every step)
        B = self.block_tokens
        less = len(req_blocks) if req_blocks is not None else 0
        evictable = 0
        if computed:
            if rid in self._num_cached:
                raise ValueError(f"request {rid!r} is running and cannot take new computed blocks")
            if self._stack is not None:
                self._unstack()
            ref = self._ref
            for b in computed:
                if ref[b] == 0:
                    evictable += 1
            less += len(computed)
        free = self._num_free

        if full_sequence_must_fit:
            tokens = seq.num_tokens
            need = -(-(tokens if tokens < mml else mml) // B) - less
            if (need if need > 0 else 0) + evictable + watermark > free:
                return None

        num_need_slot = total_computed + num_new_tokens + num_lookahead_tokens
        if num_need_slot > mml:
            num_need_slot = mml
        need = -(-num_need_slot // B) - less
        if (need if need > 0 else 0) + evictable + watermark > free - reserved_blocks:
            return None

        if (computed or num_external_computed_tokens > 0) and rid not in self._num_cached:
            # (a running request, already in _num_cached, adopts nothing: vLLM's
            # coordinator returns)
            req_blocks = self._adopt(rid, req_blocks, computed, num_local,
                                     num_external_computed_tokens)

        if req_blocks is None:
            req_blocks = self._req_blocks[rid] = []
        n_new = -(-num_need_slot // B) - len(req_blocks)
        new_blocks = self._get_new_blocks(n_new) if n_new > 0 else []
        req_blocks.extend(new_blocks)

        if not delay_cache_blocks and self.enable_caching:
            tokens = total_computed + num_new_tokens
            self._cache_blocks(seq, req_blocks, tokens if tokens < seq.num_tokens else seq.num_tokens)
        return new_blocks

    def _adopt(self, rid: str, req_blocks: list[int] | None, computed: Sequence[int],
               num_local: int, num_external_computed_tokens: int) -> list[int]:
        """``add_local_computed_blocks``: request ``rid`` takes the hit blocks ``computed``
        (touched first; ``num_local`` tokens computed with them), and fresh blocks for the
        tokens a connector loads; its blocks."""
        if req_blocks is None:
            req_blocks = self._req_blocks[rid] = []
        self._touch(computed)
        req_blocks.extend(computed)
        self._num_cached[rid] = len(req_blocks)
        if num_external_computed_tokens > 0:
            n_ext = (-(-(num_local + num_external_computed_tokens) // self.block_tokens)
                     - len(req_blocks))
            if n_ext > 0:
                req_blocks.extend(self._get_new_blocks(n_ext))
        return req_blocks

    def allocate_running(self, seq: SeqLike, num_new_tokens: int) -> list[int] | None:
        """``allocate_slots(seq, num_new_tokens)`` for a request that holds blocks (a running
        one: no hit to adopt, nothing to load, no watermark): the same blocks, caching and
        answer, without the admission's cases (the scheduler's call for every running
        request it steps). Any other request goes to :meth:`allocate_slots`."""
        req_blocks = self._req_blocks.get(seq.request_id)
        if req_blocks is None or num_new_tokens <= 0:
            return self.allocate_slots(seq, num_new_tokens)
        mml = self.max_model_len
        computed = seq.num_computed_tokens
        if computed > mml:
            computed = mml
        slots = computed + num_new_tokens
        if slots > mml:
            slots = mml
        n_new = -(-slots // self.block_tokens) - len(req_blocks)
        if n_new > self._num_free:
            return None
        new_blocks = self._get_new_blocks(n_new) if n_new > 0 else []
        req_blocks.extend(new_blocks)
        if self.enable_caching:
            tokens = computed + num_new_tokens
            self._cache_blocks(seq, req_blocks, tokens if tokens < seq.num_tokens else seq.num_tokens)
        return new_blocks

    def cache_blocks(self, seq: SeqLike, num_computed_tokens: int) -> None:
        """Cache ``seq``'s full blocks up to ``num_computed_tokens`` (after a delayed load)."""
        if self.enable_caching:
            self._cache_blocks(seq, self._req_blocks.get(seq.request_id, []), num_computed_tokens)

    def free(self, seq: SeqLike) -> None:
        """Release ``seq``'s blocks, tail first (``KVCacheManager.free``)."""
        rid = seq.request_id
        blocks = self._req_blocks.pop(rid, None)
        self._num_cached.pop(rid, None)
        if blocks:
            stack = self._stack
            if stack is not None:
                stack.extend(blocks)  # reversed(blocks) to the front, in that order
                self._num_free += len(blocks)
            else:
                self._free_blocks(reversed(blocks))

    def record_prefix_cache_stats(self, seq: SeqLike, num_hits: int, preempted: bool = False) -> None:
        """Count one admitted request's lookup (vLLM's scheduler calls this after admission)."""
        if self.enable_caching:
            self.prefix_cache_stats.record(seq.num_tokens, num_hits, preempted)

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """Return the statistics so far and start new ones (``make_prefix_cache_stats``)."""
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

    def get_block_ids(self, request_id: str) -> list[int]:
        """The blocks ``request_id`` holds, head first (a copy)."""
        return list(self._req_blocks.get(request_id, ()))

    # -- kvtool additions (no side effect) --------------------------------------------------

    def full_sequence_need(self, seq: SeqLike, new_computed_blocks: Sequence[int] = (), *,
                           has_scheduled_reqs: bool = True) -> int:
        """The free blocks ``allocate_slots(seq, …, new_computed_blocks,
        full_sequence_must_fit=True, has_scheduled_reqs=…)`` asks for in its whole-sequence
        check (``reserved_blocks`` 0; the watermark included). For a request whose new slots
        stop at or before ``num_tokens`` (an admission: its prompt, or a chunk of it, or a
        connector's load) that check decides the call: its other check asks for no more."""
        rid = seq.request_id
        req_blocks = self._req_blocks.get(rid)
        watermark = self.watermark_blocks if has_scheduled_reqs and req_blocks is None else 0
        return watermark + self._num_blocks_to_allocate(
            rid, req_blocks, min(seq.num_tokens, self.max_model_len), new_computed_blocks)

    def full_sequence_fits(self, seq: SeqLike, new_computed_blocks: Sequence[int] = (), *,
                           has_scheduled_reqs: bool = True) -> bool:
        """Whether :meth:`full_sequence_need` blocks are free."""
        return self.full_sequence_need(seq, new_computed_blocks,
                                       has_scheduled_reqs=has_scheduled_reqs) <= self._num_free

    def cached_prefix_blocks(self, keys: Iterable[Hashable]) -> int:
        """How many leading ``keys`` are in the hash index (for routers; no side effect)."""
        # every key tested in C (map), then the first miss found in C (list.index): for a
        # router asking about long prompts on every engine this beats a Python loop
        found = list(map(self._cached.__contains__, keys))
        try:
            return found.index(False)
        except ValueError:
            return len(found)

    @property
    def hash_index(self) -> dict[Hashable, int]:
        """The hash index: cached key → the block a lookup returns (read it, never write it).

        The same dict for the pool's whole life, so ``key in pool.hash_index`` can be bound
        once (the replay hierarchy's lookup does).
        """
        return self._cached

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop these blocks' keys from the hash index; the blocks stay where they are
        (``BlockPool.evict_blocks``)."""
        for b in block_ids:
            if self._key[b] is not None:
                self._evict(b)

    def free_queue(self) -> list[int]:
        """Block ids in the free queue, head (next to be reused) first."""
        if self._stack is not None:
            return self._stack[::-1]
        out = []
        nxt = self._next
        b = nxt[self._head]
        while b != self._tail:
            out.append(b)
            b = nxt[b]
        return out

    def block_key(self, block: int) -> Hashable | None:
        """The key ``block`` is cached under, or ``None``."""
        return self._key[block]

    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding a cached key (held or free), duplicates included."""
        return len(self._cached) + sum(len(v) for v in self._dups.values())

    def check(self) -> None:
        """Assert the invariants of the module docstring (for tests; O(n))."""
        stack = self._stack
        if stack is not None:  # no prefix caching: every block free or held once
            assert len(stack) == self._num_free, (len(stack), self._num_free)
            held_list = [b for blocks in self._req_blocks.values() for b in blocks]
            assert sorted(stack + held_list) == list(range(1, self.num_gpu_blocks))
            assert not self._cached and not self._dups
            assert all(k is None for k in self._key)
            return
        queue = self.free_queue()
        assert len(queue) == self._num_free, (len(queue), self._num_free)
        in_queue = set(queue)
        assert len(in_queue) == len(queue) and NULL_BLOCK not in in_queue
        for b in range(1, self.num_gpu_blocks):
            assert (self._ref[b] == 0) == (b in in_queue), b
        held: dict[int, int] = {}
        for blocks in self._req_blocks.values():
            for b in blocks:
                held[b] = held.get(b, 0) + 1
        for b in range(1, self.num_gpu_blocks):
            assert self._ref[b] == held.get(b, 0), (b, self._ref[b], held.get(b, 0))
        for key, b in self._cached.items():
            assert self._key[b] == key
            for d in self._dups.get(key, ()):
                assert self._key[d] == key
        assert all(v for v in self._dups.values()) and self._dups.keys() <= self._cached.keys()
        assert self.num_cached_blocks == sum(k is not None for k in self._key)

    # -- BlockPool internals ----------------------------------------------------------------

    def _num_blocks_to_allocate(self, rid: str, req_blocks: list[int] | None, num_tokens: int,
                                computed: Sequence[int]) -> int:
        """``SingleTypeKVCacheManager.get_num_blocks_to_allocate`` for full attention."""
        required = -(-num_tokens // self.block_tokens)
        held = len(req_blocks) if req_blocks is not None else 0
        if rid in self._num_cached:
            if computed:
                raise ValueError(f"request {rid!r} is running and cannot take new computed blocks")
            return max(required - held, 0)
        if computed and self._stack is not None:
            self._unstack()
        ref = self._ref
        evictable = 0
        for b in computed:
            if ref[b] == 0:
                evictable += 1
        return max(required - len(computed) - held, 0) + evictable

    def _link(self, blocks: Iterable[int]) -> None:
        """Make the free queue ``blocks`` (head first) as the linked list."""
        n = self.num_gpu_blocks
        head, tail = self._head, self._tail
        nxt = self._next = [-1] * (n + 2)
        prv = self._prev = [-1] * (n + 2)
        p = head
        for b in blocks:
            nxt[p] = b
            prv[b] = p
            p = b
        nxt[p] = tail
        prv[tail] = p

    def _unstack(self) -> None:
        """Leave the stack representation (``_stack``) for the linked list and counts."""
        stack = self._stack
        if stack is None:
            return
        self._stack = None
        self._link(reversed(stack))
        ref = self._ref
        for blocks in self._req_blocks.values():
            for b in blocks:
                ref[b] += 1

    def _get_new_blocks(self, n: int) -> list[int]:
        """Pop ``n`` blocks from the queue's head, evicting their cached keys."""
        if n > self._num_free:
            raise ValueError(f"cannot get {n} free blocks from the pool")
        stack = self._stack
        if stack is not None:  # no key to evict: a slice
            out = stack[-n:]
            del stack[-n:]
            out.reverse()
            self._num_free -= n
            return out
        nxt, prv, ref, key = self._next, self._prev, self._ref, self._key
        out = []
        b = nxt[self._head]
        for _ in range(n):
            out.append(b)
            following = nxt[b]
            nxt[b] = prv[b] = -1
            if key[b] is not None:
                self._evict(b)
            ref[b] = 1
            b = following
        nxt[self._head] = b
        prv[b] = self._head
        self._num_free -= n
        return out

    def _evict(self, b: int) -> None:
        """Drop block ``b``'s key from the hash index (its slot is being reused)."""
        k = self._key[b]
        self._key[b] = None
        self.evictions += 1
        dups = self._dups.get(k)
        if self._cached.get(k) == b:
            if dups:
                self._cached[k] = dups.pop(0)
                if not dups:
                    del self._dups[k]
            else:
                del self._cached[k]
                if self.evicted_keys is not None:
                    self.evicted_keys.append(k)
        elif dups is not None:
            dups.remove(b)
            if not dups:
                del self._dups[k]

    def _touch(self, blocks: Sequence[int]) -> None:
        """A hit: take the blocks out of the free queue if there, and hold them once more."""
        if blocks and self._stack is not None:
            self._unstack()  # a block may be held twice now
        ref, nxt, prv = self._ref, self._next, self._prev
        for b in blocks:
            if ref[b] == 0:
                p, q = prv[b], nxt[b]
                nxt[p] = q
                prv[q] = p
                nxt[b] = prv[b] = -1
                self._num_free -= 1
            ref[b] += 1

    def _free_blocks(self, ordered: Iterable[int]) -> None:
        """``BlockPool.free_blocks``: hashed blocks to the back, others to the front."""
        ref, key = self._ref, self._key
        caching = self.enable_caching
        last: list[int] = []
        first: list[int] = []
        for b in ordered:
            if b == NULL_BLOCK:
                continue
            ref[b] -= 1
            if ref[b] == 0:
                if key[b] is None or not caching:
                    first.append(b)
                else:
                    last.append(b)
        nxt, prv = self._next, self._prev
        if first:
            p = self._head
            old_first = nxt[p]
            for b in first:
                prv[b] = p
                nxt[p] = b
                p = b
            nxt[p] = old_first
            prv[old_first] = p
        if last:
            p = prv[self._tail]
            for b in last:
                prv[b] = p
                nxt[p] = b
                p = b
            nxt[p] = self._tail
            prv[self._tail] = p
        self._num_free += len(first) + len(last)

    def _cache_blocks(self, seq: SeqLike, req_blocks: list[int], num_tokens: int) -> None:
        """``FullAttentionManager.cache_blocks``: index newly full blocks under their keys."""
        rid = seq.request_id
        num_cached = self._num_cached.get(rid, 0)
        hashes = seq.block_hashes
        num_full = min(num_tokens // self.block_tokens, len(hashes))
        if num_cached >= num_full:
            return
        key, cached = self._key, self._cached
        for i in range(num_cached, num_full):
            b = req_blocks[i]
            if b == NULL_BLOCK:
                continue
            k = hashes[i]
            if key[b] is not None:
                continue  # already indexed (vLLM: same block, same key)
            key[b] = k
            first = cached.get(k)
            if first is None:
                cached[k] = b
            else:
                self._dups.setdefault(k, []).append(b)
        self._num_cached[rid] = num_full
