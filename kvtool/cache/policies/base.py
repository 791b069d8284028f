"""The policy interface: :class:`EvictionPolicy` (what every policy implements), and
:data:`tally`, the reference counter the LRU policies share."""

from __future__ import annotations

import collections
from abc import ABC, abstractmethod
from collections.abc import Callable, Container
from typing import Any, ClassVar

tally: Callable[[dict[int, int], list[int]], None] = collections._count_elements  # type: ignore[attr-defined]
"""``tally(index, keys)``: ``index[k] = index.get(k, 0) + 1`` for each key, in one C call.
It is ``Counter.update``'s engine (CPython has had it since 3.2; ``collections`` defines
it in Python where C is missing). The LRU's reference counts take it for a request's keys:
5 % fewer instructions for a whole replay of the Mooncake conversation trace than the loop
(BENCHMARKS.md, "Issue 23 speed, ninth pass"); ``Counter.update`` itself spends much of
that on its Mapping check."""


class EvictionPolicy(ABC):
    """Order and membership of one tier's cached blocks.

    Invariants: :attr:`index` holds exactly the cached keys; ``len(policy)`` is their
    number; :meth:`evict` only returns keys that were cached and removes them.
    """

    name: ClassVar[str]
    structural: ClassVar[bool] = False
    """True when the policy needs the chain (parent, depth) of every block."""
    pooled: ClassVar[bool] = False
    """True when the policy is a whole block pool that serves requests itself
    (:class:`VllmPolicy`): the hierarchy then hands it each request (``serve_request``)."""

    index: dict[int, Any]

    def __len__(self) -> int:
        return len(self.index)

    def __contains__(self, key: int) -> bool:
        return key in self.index

    @abstractmethod
    def access(self, keys: list[int], session: int, *, admit: bool = True,
               skip: Container[int] | None = None, record: list[int] | None = None) -> int:
        """Touch one request's blocks in this policy's order; return how many were inserted.

        ``keys`` are the request's chained block keys, head first. Cached keys are
        refreshed. Absent keys are inserted only when ``admit`` is true and the key is
        not in ``skip`` (write-through does not copy a block down from an upper-tier hit).
        Inserted keys are appended to ``record`` when it is given (for a data mover).
        ``session`` is a small int naming the request's session (its own id when the trace
        has no sessions).
        """

    @abstractmethod
    def admit(self, keys: list[int]) -> list[int]:
        """Insert blocks that arrive without a request (demotion); return those inserted."""

    @abstractmethod
    def evict(self, n: int) -> list[int]:
        """Remove at least ``n`` cached blocks (fewer only when the tier empties)."""

    def discard(self, n: int) -> int:
        """:meth:`evict`, for a caller that needs only how many blocks went (a tier
        without a mover or a tier below); return that number."""
        return len(self.evict(n))
