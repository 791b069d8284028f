"""vLLM 0.33.0's CPU offloading manager's request protocol, which ``vllm-lru`` and
``vllm-arc`` share."""

from __future__ import annotations

import math
from abc import abstractmethod
from collections.abc import Container
from typing import ClassVar

from kvtool.cache.policies.admission import Admission
from kvtool.cache.policies.base import EvictionPolicy


class VllmOffloadPolicy(EvictionPolicy):
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
