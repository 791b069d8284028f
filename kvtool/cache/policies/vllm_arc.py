"""``vllm-arc``: vLLM 0.33.0's ``ARCCachePolicy`` behind the CPU offloading manager."""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any

from kvtool.cache.policies.admission import Admission
from kvtool.cache.policies.base import EvictionPolicy
from kvtool.cache.policies.vllm_offload import VllmOffloadPolicy


class VllmArcPolicy(VllmOffloadPolicy):
    """vLLM 0.33.0's ``ARCCachePolicy`` (``vllm/v1/kv_offload/cpu/policies/arc.py``)
    behind :class:`VllmOffloadPolicy`'s request protocol. It differs from textbook ARC
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


def make(*, window: int | None = None, block_tokens: int = 1,
         admission: Admission | None = None) -> EvictionPolicy:
    """A fresh ``vllm-arc``; ``admission`` applies inside its store, as vLLM's
    ``store_threshold`` does."""
    return VllmArcPolicy(admission)
