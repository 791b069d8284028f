"""Admission rules in front of a policy (the ``admit_after`` / ``admit_ttl`` tier options)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container
from typing import Any

from kvtool.cache.policies.base import EvictionPolicy


class Admission:
    """Admission by reuse count and by TTL: a block enters a tier only on its ``after``-th
    offer, counting only offers made within the last ``ttl`` requests (``None``: ever).

    ``after`` is vLLM's ``store_threshold`` (CPU offloading, 0.33.0:
    ``vllm/v1/kv_offload/cpu/manager.py``): offers are counted for every block a request
    offers the tier, cached or not, in vLLM's tracker: an insertion-ordered map of at most
    ``max_tracked`` keys (vLLM's ``max_tracker_size``) that, when full, forgets its least
    recently offered key that the current request does not offer, and does not count a
    key it cannot place. ``ttl`` is kvtool's addition: an offer more than ``ttl`` requests
    after the key's previous offer starts the count again at 1 (the clock is the tier's
    request count, so a replay stays time-free and deterministic).

    Invariant: ``len(counts) <= max_tracked``; ``last`` holds exactly the keys of
    ``counts`` when a ``ttl`` is set (else it is empty).
    """

    __slots__ = ("after", "clock", "counts", "last", "max_tracked", "ttl")

    def __init__(self, after: int = 1, ttl: int | None = None, max_tracked: int = 64_000) -> None:
        if after < 1:
            raise ValueError("admission needs after >= 1")
        if ttl is not None and ttl < 1:
            raise ValueError("admission needs ttl >= 1")
        self.after = after
        self.ttl = ttl
        self.max_tracked = max_tracked
        self.counts: OrderedDict[int, int] = OrderedDict()
        self.last: dict[int, int] = {}
        self.clock = 0

    def offer(self, keys: list[int]) -> None:
        """Count one request's offer of ``keys`` (vLLM's ``_record_accesses``)."""
        self.clock += 1
        counts, last, ttl, now = self.counts, self.last, self.ttl, self.clock
        protected: set[int] = set()
        for key in keys:
            if key in counts:
                counts.move_to_end(key)
                if ttl is not None and now - last[key] > ttl:
                    counts[key] = 1
                else:
                    counts[key] += 1
                if ttl is not None:
                    last[key] = now
                protected.add(key)
        unprotected = len(counts) - len(protected)
        for key in keys:
            if key in counts:
                continue
            if len(counts) >= self.max_tracked:
                if unprotected == 0:
                    continue
                old, _ = counts.popitem(last=False)
                last.pop(old, None)
                unprotected -= 1
            counts[key] = 1
            if ttl is not None:
                last[key] = now

    def admitted(self, key: int) -> bool:
        """Whether a block absent from the tier may be stored now."""
        return self.counts.get(key, 0) >= self.after


class AdmittedPolicy(EvictionPolicy):
    """Any policy behind an :class:`Admission` rule (the ``admit_after`` / ``admit_ttl``
    tier options): the tier offers every block of a request (those not hit in a higher
    tier) to the rule, and a block it lacks is inserted only once the rule admits it.
    Order and eviction are the wrapped policy's. Demoted blocks are offers too."""

    def __init__(self, inner: EvictionPolicy, admission: Admission) -> None:
        self.inner = inner
        self.admission = admission
        self.name = inner.name  # type: ignore[misc]
        self.structural = inner.structural  # type: ignore[misc]
        self.index = inner.index

    def __getattr__(self, name: str) -> Any:
        # only reached for attributes this class lacks (``window``, ``capacity``...)
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "capacity":
            setattr(self.inner, name, value)
        else:
            object.__setattr__(self, name, value)

    def unbounded(self) -> None:
        unbounded = getattr(self.inner, "unbounded", None)
        if unbounded is not None:
            unbounded()
        self.index = self.inner.index

    def _refused(self, keys: list[int], skip: Container[int] | None) -> set[int]:
        offered = keys if skip is None else [key for key in keys if key not in skip]
        adm = self.admission
        adm.offer(offered)
        index = self.inner.index
        return {key for key in offered if key not in index and not adm.admitted(key)}

    def access(self, keys: list[int], session: int, *, admit: bool = True,
               skip: Container[int] | None = None, record: list[int] | None = None) -> int:
        refused = self._refused(keys, skip)
        if admit and refused:
            if skip is not None:
                refused.update(key for key in keys if key in skip)
            skip = refused
        return self.inner.access(keys, session, admit=admit, skip=skip, record=record)

    def admit(self, keys: list[int]) -> list[int]:
        refused = self._refused(keys, None)
        return self.inner.admit([key for key in keys if key not in refused])

    def evict(self, n: int) -> list[int]:
        return self.inner.evict(n)


def admitted(policy: EvictionPolicy, admission: Admission | None) -> EvictionPolicy:
    """``policy`` behind ``admission`` (as it is when there is no rule)."""
    return policy if admission is None else AdmittedPolicy(policy, admission)
