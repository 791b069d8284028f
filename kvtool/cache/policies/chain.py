"""The forest of cached blocks that the leaf-only policies (``radix``, ``prefix-fair``)
share."""

from __future__ import annotations

import heapq
from collections.abc import Container

from kvtool.cache.policies.base import EvictionPolicy


class ChainPolicy(EvictionPolicy):
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
