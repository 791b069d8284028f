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
  policy evicts in units, as :class:`OraclePolicy` does) and return them in eviction order.

Keys are plain ints (the chained block keys of :mod:`kvtool.trace.hashing` or a
Mooncake trace's ``hash_ids``): no per-block objects, so that a tier of ten million
blocks fits in about 110 bytes per block (bench/replay_memory.py).

Policies (docs/definitions.md; engine semantics in docs/replay.md):

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

import heapq
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Container
from itertools import islice
from typing import Any, ClassVar, cast

from kvtool.serving.kvpool import KVPool


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


class LruPolicy(EvictionPolicy):
    """Head-first LRU, the insertion-ordered store (Mooncake lease LRU, old LMCache).

    Order: a request touches its blocks head → tail, so within a chain the head is the
    *least* recent block. Eviction takes the least recently touched block first, which
    under memory pressure is every session's chain head: one eviction kills the whole
    session's reuse (the chain-head cliff: docs/example-collapse.md) and leaves its suffix as dead weight.

    Representation: an :class:`~collections.OrderedDict` from key to ``None``; the front
    is the next victim. O(1) touch, insert and evict.
    """

    name = "lru"
    _reverse = False

    def __init__(self) -> None:
        od: OrderedDict[int, None] = OrderedDict()
        self.index: dict[int, None] = od
        self._touch = od.move_to_end
        self.ordered = True
        """False for an unbounded tier: it never evicts, so recency is irrelevant, touches
        are skipped and the index is a plain (faster) dict; see :meth:`unbounded`."""

    def unbounded(self) -> None:
        """Called by an unbounded :class:`~kvtool.cache.tier.Tier` before first use."""
        self.ordered = False
        self.index = dict(self.index)

    def access(self, keys: list[int], session: int, *, admit: bool = True,
               skip: Container[int] | None = None, record: list[int] | None = None) -> int:
        od = self.index
        order = reversed(keys) if self._reverse else keys
        before = len(od)
        if not self.ordered:
            if not admit:
                return 0
            for key in order:
                if key not in od and (skip is None or key not in skip):
                    od[key] = None
                    if record is not None:
                        record.append(key)
            return len(od) - before
        touch = self._touch
        if admit and skip is None and record is None:
            # The hot path: exactly the loop of a minimal OrderedDict simulator.
            for key in order:
                if key in od:
                    touch(key)
                else:
                    od[key] = None
        elif admit:
            for key in order:
                if key in od:
                    touch(key)
                elif skip is None or key not in skip:
                    od[key] = None
                    if record is not None:
                        record.append(key)
        else:
            for key in order:
                if key in od:
                    touch(key)
        return len(od) - before

    def admit(self, keys: list[int]) -> list[int]:
        od = self.index
        new = [key for key in keys if key not in od]
        for key in new:
            od[key] = None
        return new

    def evict(self, n: int) -> list[int]:
        od = self.index
        out = list(islice(od, n))
        for key in out:
            del od[key]
        return out


class LruTailFirstPolicy(LruPolicy):
    """Tail-first LRU, vLLM's ``FreeKVCacheBlockQueue`` (docs/replay.md).

    Order: a request touches its blocks tail → head, so within a chain the head is the
    *most* recent and the tail goes first; across chains, LRU by last use. A cold chain
    shrinks from its tail and keeps a usable prefix until its head goes. Under strict
    round-robin traffic larger than the tier it still collapses, within about one round
    (docs/plan.md): every session's reuse distance is a whole round.
    """

    name = "lru-tail-first"
    _reverse = True


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


POLICIES: dict[str, Callable[[], EvictionPolicy]] = {
    "lru": LruPolicy,
    "lru-tail-first": LruTailFirstPolicy,
    "radix": RadixPolicy,
    "prefix-fair": PrefixFairPolicy,
    "oracle": OraclePolicy,
    "mooncake": LruPolicy,  # plus watermark 0.90 / batch 5% (set by the tier spec)
    "vllm": VllmPolicy,     # GPU tier only; its block size comes from make_policy
}
"""Policy names accepted by ``--policy`` and the ``--tiers`` file."""

WATERMARK_DEFAULTS: dict[str, tuple[float, float]] = {"mooncake": (0.90, 0.05)}
"""Policies that imply watermark batch eviction: name → (high watermark, batch ratio)."""


POOLED_TIERS: tuple[str, ...] = ("gpu",)
"""Tiers a pooled policy (``vllm``) may manage: the top tier, where requests run."""


def make_policy(name: str, *, window: int | None = None, block_tokens: int = 1) -> EvictionPolicy:
    """A fresh policy by name (one of :data:`POLICIES`); ``window`` tunes
    ``prefix-fair``, ``block_tokens`` sizes ``vllm``'s blocks (the others ignore them)."""
    if name == "prefix-fair" and window is not None:
        return PrefixFairPolicy(window)
    if name == "vllm":
        return VllmPolicy(block_tokens)
    return POLICIES[name]()
