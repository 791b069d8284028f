"""One cache tier: a capacity, an eviction policy, and an optional data mover.

A :class:`Tier` is block *metadata* only: which keys it holds (its policy's index) and
how many it may hold. Moving real bytes is the job of a :class:`TierMover`, which the
hierarchy calls after every metadata change; the default does nothing, so the replay
replayer simulates at any scale, and a later DRAM/NVMe mover plugs in without touching
eviction logic.
"""

from __future__ import annotations

import math
from typing import Protocol

import msgspec

from kvtool.cache.policies import EvictionPolicy

TIER_NAMES: tuple[str, ...] = ("gpu", "dram", "nvme")
"""Tier names, highest (fastest, checked first) to lowest."""


class TierMover(Protocol):
    """Moves the bytes behind a tier's blocks. Every method gets keys in the order the
    metadata changed; it must not change metadata.

    * ``on_write(tier, keys)`` — the blocks were just inserted into ``tier`` (computed,
      promoted from below, or demoted from above); store their bytes;
    * ``on_read(tier, keys)`` — a request loads these cached blocks from ``tier``;
    * ``on_evict(tier, keys)`` — the blocks left ``tier``; free their space.
    """

    def on_write(self, tier: str, keys: list[int]) -> None: ...

    def on_read(self, tier: str, keys: list[int]) -> None: ...

    def on_evict(self, tier: str, keys: list[int]) -> None: ...


class TimedMover(Protocol):
    """Moves the bytes behind a hierarchy driven through its timed protocol (a cluster
    node's tiers below its engines, :mod:`kvtool.serving.sim`); ``by`` names who moves
    them: the engine whose GPU pool they leave or reach.

    * ``on_store(tier, keys, by)`` — the blocks were just inserted into ``tier`` (a store
      or a promotion arrived); write their bytes;
    * ``on_load(tier, keys, by)`` — read the blocks into ``by``'s GPU pool and check them;
      return those that failed (corrupt or lost);
    * ``on_evict(tier, keys)`` — the blocks left ``tier``; free their space.
    """

    def on_store(self, tier: str, keys: list[int], by: int) -> None: ...

    def on_load(self, tier: str, keys: list[int], by: int) -> list[int]: ...

    def on_evict(self, tier: str, keys: list[int]) -> None: ...


class NullMover:
    """The simulation mover: metadata only, no bytes move."""

    def on_write(self, tier: str, keys: list[int]) -> None:
        return None

    def on_read(self, tier: str, keys: list[int]) -> None:
        return None

    def on_evict(self, tier: str, keys: list[int]) -> None:
        return None


class Watermark(msgspec.Struct, frozen=True):
    """Mooncake-style batch eviction (docs/replay.md).

    When a tier holds more than ``high × capacity`` blocks it evicts, in one batch, the
    fraction ``max(ratio, used/capacity − high + ratio)`` of the blocks it holds (Mooncake
    ``BatchEvict``: defaults 0.90 and 0.05), and never less than its overflow.
    """

    high: float = 0.90
    ratio: float = 0.05


class Tier:
    """A named tier holding at most ``capacity`` blocks (``math.inf``: unbounded).

    Invariant between requests: ``len(tier) <= capacity``. During a request the tier may
    run over; :meth:`evict_to_capacity` brings it back (docs/definitions.md: every tier evicts down
    to its capacity before the next request).
    """

    __slots__ = ("capacity", "mover", "name", "policy", "watermark")

    def __init__(self, name: str, capacity: float, policy: EvictionPolicy, *,
                 watermark: Watermark | None = None, mover: TierMover | None = None) -> None:
        if not capacity > 0:
            raise ValueError(f"tier {name}: capacity must be positive (0 means no tier)")
        self.name = name
        self.capacity = capacity
        self.policy = policy
        self.watermark = watermark
        self.mover = mover
        if hasattr(policy, "capacity"):
            policy.capacity = capacity
        if capacity == math.inf and hasattr(policy, "unbounded"):
            policy.unbounded()

    def __len__(self) -> int:
        return len(self.policy.index)

    def __contains__(self, key: int) -> bool:
        return key in self.policy.index

    def overflow(self) -> int:
        """Blocks to evict now (0 when the tier is within its capacity or watermark)."""
        used = len(self.policy.index)
        cap = self.capacity
        if cap == math.inf:
            return 0
        wm = self.watermark
        if wm is None:
            return used - int(cap) if used > cap else 0
        if used <= wm.high * cap:
            return 0
        fraction = max(wm.ratio, used / cap - wm.high + wm.ratio)
        return max(math.ceil(fraction * used), used - int(cap))

    def evict_to_capacity(self) -> list[int]:
        """Evict what :meth:`overflow` says, in policy order; return the evicted keys."""
        n = self.overflow()
        if not n:
            return []
        out = self.policy.evict(n)
        if self.mover is not None and out:
            self.mover.on_evict(self.name, out)
        return out
