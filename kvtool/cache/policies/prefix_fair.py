"""``prefix-fair``: kvtool's policy, leaf-only, deepest of the oldest leaves first."""

from __future__ import annotations

import heapq

from kvtool.cache.policies.admission import Admission, admitted
from kvtool.cache.policies.base import EvictionPolicy
from kvtool.cache.policies.chain import ChainPolicy


class PrefixFairPolicy(ChainPolicy):
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


def make(*, window: int | None = None, block_tokens: int = 1,
         admission: Admission | None = None) -> EvictionPolicy:
    """A fresh ``prefix-fair`` (``window``: how many of the oldest leaves it compares),
    behind ``admission`` if given."""
    return admitted(PrefixFairPolicy(window) if window is not None else PrefixFairPolicy(),
                    admission)
