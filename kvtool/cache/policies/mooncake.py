"""``mooncake``: Mooncake Store's eviction, ``lru`` with watermark batch eviction (high
watermark 0.90, batch 5 %: its registration in :data:`kvtool.cache.policies.POLICIES`
gives the tier those defaults)."""

from __future__ import annotations

from kvtool.cache.policies.admission import Admission, admitted
from kvtool.cache.policies.base import EvictionPolicy
from kvtool.cache.policies.lru import LruPolicy


def make(*, window: int | None = None, block_tokens: int = 1,
         admission: Admission | None = None) -> EvictionPolicy:
    """A fresh ``lru`` (the watermark is the tier's), behind ``admission`` if given."""
    return admitted(LruPolicy(), admission)
