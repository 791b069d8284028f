"""Eviction policies: which cached block of one tier goes first.

A policy owns the block metadata of one tier (which keys are cached, in what order) and
nothing else: no bytes, no capacities, no statistics. The tier (:mod:`kvtool.cache.tier`)
decides *how many* blocks to evict; the policy decides *which*.

Every policy keeps its cached keys in :attr:`EvictionPolicy.index`, a dict whose ``in`` is
the tier's membership test (the lookup loop uses it directly, for speed), and implements:

* :meth:`~EvictionPolicy.access` — one request's blocks (head → tail, as chained keys),
  touched in the policy's order; absent ones are inserted when admitted;
* :meth:`~EvictionPolicy.admit` — blocks arriving without a request (write-back
  demotion from the tier above), inserted as most recent in the order given;
* :meth:`~EvictionPolicy.evict` — remove at least ``n`` blocks (exactly ``n`` unless the
  policy evicts in units, as :class:`OraclePolicy` does) and return them in eviction order;
  :meth:`~EvictionPolicy.discard` does the same and returns only how many (``lru``'s
  skips building the list: a tier without a mover needs no more).

Keys are plain ints (the chained block keys of :mod:`kvtool.trace.hashing` or a
Mooncake trace's ``hash_ids``): no per-block objects, so that a tier of ten million
blocks fits in about 80 bytes per block with ``lru`` (bench/replay_memory.py).

Policies (docs/definitions.md; replay semantics in docs/replay.md):

========================  ===============================================================
``lru``                   head-first LRU: insertion-ordered store, touched head → tail
``lru-tail-first``        vLLM's free queue: touched tail → head, so tails go first
``radix``                 SGLang: LRU among blocks with no cached child (leaf-only)
``prefix-fair``           kvtool's policy: leaf-only, deepest of the oldest leaves first
``oracle``                the fixed-subset bound (docs/plan.md): keep a fixed subset of sessions
``mooncake``              ``lru`` with watermark batch eviction (a tier option)
``vllm``                  vLLM v1's prefix-cache pool exactly (GPU tier only; the default
                          there): :class:`VllmPolicy`
========================  ===============================================================
"""

from __future__ import annotations

import collections
import heapq
import math
from abc import ABC, abstractmethod
from collections import OrderedDict, deque
from collections.abc import Callable, Container
from itertools import compress, islice, repeat, starmap
from typing import TYPE_CHECKING, Any, ClassVar, cast

if TYPE_CHECKING:
    from kvtool.serving.kvpool import KVPool

_tally: Callable[[dict[int, int], list[int]], None] = collections._count_elements  # type: ignore[attr-defined]
"""``_tally(index, keys)``: ``index[k] = index.get(k, 0) + 1`` for each key, in one C call.
It is ``Counter.update``'s engine (CPython has had it since 3.2; ``collections`` defines
it in Python where C is missing). The LRU's reference counts take it for a request's keys:
5 % fewer instructions for a whole replay of the Mooncake conversation trace than the loop
(BENCHMARKS.md, "Issue 23 speed, ninth pass"); ``Counter.update`` itself spends much of
that on its Mapping check."""


class EvictionPolicy(ABC):
    """Order and membership of one tier's cached blocks.

    Invariants: :attr:`index` holds exactly the cached keys; ``len(policy)`` is their
    number; :meth:`evict` only returns keys that were cached and removes them.
    """

    name: ClassVar[str]
    structural: ClassVar[bool] = False
    """True when the policy needs the chain (parent, depth) of every block."""
    pooled: ClassVar[bool] = False
    """True when the policy is a whole block pool that serves requests itself
    (:class:`VllmPolicy`): the hierarchy then hands it each request (``serve_request``)."""

    index: dict[int, Any]

    def __len__(self) -> int:
        return len(self.index)

    def __contains__(self, key: int) -> bool:
        return key in self.index

    @abstractmethod
    def access(self, keys: list[int], session: int, *, admit: bool = True,
               skip: Container[int] | None = None, record: list[int] | None = None) -> int:
        """Touch one request's blocks in this policy's order; return how many were inserted.

        ``keys`` are the request's chained block keys, head first. Cached keys are
        refreshed. Absent keys are inserted only when ``admit`` is true and the key is
        not in ``skip`` (write-through does not copy a block down from an upper-tier hit).
        Inserted keys are appended to ``record`` when it is given (for a data mover).
        ``session`` is a small int naming the request's session (its own id when the trace
        has no sessions).
        """

    @abstractmethod
    def admit(self, keys: list[int]) -> list[int]:
        """Insert blocks that arrive without a request (demotion); return those inserted."""

    @abstractmethod
    def evict(self, n: int) -> list[int]:
        """Remove at least ``n`` cached blocks (fewer only when the tier empties)."""

    def discard(self, n: int) -> int:
        """:meth:`evict`, for a caller that needs only how many blocks went (a tier
        without a mover or a tier below); return that number."""
        return len(self.evict(n))


class LruPolicy(EvictionPolicy):
    """Head-first LRU, the insertion-ordered store (Mooncake lease LRU, old LMCache).

    Order: a request touches its blocks head → tail, so within a chain the head is the
    *least* recent block. Eviction takes the least recently touched block first, which
    under memory pressure is every session's chain head: one eviction kills the whole
    session's reuse (the chain-head cliff: docs/example-collapse.md) and leaves its suffix as dead weight.

    Representation (compact: about 80 bytes per cached block at 10 M blocks,
    bench/replay_memory.py): ``index`` maps each cached key to the number of its
    references in ``order``, a deque of keys in touch order (oldest first) where a touch
    appends one more reference. A key's last reference is its recency; older ones are
    stale. Eviction pops references from the front and evicts a key when it pops the key's
    last one (so it pops exactly LRU order); the deque is rebuilt without stale references
    when they outnumber the cached keys. O(1) amortised touch, insert and evict.
    Invariant: every reference in ``order`` is of a cached key, and ``index[k]`` counts
    ``k``'s references.
    """

    name = "lru"
    tail_first = False
    """Touch a request's blocks last to first, so that a request's tail is the first of
    its blocks to go (:class:`LruTailFirstPolicy`)."""

    def __init__(self) -> None:
        self.index: dict[int, int] = {}
        self.order: deque[int] = deque()
        self.ordered = True
        """False for an unbounded tier: it never evicts, so recency is irrelevant, touches
        are skipped and ``order`` stays empty; see :meth:`unbounded`."""

    def unbounded(self) -> None:
        """Called by an unbounded :class:`~kvtool.cache.tier.Tier` before first use."""
        self.ordered = False
        self.order.clear()

    def compact(self) -> None:
        """Drop stale references when they outnumber the cached keys (amortised O(1))."""
        order, index = self.order, self.index
        if len(order) <= 2 * len(index) + 1024:
            return
        keep: deque[int] = deque()
        push = keep.append
        for key in order:
            c = index.get(key)
            if c == 1:
                push(key)
            elif c is not None:
                index[key] = c - 1
        self.order = keep

    def access(self, keys: list[int], session: int, *, admit: bool = True,
               skip: Container[int] | None = None, record: list[int] | None = None) -> int:
        index = self.index
        order = reversed(keys) if self.tail_first else keys
        before = len(index)
        if not self.ordered:
            if not admit:
                return 0
            for key in order:
                if key not in index and (skip is None or key not in skip):
                    index[key] = 1
                    if record is not None:
                        record.append(key)
            return len(index) - before
        get, push = index.get, self.order.append
        if admit and skip is None:
            # The hot path: every key gets a reference and one more count, each a C
            # call for the request; the counts do not depend on the order. ``record``
            # gets the keys that were not cached, in touch order, each once.
            if record is not None:
                touched = keys[::-1] if self.tail_first else keys
                new = [key for key in touched if key not in index]
                if len(new) > 1 and len(set(new)) < len(new):
                    new = list(dict.fromkeys(new))
                record.extend(new)
                order = touched
            self.order.extend(order)
            _tally(index, keys)
        elif admit:
            for key in order:
                c = get(key)
                if c is not None:
                    index[key] = c + 1
                    push(key)
                elif skip is None or key not in skip:
                    index[key] = 1
                    push(key)
                    if record is not None:
                        record.append(key)
        elif all(map(index.__contains__, keys)):
            # a touch of cached keys only (a hit's refresh): the hot path's two C calls
            self.order.extend(order)
            _tally(index, keys)
        else:
            for key in order:
                c = get(key)
                if c is not None:
                    index[key] = c + 1
                    push(key)
        if len(self.order) > 2 * len(index) + 1024:
            self.compact()
        return len(index) - before

    def admit(self, keys: list[int]) -> list[int]:
        index = self.index
        new = [key for key in keys if key not in index]
        push = self.order.append
        for key in new:
            index[key] = 1
            if self.ordered:
                push(key)
        return new

    def evict(self, n: int) -> list[int]:
        index = self.index
        out: list[int] = []
        if not self.ordered:
            for key in list(islice(index, n)):
                del index[key]
                out.append(key)
            return out
        order = self.order
        pop = order.popleft
        add = out.append
        take = index.pop
        # Every cached key has a last reference in `order`, so n ≤ len(index) keys are
        # found before it runs dry. A stale reference's key is taken out and put back
        # one count down (one dict operation for the common case, a last reference).
        need = min(n, len(index))
        if need > 1:
            # the loop below, in C, while the next ``need`` references name distinct keys
            # (each then met once: its count does not depend on the others)
            chunk = list(islice(order, need))
            if len(set(chunk)) == len(chunk):
                deque(starmap(pop, repeat((), len(chunk))), maxlen=0)  # pop them
                counts = list(map(take, chunk, repeat(0)))
                last = list(compress(chunk, map((1).__eq__, counts)))
                out.extend(last)
                need -= len(last)
                if need:  # some were stale references: put their keys back, one count down
                    for key, c in zip(chunk, counts, strict=True):
                        if c > 1:
                            index[key] = c - 1
        while need:
            key = pop()
            c = take(key, 0)
            if c == 1:
                add(key)
                need -= 1
            elif c:                 # 0: a key removed from the index by hand
                index[key] = c - 1
        return out

    def discard(self, n: int) -> int:
        if not self.ordered:
            return len(self.evict(n))
        index = self.index
        pop = self.order.popleft
        take = index.pop
        done = need = min(n, len(index))
        while need:  # evict's loop, without the list of keys
            key = pop()
            c = take(key, 0)
            if c == 1:
                need -= 1
            elif c:
                index[key] = c - 1
        return done


class LruTailFirstPolicy(LruPolicy):
    """Tail-first LRU, vLLM's ``FreeKVCacheBlockQueue`` (docs/replay.md).

    Order: a request touches its blocks tail → head, so within a chain the head is the
    *most* recent and the tail goes first; across chains, LRU by last use. A cold chain
    shrinks from its tail and keeps a usable prefix until its head goes. Under strict
    round-robin traffic larger than the tier it still collapses, within about one round
    (docs/plan.md): every session's reuse distance is a whole round.
    """

    name = "lru-tail-first"
    tail_first = True


class _ChainPolicy(EvictionPolicy):
    """Shared machinery of the leaf-only policies: a forest of cached blocks.

    ``parent`` (and ``depth``, for policies that order by it) record every key's chain
    position the first time the policy sees it (in :meth:`access`), so demoted blocks can
    be placed later; records of blocks not cached here are dropped when they outnumber
    the cached ones 4 to 1. ``children[k]`` counts
    cached children of a cached key ``k`` that were inserted while ``k`` was cached
    (``up`` remembers which parent each counted child incremented). A key with no entry in
    ``children`` is a leaf and may be evicted. Invariant: a leaf has a heap entry whose
    tick equals its last access; stale heap entries are skipped when popped.

    A block inserted before its parent (possible only by demotion) is a root in this
    tier: leaf-only order cannot protect a chain the tier never held whole.
    """

    structural = True
    _needs_depth = False

    def __init__(self) -> None:
        self.index: dict[int, int] = {}        # key -> tick of last access
        self.children: dict[int, int] = {}
        self.up: dict[int, int] = {}
        self.parent: dict[int, int] = {}
        self.depth: dict[int, int] = {}        # only kept when the policy orders by depth
        self.tick = 0
        self._lru: list[tuple[int, int]] = []  # (tick, key) of leaves

    @property
    def heap_entries(self) -> int:
        """Entries in the leaf heap, stale ones included: kept within 4 per cached key
        plus 4096 (the heap is rebuilt without stale entries past that)."""
        return len(self._lru)

    # -- bookkeeping --------------------------------------------------------------------
    def _leaf(self, key: int, tick: int) -> None:
        heapq.heappush(self._lru, (tick, key))

    def _insert(self, key: int, parent: int | None) -> None:
        """Insert without a heap entry: the caller pushes one for the keys that are still
        leaves once the whole request is in (one per chain, not one per block)."""
        self.tick += 1
        self.index[key] = self.tick
        if parent is not None and parent in self.index:
            self.children[parent] = self.children.get(parent, 0) + 1
            self.up[key] = parent

    def _push_leaves(self, keys: list[int]) -> None:
        index, children, heap = self.index, self.children, self._lru
        for key in keys:
            tick = index.get(key)
            if tick is not None and key not in children:
                heapq.heappush(heap, (tick, key))

    def _remove(self, key: int) -> None:
        del self.index[key]
        p = self.up.pop(key, None)
        if p is not None:
            c = self.children[p] - 1
            if c:
                self.children[p] = c
            else:
                del self.children[p]
                self._leaf(p, self.index[p])

    def _valid(self, tick: int, key: int) -> bool:
        return self.index.get(key) == tick and key not in self.children

    def _compact(self) -> None:
        if len(self._lru) > 4 * len(self.index) + 4096:
            self._lru = [(t, k) for k, t in self.index.items() if k not in self.children]
            heapq.heapify(self._lru)

    def _forget_uncached(self) -> None:
        """Drop chain records of blocks this tier does not hold, so memory follows the
        cached blocks, not every block ever seen. A block demoted here later without a
        record is placed as a root (depth 1)."""
        index = self.index
        self.parent = {k: p for k, p in self.parent.items() if k in index}
        self.depth = {k: d for k, d in self.depth.items() if k in index}

    # -- policy -------------------------------------------------------------------------
    def access(self, keys: list[int], session: int, *, admit: bool = True,
               skip: Container[int] | None = None, record: list[int] | None = None) -> int:
        index = self.index
        if len(self.parent) > 4 * len(index) + 65536:
            self._forget_uncached()
        parent_of, depth_of, need_depth = self.parent, self.depth, self._needs_depth
        new = 0
        prev: int | None = None
        for pos, key in enumerate(keys):
            if prev is not None and key not in parent_of:
                parent_of[key] = prev
            if need_depth and key not in depth_of:
                depth_of[key] = pos + 1
            if key in index:
                self.tick += 1
                index[key] = self.tick
            elif admit and (skip is None or key not in skip):
                self._insert(key, prev)
                new += 1
                if record is not None:
                    record.append(key)
            prev = key
        # Within a chain only the deepest touched block can be a leaf, but a request may
        # also end inside a branch whose children are cached: check every key.
        self._push_leaves(keys)
        self._compact()
        return new

    def admit(self, keys: list[int]) -> list[int]:
        new = [key for key in keys if key not in self.index]
        for key in new:
            self._insert(key, self.parent.get(key))
        self._push_leaves(new)
        return new

    def _pick(self) -> int | None:
        """The next victim, or None when nothing is cached: the least recently used leaf."""
        heap = self._lru
        while heap:
            tick, key = heapq.heappop(heap)
            if self._valid(tick, key):
                return key
        return None

    def evict(self, n: int) -> list[int]:
        out: list[int] = []
        while len(out) < n:
            key = self._pick()
            if key is None:
                break
            self._remove(key)
            out.append(key)
        return out


class RadixPolicy(_ChainPolicy):
    """SGLang's RadixCache: only a block with no cached child may be evicted.

    Order: LRU among leaves by last access (a request refreshes its whole matched path);
    when a leaf goes and its parent becomes a leaf, the parent joins the candidates with
    its own last-access time. So a chain is always evicted tail-first and a shared head
    (a system prompt) goes only after every chain under it: no dead suffix can exist.
    It does not remove the cyclic-access cliff (docs/plan.md).
    """

    name = "radix"


class PrefixFairPolicy(_ChainPolicy):
    """kvtool's policy against the chain-head cliff: among the oldest leaves, trim the
    deepest first.

    Why LRU collapses: in multi-turn traffic every session comes back once per round, so
    the least recently used chain is always the *next* one to be served. LRU (head- or
    tail-first) evicts exactly what is needed next; each recompute rewrites a whole
    context and evicts the next session in turn, and the hit ratio falls to ~0 within a
    round of the footprint passing the capacity.

    The idea: a block is worth something only while its whole prefix is cached, and a
    deep block (far from its chain's head) is the cheapest loss: evicting it shortens one
    prefix hit by one block, while evicting a head loses the whole chain. So:

    1. only leaves (blocks with no cached child) are evicted, as in ``radix``: chains
       shrink from the tail, heads and shared prefixes stay;
    2. the candidates are the ``window`` least recently used leaves (default 128), and
       the **deepest** of them goes first (ties: the least recently used). When the
       live chains fit in the window (up to ``window`` concurrent sessions), every chain
       is trimmed to a common depth under pressure, and a session that grows past it
       trims its *own* new tail rather than the next session's chain. Each session keeps
       about ``capacity / sessions`` blocks of prefix, so the hit ratio declines as
       capacity / footprint (the level of the fixed-subset oracle) instead of falling off
       a cliff. With many short-lived chains (the Mooncake traces) the window holds only
       the oldest leaves, and the policy stays close to tail-first LRU;
    A window smaller than the number of concurrent sessions brings the cliff back, so
    it is settable per tier (``window`` in ``--tiers``); docs/replay.md has the
    measurements. Abandoned chains are the oldest leaves, so they sit in the window and
    go as soon as they are the deepest candidates; at most ``window`` of them can wait
    there at a time.

    Costs the chain records of ``radix`` plus an O(window) scan per eviction.
    """

    name = "prefix-fair"
    _needs_depth = True

    def __init__(self, window: int = 128) -> None:
        if window < 1:
            raise ValueError("window must be at least 1")
        super().__init__()
        self.window = window
        # The window: (-depth, tick, key) of leaves popped from the LRU heap, deepest first.
        # Entries go stale when their leaf is touched or gains a child; stale ones are
        # skipped when popped and swept out every ``window`` picks (amortised O(1)).
        self._win: list[tuple[int, int, int]] = []
        self._picks = 0

    def _compact(self) -> None:
        if len(self._lru) > 4 * len(self.index) + 4096:
            super()._compact()
            self._win = []

    def _pick(self) -> int | None:
        """The victim: the deepest of the ``window`` oldest leaves (ties: the oldest)."""
        index, children, depth = self.index, self.children, self.depth
        win, heap = self._win, self._lru
        self._picks += 1
        if self._picks >= self.window:
            self._picks = 0
            win = self._win = [e for e in win if index.get(e[2]) == e[1] and e[2] not in children]
            heapq.heapify(win)
        while len(win) < self.window and heap:
            tick, key = heapq.heappop(heap)
            if index.get(key) == tick and key not in children:
                heapq.heappush(win, (-depth.get(key, 1), tick, key))
        while win:
            _, tick, key = heapq.heappop(win)
            if index.get(key) == tick and key not in children:
                return key
            if heap:  # keep the window full while skipping stale entries
                t, k = heapq.heappop(heap)
                if index.get(k) == t and k not in children:
                    heapq.heappush(win, (-depth.get(k, 1), t, k))
        return None


class OraclePolicy(EvictionPolicy):
    """The fixed-subset bound of docs/plan.md: keep the earliest sessions, drop the newest.

    For cyclic (round-robin multi-turn) access with a working set larger than the tier,
    the best a policy can do is keep a fixed subset of sessions and let the others miss
    (Belady's choice: the session served last is needed last). This policy needs to know
    the future only in that sense: sessions are ranked by first appearance, every block
    is owned by the first session that inserted it, and when the tier is over capacity it
    evicts, tail-first, from the lowest-ranked (latest-arrived) session that still holds
    blocks, exactly as many as needed. So the earliest sessions stay whole, one session
    at the margin keeps a prefix, and the subset shrinks only as its sessions grow. A
    shared head is owned by its first session and stays while that session is kept.

    It is a reference point, not a proof of optimality. Traces without sessions count
    each request as its own session, which makes it admission refusal (the first
    requests' blocks stay): meaningful only for multi-turn traces.
    """

    name = "oracle"

    def __init__(self) -> None:
        self.index: dict[int, int] = {}                 # key -> owning session rank
        self._owned: dict[int, dict[int, None]] = {}     # rank -> keys, insertion order
        self._ranks: list[int] = []                      # max-heap (negated) of holders

    def _add(self, key: int, rank: int) -> None:
        self.index[key] = rank
        owned = self._owned.get(rank)
        if owned is None:
            owned = self._owned[rank] = {}
        if not owned:
            heapq.heappush(self._ranks, -rank)
        owned[key] = None

    def access(self, keys: list[int], session: int, *, admit: bool = True,
               skip: Container[int] | None = None, record: list[int] | None = None) -> int:
        if not admit:
            return 0
        index = self.index
        new = [key for key in keys if key not in index and (skip is None or key not in skip)]
        for key in new:
            self._add(key, session)
        if record is not None:
            record.extend(new)
        return len(new)

    def admit(self, keys: list[int]) -> list[int]:
        # Blocks demoted from above have lost their owner; they rank last (evicted first).
        new = [key for key in keys if key not in self.index]
        for key in new:
            self._add(key, 1 << 62)
        return new

    def evict(self, n: int) -> list[int]:
        out: list[int] = []
        while len(out) < n and self._ranks:
            rank = -self._ranks[0]
            owned = self._owned.get(rank)
            if not owned:
                heapq.heappop(self._ranks)
                self._owned.pop(rank, None)
                continue
            while owned and len(out) < n:
                key, _ = owned.popitem()    # newest first: the chain's tail
                del self.index[key]
                out.append(key)
        return out


class _PromptSeq:
    """A request's prompt as :class:`~kvtool.serving.kvpool.KVPool` reads it."""

    __slots__ = ("block_hashes", "num_computed_tokens", "num_prompt_tokens", "num_tokens",
                 "request_id")

    def __init__(self, keys: list[int], num_tokens: int, block_tokens: int) -> None:
        self.request_id = "replay"
        self.num_tokens = self.num_prompt_tokens = num_tokens
        self.num_computed_tokens = 0
        self.block_hashes = keys[: num_tokens // block_tokens]


class VllmPolicy(EvictionPolicy):
    """vLLM v1's GPU KV pool with prefix caching, exactly (:mod:`kvtool.serving.kvpool`).

    The tier's capacity is vLLM's ``num_gpu_blocks``: block 0 is the null block, so
    ``N`` blocks cache at most ``N - 1``. Each request runs alone and is freed at the end,
    as in a vLLM engine serving one request at a time: its lookup hits at most
    ``⌊(L − 1)/B⌋`` leading full blocks; it takes blocks for all ``L`` prompt tokens from
    the free queue's head (evicting the keys they held), caches its full blocks (a
    recomputed block already cached becomes a second copy), and frees them tail first.
    Blocks a lower tier supplies arrive as vLLM's external (connector) tokens. A request
    longer than the pool (``⌈L/B⌉ > N − 1``), which vLLM would refuse, leaves the pool
    as it was. :attr:`index` is the pool's hash index (distinct cached keys).

    The hierarchy serves this tier through :meth:`serve_request`; :meth:`access`,
    :meth:`admit` and :meth:`evict` exist for the generic interface: ``access`` and
    ``admit`` run the keys as a request of whole blocks, ``evict`` drops the keys of the
    next blocks the pool would reuse (vLLM's ``evict_blocks``).
    """

    name = "vllm"
    pooled = True

    def __init__(self, block_tokens: int = 1) -> None:
        if block_tokens < 1:
            raise ValueError("block_tokens must be at least 1")
        self.block_tokens = block_tokens
        self.pool: KVPool | None = None
        self.index: dict[int, int] = {}

    @property
    def capacity(self) -> float:
        return self.pool.num_gpu_blocks if self.pool is not None else 0

    @capacity.setter
    def capacity(self, value: float) -> None:
        """Set by the :class:`~kvtool.cache.tier.Tier`: build the pool of that many blocks."""
        if value == float("inf") or int(value) < 2:
            raise ValueError("the vllm policy needs a finite pool of at least 2 blocks "
                             "(vLLM's num_gpu_blocks, the null block included)")
        if self.pool is not None:
            raise ValueError("the vllm policy's pool is already built")
        from kvtool.serving.kvpool import KVPool  # the vllm policy only (start-up time)

        self.pool = KVPool(int(value), self.block_tokens)
        self.index = cast(dict[int, int], self.pool.hash_index)

    def _pool(self) -> KVPool:
        if self.pool is None:
            raise ValueError("the vllm policy has no pool yet (put it in a Tier)")
        return self.pool

    def fits(self, input_length: int) -> bool:
        """Whether a prompt of ``input_length`` tokens fits in the pool at all."""
        pool = self._pool()
        return input_length > 0 and -(-input_length // self.block_tokens) <= pool.num_gpu_blocks - 1

    def hit_blocks(self, keys: list[int], input_length: int) -> int:
        """How many leading blocks of the prompt the pool serves (no side effect)."""
        if not self.fits(input_length):
            return 0
        pool = self._pool()
        n = min((input_length - 1) // self.block_tokens, len(keys))
        return pool.cached_prefix_blocks(keys[:n])

    def serve_request(self, keys: list[int], input_length: int, external_blocks: int,
                      evicted: list[int] | None = None) -> tuple[int, int, int]:
        """Run one prompt alone: look up, allocate, cache, free.

        ``external_blocks`` leading blocks past the pool's hit come from lower tiers (the
        connector's tokens). Keys that leave the index are appended to ``evicted``.
        Returns ``(hit blocks, blocks cached, block evictions)``; a prompt that does not
        fit changes nothing and returns zeros.
        """
        if not self.fits(input_length):
            return 0, 0, 0
        pool = self._pool()
        B = self.block_tokens
        seq = _PromptSeq(keys, input_length, B)
        blocks, hit = pool.get_computed_blocks(seq)
        ext = min(external_blocks * B, input_length - hit)
        before = pool.evictions
        pool.evicted_keys = cast(list[Any], evicted)
        try:
            new = pool.allocate_slots(seq, input_length - hit - ext, hit, blocks,
                                      num_external_computed_tokens=ext, has_scheduled_reqs=False)
        finally:
            pool.evicted_keys = None
        assert new is not None, "a prompt that fits an idle pool is always allocated"
        pool.free(seq)
        full = len(seq.block_hashes)
        return len(blocks), max(0, full - len(blocks)), pool.evictions - before

    def access(self, keys: list[int], session: int, *, admit: bool = True,
               skip: Container[int] | None = None, record: list[int] | None = None) -> int:
        if not admit:
            return 0
        before = len(self.index)
        fresh = [k for k in dict.fromkeys(keys) if k not in self.index]
        self.serve_request(keys, len(keys) * self.block_tokens, 0)
        if record is not None:
            record.extend(k for k in fresh if k in self.index)
        return max(0, len(self.index) - before)

    def admit(self, keys: list[int]) -> list[int]:
        fresh = [k for k in dict.fromkeys(keys) if k not in self.index]
        self.serve_request(keys, len(keys) * self.block_tokens, 0)
        return [k for k in fresh if k in self.index]

    def evict(self, n: int) -> list[int]:
        pool = self._pool()
        out: list[int] = []
        pool.evicted_keys = cast(list[Any], out)
        try:
            victims = [b for b in pool.free_queue() if pool.block_key(b) is not None][:n]
            pool.evict_blocks(victims)
        finally:
            pool.evicted_keys = None
        return out


class Admission:
    """Admission by reuse count and by TTL: a block enters a tier only on its ``after``-th
    offer, counting only offers made within the last ``ttl`` requests (``None``: ever).

    ``after`` is vLLM's ``store_threshold`` (CPU offloading, 0.33.0:
    ``vllm/v1/kv_offload/cpu/manager.py``): offers are counted for every block a request
    offers the tier, cached or not, in vLLM's tracker: an insertion-ordered map of at most
    ``max_tracked`` keys (vLLM's ``max_tracker_size``) that, when full, forgets its least
    recently offered key that the current request does not offer, and does not count a
    key it cannot place. ``ttl`` is kvtool's addition: an offer more than ``ttl`` requests
    after the key's previous offer starts the count again at 1 (the clock is the tier's
    request count, so a replay stays time-free and deterministic).

    Invariant: ``len(counts) <= max_tracked``; ``last`` holds exactly the keys of
    ``counts`` when a ``ttl`` is set (else it is empty).
    """

    __slots__ = ("after", "clock", "counts", "last", "max_tracked", "ttl")

    def __init__(self, after: int = 1, ttl: int | None = None, max_tracked: int = 64_000) -> None:
        if after < 1:
            raise ValueError("admission needs after >= 1")
        if ttl is not None and ttl < 1:
            raise ValueError("admission needs ttl >= 1")
        self.after = after
        self.ttl = ttl
        self.max_tracked = max_tracked
        self.counts: OrderedDict[int, int] = OrderedDict()
        self.last: dict[int, int] = {}
        self.clock = 0

    def offer(self, keys: list[int]) -> None:
        """Count one request's offer of ``keys`` (vLLM's ``_record_accesses``)."""
        self.clock += 1
        counts, last, ttl, now = self.counts, self.last, self.ttl, self.clock
        protected: set[int] = set()
        for key in keys:
            if key in counts:
                counts.move_to_end(key)
                if ttl is not None and now - last[key] > ttl:
                    counts[key] = 1
                else:
                    counts[key] += 1
                if ttl is not None:
                    last[key] = now
                protected.add(key)
        unprotected = len(counts) - len(protected)
        for key in keys:
            if key in counts:
                continue
            if len(counts) >= self.max_tracked:
                if unprotected == 0:
                    continue
                old, _ = counts.popitem(last=False)
                last.pop(old, None)
                unprotected -= 1
            counts[key] = 1
            if ttl is not None:
                last[key] = now

    def admitted(self, key: int) -> bool:
        """Whether a block absent from the tier may be stored now."""
        return self.counts.get(key, 0) >= self.after


class AdmittedPolicy(EvictionPolicy):
    """Any policy behind an :class:`Admission` rule (the ``admit_after`` / ``admit_ttl``
    tier options): the tier offers every block of a request (those not hit in a higher
    tier) to the rule, and a block it lacks is inserted only once the rule admits it.
    Order and eviction are the wrapped policy's. Demoted blocks are offers too."""

    def __init__(self, inner: EvictionPolicy, admission: Admission) -> None:
        self.inner = inner
        self.admission = admission
        self.name = inner.name  # type: ignore[misc]
        self.structural = inner.structural  # type: ignore[misc]
        self.index = inner.index

    def __getattr__(self, name: str) -> Any:
        # only reached for attributes this class lacks (``window``, ``capacity``...)
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "capacity":
            setattr(self.inner, name, value)
        else:
            object.__setattr__(self, name, value)

    def unbounded(self) -> None:
        unbounded = getattr(self.inner, "unbounded", None)
        if unbounded is not None:
            unbounded()
        self.index = self.inner.index

    def _refused(self, keys: list[int], skip: Container[int] | None) -> set[int]:
        offered = keys if skip is None else [key for key in keys if key not in skip]
        adm = self.admission
        adm.offer(offered)
        index = self.inner.index
        return {key for key in offered if key not in index and not adm.admitted(key)}

    def access(self, keys: list[int], session: int, *, admit: bool = True,
               skip: Container[int] | None = None, record: list[int] | None = None) -> int:
        refused = self._refused(keys, skip)
        if admit and refused:
            if skip is not None:
                refused.update(key for key in keys if key in skip)
            skip = refused
        return self.inner.access(keys, session, admit=admit, skip=skip, record=record)

    def admit(self, keys: list[int]) -> list[int]:
        refused = self._refused(keys, None)
        return self.inner.admit([key for key in keys if key not in refused])

    def evict(self, n: int) -> list[int]:
        return self.inner.evict(n)


class ArcPolicy(EvictionPolicy):
    """ARC in its textbook form: Megiddo and Modha, "ARC: A Self-Tuning, Low Overhead
    Replacement Cache", FAST 2003, Fig. 4 (cases I–IV and REPLACE), with ``c`` the tier's
    capacity in blocks.

    Every block of a request is one reference, head → tail. ``T1`` holds blocks seen once
    recently, ``T2`` blocks seen at least twice; ``B1``/``B2`` are their ghosts (keys
    only). A hit moves the block to ``T2``'s MRU end; a ghost hit adapts the target size
    ``p`` of ``T1`` (B1: up by max(|B2|/|B1|, 1); B2: down by max(|B1|/|B2|, 1)), frees a
    slot (REPLACE) and enters ``T2``; a new block frees a slot as case IV says and enters
    ``T1``. REPLACE runs only when ``T1 ∪ T2`` is full (the paper's cache always is once
    ghosts exist).

    Replacement happens at the reference, as in the paper: a victim leaves ``T1``/``T2``
    for its ghost list at once but stays in :attr:`index` until the tier's next
    :meth:`evict`, which returns it (so the tier counts and moves it as every policy's
    eviction). Invariant: ``|T1| + |T2| <= c``; ``|T1| + |B1| <= c``;
    ``|T1| + |T2| + |B1| + |B2| <= 2c``.
    """

    name = "arc"

    def __init__(self) -> None:
        self.capacity: float = math.inf
        self.p = 0.0
        self.t1: OrderedDict[int, None] = OrderedDict()
        self.t2: OrderedDict[int, None] = OrderedDict()
        self.b1: OrderedDict[int, None] = OrderedDict()
        self.b2: OrderedDict[int, None] = OrderedDict()
        self.index: dict[int, None] = {}
        self._doomed: dict[int, None] = {}

    def _replace(self, in_b2: bool) -> None:
        t1 = self.t1
        if t1 and ((in_b2 and len(t1) == self.p) or len(t1) > self.p):
            key, _ = t1.popitem(last=False)
            self.b1[key] = None
        else:
            key, _ = self.t2.popitem(last=False)
            self.b2[key] = None
        self._doomed[key] = None

    def _reference(self, key: int, insert: bool) -> bool:
        """One reference to ``key``; return True when it was inserted (a miss)."""
        t1, t2, b1, b2 = self.t1, self.t2, self.b1, self.b2
        c = self.capacity
        if key in t1:                                   # case I
            del t1[key]
            t2[key] = None
            return False
        if key in t2:
            t2.move_to_end(key)
            return False
        if not insert:
            return False
        full = len(t1) + len(t2) >= c
        if key in b1:                                   # case II
            self.p = min(c, self.p + max(len(b2) / len(b1), 1))
            if full:
                self._replace(False)
            del b1[key]
            t2[key] = None
        elif key in b2:                                 # case III
            self.p = max(0.0, self.p - max(len(b1) / len(b2), 1))
            if full:
                self._replace(True)
            del b2[key]
            t2[key] = None
        else:                                           # case IV
            if len(t1) + len(b1) >= c:
                if len(t1) < c:
                    b1.popitem(last=False)
                    if full:
                        self._replace(False)
                else:
                    old, _ = t1.popitem(last=False)
                    self._doomed[old] = None
            elif len(t1) + len(t2) + len(b1) + len(b2) >= c:
                if len(t1) + len(t2) + len(b1) + len(b2) >= 2 * c:
                    b2.popitem(last=False)
                if full:
                    self._replace(False)
            t1[key] = None
        if key in self._doomed:    # evicted earlier in this request, back again
            del self._doomed[key]
            return False
        self.index[key] = None
        return True

    def access(self, keys: list[int], session: int, *, admit: bool = True,
               skip: Container[int] | None = None, record: list[int] | None = None) -> int:
        new = 0
        for key in keys:
            if self._reference(key, admit and (skip is None or key not in skip)):
                new += 1
                if record is not None:
                    record.append(key)
        return new

    def admit(self, keys: list[int]) -> list[int]:
        return [key for key in keys if key not in self.index and self._reference(key, True)]

    def evict(self, n: int) -> list[int]:
        out = list(self._doomed)
        self._doomed.clear()
        while len(out) < n and (self.t1 or self.t2):
            self._replace(False)
            out.extend(self._doomed)
            self._doomed.clear()
        for key in out:
            del self.index[key]
        return out


class S3FifoPolicy(EvictionPolicy):
    """S3-FIFO: Yang et al., "FIFO queues are all you need for cache eviction", SOSP 2023,
    Algorithm 1, with LMCache's sizes (``lmcache/v1/storage_backend/cache_policy/s3fifo.py``):
    a small FIFO ``S`` of ``max(1, ⌊0.1·c⌋)`` blocks, a main FIFO ``M`` of the rest, a
    ghost FIFO ``G`` (keys only) as long as ``M``, and a 2-bit frequency per cached block.

    A request touches its blocks head → tail: a cached block's frequency rises by one (at
    most 3); a new block enters ``M`` if ``G`` remembers it, else ``S``, with frequency 0.
    Evicting one block: if ``|S| ≥ |S|cap``, take ``S``'s oldest: frequency > 1 moves it to
    ``M`` (which, over its size, evicts from ``M``), else it goes to ``G`` and is evicted;
    otherwise take ``M``'s oldest: frequency > 0 re-inserts it with frequency − 1, else it
    is evicted. Evictions happen when the tier evicts (after the request), as for every
    kvtool policy. Invariant: ``index`` is ``S ∪ M``; ``|G| <= |M|cap``.
    """

    name = "s3fifo"
    small_ratio = 0.1

    def __init__(self) -> None:
        self.capacity: float = math.inf
        self.s: OrderedDict[int, int] = OrderedDict()   # key -> freq, oldest first
        self.m: OrderedDict[int, int] = OrderedDict()
        self.g: OrderedDict[int, None] = OrderedDict()
        self.index: dict[int, None] = {}

    def _caps(self) -> tuple[int, int]:
        c = int(self.capacity)
        s_cap = max(1, int(c * self.small_ratio))
        return s_cap, max(1, c - s_cap)

    def _insert(self, key: int) -> None:
        if key in self.g:
            del self.g[key]
            self.m[key] = 0
        else:
            self.s[key] = 0
        self.index[key] = None

    def access(self, keys: list[int], session: int, *, admit: bool = True,
               skip: Container[int] | None = None, record: list[int] | None = None) -> int:
        s, m, index = self.s, self.m, self.index
        new = 0
        for key in keys:
            if key in index:
                if key in s:
                    if s[key] < 3:
                        s[key] += 1
                elif m[key] < 3:
                    m[key] += 1
            elif admit and (skip is None or key not in skip):
                self._insert(key)
                new += 1
                if record is not None:
                    record.append(key)
        return new

    def admit(self, keys: list[int]) -> list[int]:
        new = [key for key in keys if key not in self.index]
        for key in new:
            self._insert(key)
        return new

    def _evict_m(self, out: list[int]) -> None:
        m = self.m
        while m:
            key, freq = m.popitem(last=False)
            if freq > 0:
                m[key] = freq - 1
            else:
                out.append(key)
                return

    def _evict_s(self, out: list[int], m_cap: int) -> None:
        s, m, g = self.s, self.m, self.g
        while s:
            key, freq = s.popitem(last=False)
            if freq > 1:
                m[key] = freq
                while len(m) > m_cap:
                    self._evict_m(out)
            else:
                g[key] = None
                while len(g) > m_cap:
                    g.popitem(last=False)
                out.append(key)
                return

    def evict(self, n: int) -> list[int]:
        s_cap, m_cap = self._caps()
        out: list[int] = []
        while len(out) < n and (self.s or self.m):
            if len(self.s) >= s_cap or not self.m:
                self._evict_s(out, m_cap)
            else:
                self._evict_m(out)
        for key in out:
            del self.index[key]
        return out


class LfuPolicy(EvictionPolicy):
    """LFU: the least frequently used block goes first, ties oldest first (FIFO within a
    frequency), frequencies never age: the O(1) scheme of Shah, Mitra and Matani, "An
    O(1) algorithm for implementing the LFU cache eviction scheme" (2010), with LMCache's
    rules (``lmcache/v1/storage_backend/cache_policy/lfu.py``: a stored block starts at
    frequency 1, each hit adds 1, equal frequencies leave in the order they reached it).

    A request touches its blocks head → tail. Representation: ``index`` maps key →
    frequency; ``buckets[f]`` holds the keys of frequency ``f`` in arrival order; a heap
    of frequencies (stale entries skipped) finds the lowest non-empty bucket.
    """

    name = "lfu"

    def __init__(self) -> None:
        self.index: dict[int, int] = {}
        self.buckets: dict[int, dict[int, None]] = {}
        self._freqs: list[int] = []        # heap of the frequencies in ``_heaped``
        self._heaped: set[int] = set()

    def _put(self, key: int, freq: int) -> None:
        bucket = self.buckets.get(freq)
        if bucket is None:
            bucket = self.buckets[freq] = {}
            if freq not in self._heaped:
                self._heaped.add(freq)
                heapq.heappush(self._freqs, freq)
        bucket[key] = None
        self.index[key] = freq

    def _bump(self, key: int) -> None:
        freq = self.index[key]
        bucket = self.buckets[freq]
        del bucket[key]
        if not bucket:
            del self.buckets[freq]
        self._put(key, freq + 1)

    def access(self, keys: list[int], session: int, *, admit: bool = True,
               skip: Container[int] | None = None, record: list[int] | None = None) -> int:
        index = self.index
        new = 0
        for key in keys:
            if key in index:
                self._bump(key)
            elif admit and (skip is None or key not in skip):
                self._put(key, 1)
                new += 1
                if record is not None:
                    record.append(key)
        return new

    def admit(self, keys: list[int]) -> list[int]:
        new = [key for key in keys if key not in self.index]
        for key in new:
            self._put(key, 1)
        return new

    def evict(self, n: int) -> list[int]:
        out: list[int] = []
        buckets, freqs = self.buckets, self._freqs
        while len(out) < n and freqs:
            freq = freqs[0]
            bucket = buckets.get(freq)
            if not bucket:
                self._heaped.discard(heapq.heappop(freqs))
                continue
            while bucket and len(out) < n:
                key = next(iter(bucket))
                del bucket[key]
                del self.index[key]
                out.append(key)
            if not bucket:
                del buckets[freq]
                self._heaped.discard(heapq.heappop(freqs))
        return out


class _VllmOffloadPolicy(EvictionPolicy):
    """vLLM 0.33.0's CPU offloading manager (``vllm/v1/kv_offload/cpu/manager.py``,
    ``CPUOffloadingManager``) as a tier policy, for one request at a time, in the order
    the offloading connector calls it (``.../kv_connector/v1/offloading/scheduler.py``):

    1. **lookup** — the request's full blocks (the hierarchy passes no partial block),
       after the leading blocks hit in a higher tier, are looked up until the first miss:
       the hit run is *loaded* (``prepare_load`` + ``complete_load``);
    2. **store** — ``prepare_store`` is offered the blocks after the loaded run, or every
       full block when nothing was loaded (the connector restarts at token 0). Offered
       blocks the tier holds are reuses; the others are stored, if admitted
       (``store_threshold``: :class:`Admission`). Room is made *before* inserting, by
       evicting as many blocks as are missing, never one of the offered blocks (a
       request can evict its own loaded prefix); if too few can go, nothing is stored;
    3. **finish** — ``on_request_finished`` ranks the request's blocks.

    The cache keeps exactly vLLM's chunk set after every request (checked against vLLM's
    own code by tests/cache/test_vllm_offload.py). Evicted blocks leave the policy's order
    at once and stay in :attr:`index` until the tier's :meth:`evict`, which returns them.
    """

    full_blocks_only: ClassVar[bool] = True

    def __init__(self, admission: Admission | None = None) -> None:
        self.capacity: float = math.inf
        self.admission = admission
        self._doomed: dict[int, None] = {}

    # hooks: vLLM's CachePolicy calls, as this policy's order needs them
    def _loaded(self, loaded: list[int]) -> None:
        return None

    def _store_miss(self, keys: list[int]) -> None:
        return None

    @abstractmethod
    def _victims(self, need: int, protected: set[int]) -> bool:
        """Select ``need`` victims outside ``protected`` into ``_doomed``, or change nothing
        and return False."""

    @abstractmethod
    def _insert(self, keys: list[int]) -> None: ...

    @abstractmethod
    def _finish(self, seen: list[int], inserted: set[int], reused: set[int]) -> None: ...

    def access(self, keys: list[int], session: int, *, admit: bool = True,
               skip: Container[int] | None = None, record: list[int] | None = None) -> int:
        index = self.index
        n = len(keys)
        s = 0
        if skip is not None:
            while s < n and keys[s] in skip:
                s += 1
        e = s
        while e < n and keys[e] in index:
            e += 1
        loaded = keys[s:e]
        self._loaded(loaded)
        reused = set(loaded)
        if not admit:
            self._finish(loaded, set(), reused)
            return 0
        offered = keys[e:] if e > s else keys
        adm = self.admission
        if adm is not None:
            adm.offer(offered)
        to_store: list[int] = []
        for key in offered:
            if key in index:
                reused.add(key)
            elif adm is None or adm.admitted(key):
                to_store.append(key)
        if to_store:
            self._store_miss(to_store)
        stored: list[int] = []
        if to_store:
            need = len(to_store) - (self.capacity - len(index))
            if need <= 0 or self._victims(int(need), set(offered)):
                self._insert(to_store)
                stored = to_store
        seen_set = reused.union(to_store)
        seen = [key for key in keys if key in seen_set]
        self._finish(seen, set(stored), reused)
        if record is not None:
            record.extend(stored)
        return len(stored)

    def admit(self, keys: list[int]) -> list[int]:
        """Demoted blocks: a store of ``keys`` with nothing loaded."""
        record: list[int] = []
        self.access(keys, 0, record=record)
        return record

    def evict(self, n: int) -> list[int]:
        out = list(self._doomed)
        self._doomed.clear()
        if len(out) < n:
            self._victims(min(n - len(out), len(self.index) - len(out)), set())
            out.extend(self._doomed)
            self._doomed.clear()
        for key in out:
            del self.index[key]
        return out


class VllmLruPolicy(_VllmOffloadPolicy):
    """vLLM 0.33.0's ``LRUCachePolicy`` (``vllm/v1/kv_offload/cpu/policies/lru.py``)
    behind :class:`_VllmOffloadPolicy`'s request protocol.

    Order: ``index`` is an insertion-ordered map, the next victim first. Loaded blocks
    take the newest ranks tail first (the request's provisional rank); at the end of
    the request every block it loaded, reused or stored is ranked again, tail first, so
    a request's tail goes before its head and the least recently finished request goes
    first. Victims are moved to the front and leave at the tier's eviction.
    """

    name = "vllm-lru"

    def __init__(self, admission: Admission | None = None) -> None:
        super().__init__(admission)
        self.index: OrderedDict[int, None] = OrderedDict()

    def _loaded(self, loaded: list[int]) -> None:
        touch = self.index.move_to_end
        for key in reversed(loaded):
            touch(key)

    def _victims(self, need: int, protected: set[int]) -> bool:
        if need <= 0:
            return True
        doomed = self._doomed
        victims: list[int] = []
        for key in self.index:
            if key not in protected and key not in doomed:
                victims.append(key)
                if len(victims) == need:
                    break
        if len(victims) < need:
            return False
        front = self.index.move_to_end
        for key in reversed(victims):
            front(key, last=False)
        for key in victims:
            doomed[key] = None
        return True

    def _insert(self, keys: list[int]) -> None:
        index = self.index
        for key in keys:
            index[key] = None

    def _finish(self, seen: list[int], inserted: set[int], reused: set[int]) -> None:
        index, doomed = self.index, self._doomed
        touch = index.move_to_end
        for key in reversed(seen):
            if key in index and key not in doomed:
                touch(key)


class VllmArcPolicy(_VllmOffloadPolicy):
    """vLLM 0.33.0's ``ARCCachePolicy`` (``vllm/v1/kv_offload/cpu/policies/arc.py``)
    behind :class:`_VllmOffloadPolicy`'s request protocol. It differs from textbook ARC
    (``arc``): a block re-stored after a ghost hit enters ``T1``, not ``T2``; the target
    ``p`` adapts only on store misses (once per request, tail first); ``B1`` and ``B2``
    are each trimmed to ``c`` on their own; a block moves ``T1`` → ``T2`` when a request
    reuses it (at the end of the request, tail first); eviction takes ``T1``'s LRU while
    ``|T1| ≥ ⌊p⌋`` (else ``T2``'s, else ``T1``'s) and skips the offered blocks.
    """

    name = "vllm-arc"

    def __init__(self, admission: Admission | None = None) -> None:
        super().__init__(admission)
        self.index: dict[int, None] = {}
        self.p = 0.0
        self.t1: OrderedDict[int, None] = OrderedDict()
        self.t2: OrderedDict[int, None] = OrderedDict()
        self.b1: OrderedDict[int, None] = OrderedDict()
        self.b2: OrderedDict[int, None] = OrderedDict()

    def _store_miss(self, keys: list[int]) -> None:
        b1, b2 = self.b1, self.b2
        for key in reversed(keys):
            if key in b1:
                self.p = min(self.p + max(1, len(b2) / len(b1)), self.capacity)
                b1.move_to_end(key)
            elif key in b2:
                self.p = max(self.p - max(1, len(b1) / len(b2)), 0)
                b2.move_to_end(key)

    def _victims(self, need: int, protected: set[int]) -> bool:
        if need <= 0:
            return True
        t1_iter, t2_iter = iter(self.t1), iter(self.t2)

        def nxt(keys: Any) -> int | None:
            for key in keys:
                if key not in protected:
                    return int(key)
            return None

        chosen: list[tuple[int, bool]] = []
        virtual_t1 = len(self.t1)
        for _ in range(need):
            key = None
            from_t1 = False
            if virtual_t1 >= int(self.p):
                key = nxt(t1_iter)
                from_t1 = key is not None
            if key is None:
                key = nxt(t2_iter)
            if key is None:
                key = nxt(t1_iter)
                if key is None:
                    return False
                from_t1 = True
            if from_t1:
                virtual_t1 -= 1
            chosen.append((key, from_t1))
        for key, from_t1 in chosen:
            if from_t1:
                del self.t1[key]
                self.b1[key] = None
            else:
                del self.t2[key]
                self.b2[key] = None
            self._doomed[key] = None
        if self.capacity != math.inf:
            cap = int(self.capacity)
            for ghost in (self.b1, self.b2):
                for _ in range(len(ghost) - cap):
                    ghost.popitem(last=False)
        return True

    def _insert(self, keys: list[int]) -> None:
        t1, b1, b2, index = self.t1, self.b1, self.b2, self.index
        for key in keys:
            t1[key] = None
            b1.pop(key, None)
            b2.pop(key, None)
            index[key] = None

    def _finish(self, seen: list[int], inserted: set[int], reused: set[int]) -> None:
        t1, t2 = self.t1, self.t2
        only_inserted = inserted - reused
        for key in reversed(seen):
            if key in only_inserted:
                if key in t1:
                    t1.move_to_end(key)
                elif key in t2:
                    t2.move_to_end(key)
            elif key in reused:
                if key in t1:
                    del t1[key]
                    t2[key] = None
                elif key in t2:
                    t2.move_to_end(key)


POLICIES: dict[str, Callable[[], EvictionPolicy]] = {
    "lru": LruPolicy,
    "lru-tail-first": LruTailFirstPolicy,
    "radix": RadixPolicy,
    "prefix-fair": PrefixFairPolicy,
    "oracle": OraclePolicy,
    "mooncake": LruPolicy,  # plus watermark 0.90 / batch 5% (set by the tier spec)
    "vllm": VllmPolicy,     # GPU tier only; its block size comes from make_policy
    "arc": ArcPolicy,
    "s3fifo": S3FifoPolicy,
    "lfu": LfuPolicy,
    "vllm-lru": VllmLruPolicy,
    "vllm-arc": VllmArcPolicy,
}
"""Policy names accepted by ``--policy`` and the ``--tiers`` file."""

WATERMARK_DEFAULTS: dict[str, tuple[float, float]] = {"mooncake": (0.90, 0.05)}
"""Policies that imply watermark batch eviction: name → (high watermark, batch ratio)."""


POOLED_TIERS: tuple[str, ...] = ("gpu",)
"""Tiers a pooled policy (``vllm``) may manage: the top tier, where requests run."""


def make_policy(name: str, *, window: int | None = None, block_tokens: int = 1,
                admission: Admission | None = None) -> EvictionPolicy:
    """A fresh policy by name (one of :data:`POLICIES`); ``window`` tunes
    ``prefix-fair``, ``block_tokens`` sizes ``vllm``'s blocks (the others ignore them);
    ``admission`` puts the policy behind an admission rule (the ``vllm-*`` policies apply
    it inside their store, as vLLM does; the ``vllm`` GPU pool takes none)."""
    if name == "vllm":
        if admission is not None:
            raise ValueError("the vllm GPU pool has no admission rule")
        return VllmPolicy(block_tokens)
    if name in ("vllm-lru", "vllm-arc"):
        return VllmLruPolicy(admission) if name == "vllm-lru" else VllmArcPolicy(admission)
    policy = (PrefixFairPolicy(window) if name == "prefix-fair" and window is not None
              else POLICIES[name]())
    return policy if admission is None else AdmittedPolicy(policy, admission)
