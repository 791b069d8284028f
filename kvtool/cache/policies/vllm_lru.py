"""``vllm-lru``: vLLM 0.33.0's ``LRUCachePolicy`` behind the CPU offloading manager."""

from __future__ import annotations

from collections import OrderedDict

from kvtool.cache.policies.admission import Admission
from kvtool.cache.policies.base import EvictionPolicy
from kvtool.cache.policies.vllm_offload import VllmOffloadPolicy


class VllmLruPolicy(VllmOffloadPolicy):
    """vLLM 0.33.0's ``LRUCachePolicy`` (``vllm/v1/kv_offload/cpu/policies/lru.py``)
    behind :class:`VllmOffloadPolicy`'s request protocol.

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


def make(*, window: int | None = None, block_tokens: int = 1,
         admission: Admission | None = None) -> EvictionPolicy:
    """A fresh ``vllm-lru``; ``admission`` applies inside its store, as vLLM's
    ``store_threshold`` does."""
    return VllmLruPolicy(admission)
