"""The tiered prefix cache and its replayer: tiers, eviction policies, hierarchy, counts.

Data flows one way: requests (:mod:`kvtool.trace`) → :class:`TierHierarchy` (tiers, each a
:class:`Tier` with an :class:`EvictionPolicy`) → :class:`RoundStats` → a report dict.
Definitions are in docs/definitions.md; replay semantics are in docs/replay.md.
Block hashing is not here: keys come from :mod:`kvtool.trace.hashing` or the trace.
Names are exported lazily (:mod:`kvtool.lazy`), so :mod:`kvtool.cache.names` stays cheap.
"""

from typing import TYPE_CHECKING

from kvtool.lazy import exports

if TYPE_CHECKING:
    from kvtool.cache.hierarchy import TierHierarchy
    from kvtool.cache.names import WRITE_POLICIES
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
    from kvtool.cache.replayer import CacheConfig, Replayer, RequestOutcome, TierSpec, replay
    from kvtool.cache.stats import RoundStats
    from kvtool.cache.tier import TIER_NAMES, NullMover, Tier, TierMover, Watermark

__getattr__, __dir__ = exports(__name__, {
    "CacheConfig": "replayer",
    "Replayer": "replayer",
    "RequestOutcome": "replayer",
    "TierSpec": "replayer",
    "replay": "replayer",
    "WRITE_POLICIES": "names",
    "TierHierarchy": "hierarchy",
    "POLICIES": "policies",
    "EvictionPolicy": "policies",
    "LruPolicy": "policies",
    "LruTailFirstPolicy": "policies",
    "OraclePolicy": "policies",
    "PrefixFairPolicy": "policies",
    "RadixPolicy": "policies",
    "make_policy": "policies",
    "RoundStats": "stats",
    "TIER_NAMES": "tier",
    "NullMover": "tier",
    "Tier": "tier",
    "TierMover": "tier",
    "Watermark": "tier",
})

__all__ = [
    "POLICIES",
    "TIER_NAMES",
    "WRITE_POLICIES",
    "CacheConfig",
    "EvictionPolicy",
    "LruPolicy",
    "LruTailFirstPolicy",
    "NullMover",
    "OraclePolicy",
    "PrefixFairPolicy",
    "RadixPolicy",
    "Replayer",
    "RequestOutcome",
    "RoundStats",
    "Tier",
    "TierHierarchy",
    "TierMover",
    "TierSpec",
    "Watermark",
    "make_policy",
    "replay",
]
