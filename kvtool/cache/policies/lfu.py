"""``lfu``: least frequently used."""

from __future__ import annotations

import heapq
from collections.abc import Container

from kvtool.cache.policies.admission import Admission, admitted
from kvtool.cache.policies.base import EvictionPolicy


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


def make(*, window: int | None = None, block_tokens: int = 1,
         admission: Admission | None = None) -> EvictionPolicy:
    """A fresh ``lfu`` (:data:`kvtool.cache.policies.POLICIES`), behind ``admission`` if given."""
    return admitted(LfuPolicy(), admission)
