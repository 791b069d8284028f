"""``lru-tail-first``: vLLM's free queue, touched tail → head, so tails go first."""

from __future__ import annotations

from kvtool.cache.policies.admission import Admission, admitted
from kvtool.cache.policies.base import EvictionPolicy
from kvtool.cache.policies.lru import LruPolicy


class LruTailFirstPolicy(LruPolicy):
    """Tail-first LRU, vLLM's ``FreeKVCacheBlockQueue`` (docs/replay.md).

    Order: a request touches its blocks tail → head, so within a chain the head is the
    *most* recent and the tail goes first; across chains, LRU by last use. A cold chain
    shrinks from its tail and keeps a usable prefix until its head goes. Under strict
    round-robin traffic larger than the tier it still collapses, within about one round
    (docs/plan.md): every session's reuse distance is a whole round.
    """

    name = "lru-tail-first"
    tail_first = True


def make(*, window: int | None = None, block_tokens: int = 1,
         admission: Admission | None = None) -> EvictionPolicy:
    """A fresh ``lru-tail-first`` (:data:`kvtool.cache.policies.POLICIES`), behind ``admission`` if given."""
    return admitted(LruTailFirstPolicy(), admission)
