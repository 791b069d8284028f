"""``s3fifo``: S3-FIFO (Yang et al., SOSP 2023)."""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Container

from kvtool.cache.policies.admission import Admission, admitted
from kvtool.cache.policies.base import EvictionPolicy


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


def make(*, window: int | None = None, block_tokens: int = 1,
         admission: Admission | None = None) -> EvictionPolicy:
    """A fresh ``s3fifo`` (:data:`kvtool.cache.policies.POLICIES`), behind ``admission`` if given."""
    return admitted(S3FifoPolicy(), admission)
