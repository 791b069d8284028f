"""``lru``: head-first LRU, the insertion-ordered store (Mooncake lease LRU, old LMCache)."""

from __future__ import annotations

from collections import deque
from collections.abc import Container
from itertools import islice

from kvtool.cache.policies.admission import Admission, admitted
from kvtool.cache.policies.base import EvictionPolicy, tally


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
            tally(index, keys)
        elif admit:
            get, push = index.get, self.order.append
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
            tally(index, keys)
        else:
            get, push = index.get, self.order.append
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
        pop = self.order.popleft
        add = out.append
        take = index.pop
        # Every cached key has a last reference in `order`, so n ≤ len(index) keys are
        # found before it runs dry. A stale reference's key is taken out and put back
        # one count down (one dict operation for the common case, a last reference).
        need = min(n, len(index))
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


def make(*, window: int | None = None, block_tokens: int = 1,
         admission: Admission | None = None) -> EvictionPolicy:
    """A fresh ``lru`` (:data:`kvtool.cache.policies.POLICIES`), behind ``admission`` if given."""
    return admitted(LruPolicy(), admission)
