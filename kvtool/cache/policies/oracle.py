"""``oracle``: the fixed-subset bound (docs/plan.md): keep a fixed subset of sessions."""

from __future__ import annotations

import heapq
from collections.abc import Container

from kvtool.cache.policies.admission import Admission, admitted
from kvtool.cache.policies.base import EvictionPolicy


class OraclePolicy(EvictionPolicy):
    """The fixed-subset bound of docs/plan.md: keep the earliest sessions, drop the newest.

    For cyclic (round-robin multi-turn) access with a working set larger than the tier,
    the best a policy can do is keep a fixed subset of sessions and let the others miss
    (Belady's choice: the session served last is needed last). This policy needs to know
    the future only in that sense: sessions are ranked by first appearance, every block
    is owned by the first session that inserted it, and when the tier is over capacity it
    evicts, tail-first, from the lowest-ranked (latest-arrived) session that still holds
    blocks, exactly as many as needed. So the earliest sessions stay whole, one session
    at the margin keeps a prefix, and the subset shrinks only as its sessions grow. A
    shared head is owned by its first session and stays while that session is kept.

    It is a reference point, not a proof of optimality. Traces without sessions count
    each request as its own session, which makes it admission refusal (the first
    requests' blocks stay): meaningful only for multi-turn traces.
    """

    name = "oracle"

    def __init__(self) -> None:
        self.index: dict[int, int] = {}                 # key -> owning session rank
        self._owned: dict[int, dict[int, None]] = {}     # rank -> keys, insertion order
        self._ranks: list[int] = []                      # max-heap (negated) of holders

    def _add(self, key: int, rank: int) -> None:
        self.index[key] = rank
        owned = self._owned.get(rank)
        if owned is None:
            owned = self._owned[rank] = {}
        if not owned:
            heapq.heappush(self._ranks, -rank)
        owned[key] = None

    def access(self, keys: list[int], session: int, *, admit: bool = True,
               skip: Container[int] | None = None, record: list[int] | None = None) -> int:
        if not admit:
            return 0
        index = self.index
        new = [key for key in keys if key not in index and (skip is None or key not in skip)]
        for key in new:
            self._add(key, session)
        if record is not None:
            record.extend(new)
        return len(new)

    def admit(self, keys: list[int]) -> list[int]:
        # Blocks demoted from above have lost their owner; they rank last (evicted first).
        new = [key for key in keys if key not in self.index]
        for key in new:
            self._add(key, 1 << 62)
        return new

    def evict(self, n: int) -> list[int]:
        out: list[int] = []
        while len(out) < n and self._ranks:
            rank = -self._ranks[0]
            owned = self._owned.get(rank)
            if not owned:
                heapq.heappop(self._ranks)
                self._owned.pop(rank, None)
                continue
            while owned and len(out) < n:
                key, _ = owned.popitem()    # newest first: the chain's tail
                del self.index[key]
                out.append(key)
        return out


def make(*, window: int | None = None, block_tokens: int = 1,
         admission: Admission | None = None) -> EvictionPolicy:
    """A fresh ``oracle`` (:data:`kvtool.cache.policies.POLICIES`), behind ``admission`` if given."""
    return admitted(OraclePolicy(), admission)
