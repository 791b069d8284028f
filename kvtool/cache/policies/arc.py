"""``arc``: ARC (Megiddo and Modha, FAST 2003)."""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Container

from kvtool.cache.policies.admission import Admission, admitted
from kvtool.cache.policies.base import EvictionPolicy


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


def make(*, window: int | None = None, block_tokens: int = 1,
         admission: Admission | None = None) -> EvictionPolicy:
    """A fresh ``arc`` (:data:`kvtool.cache.policies.POLICIES`), behind ``admission`` if given."""
    return admitted(ArcPolicy(), admission)
