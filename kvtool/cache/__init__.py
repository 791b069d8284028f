"""The tiered prefix-cache engine: tiers, eviction policies, hierarchy, replay, time model.

Data flows one way: requests (:mod:`kvtool.trace`) → :class:`TierHierarchy` (tiers, each a
:class:`Tier` with an :class:`EvictionPolicy`) → :class:`RoundStats` → a report dict.
Definitions are in docs/definitions.md; engine semantics are in docs/replay.md.
Block hashing is not here: keys come from :mod:`kvtool.trace.hashing` or the trace.
"""

from kvtool.cache.engine import CacheConfig, Replay, RequestOutcome, TierSpec, replay
from kvtool.cache.hierarchy import WRITE_POLICIES, TierHierarchy
from kvtool.cache.policies import (
    POLICIES,
    EvictionPolicy,
    LruPolicy,
    LruTailFirstPolicy,
    OraclePolicy,
    PrefixFairPolicy,
    RadixPolicy,
    make_policy,
)
from kvtool.cache.stats import RoundStats
from kvtool.cache.tier import TIER_NAMES, NullBackend, Tier, TierBackend, Watermark
from kvtool.cache.timemodel import TimeModel

__all__ = [
    "POLICIES",
    "TIER_NAMES",
    "WRITE_POLICIES",
    "CacheConfig",
    "EvictionPolicy",
    "LruPolicy",
    "LruTailFirstPolicy",
    "NullBackend",
    "OraclePolicy",
    "PrefixFairPolicy",
    "RadixPolicy",
    "Replay",
    "RequestOutcome",
    "RoundStats",
    "Tier",
    "TierBackend",
    "TierHierarchy",
    "TierSpec",
    "TimeModel",
    "Watermark",
    "make_policy",
    "replay",
]
