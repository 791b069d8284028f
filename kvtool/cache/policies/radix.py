"""``radix``: SGLang's radix cache, LRU among blocks with no cached child (leaf-only)."""

from __future__ import annotations

from kvtool.cache.policies.admission import Admission, admitted
from kvtool.cache.policies.base import EvictionPolicy
from kvtool.cache.policies.chain import ChainPolicy


class RadixPolicy(ChainPolicy):
    """SGLang's RadixCache: only a block with no cached child may be evicted.

    Order: LRU among leaves by last access (a request refreshes its whole matched path);
    when a leaf goes and its parent becomes a leaf, the parent joins the candidates with
    its own last-access time. So a chain is always evicted tail-first and a shared head
    (a system prompt) goes only after every chain under it: no dead suffix can exist.
    It does not remove the cyclic-access cliff (docs/plan.md).
    """

    name = "radix"


def make(*, window: int | None = None, block_tokens: int = 1,
         admission: Admission | None = None) -> EvictionPolicy:
    """A fresh ``radix`` (:data:`kvtool.cache.policies.POLICIES`), behind ``admission`` if given."""
    return admitted(RadixPolicy(), admission)
