"""Eviction policies: which cached block of one tier goes first.

A policy owns the block metadata of one tier (which keys are cached, in what order) and
nothing else: no bytes, no capacities, no statistics. The tier (:mod:`kvtool.cache.tier`)
decides *how many* blocks to evict; the policy decides *which*.

Every policy keeps its cached keys in :attr:`EvictionPolicy.index`, a dict whose ``in`` is
the tier's membership test (the lookup loop uses it directly, for speed), and implements:

* :meth:`~EvictionPolicy.access` — one request's blocks (head → tail, as chained keys),
  touched in the policy's order; absent ones are inserted when admitted;
* :meth:`~EvictionPolicy.admit` — blocks arriving without a request (write-back
  demotion from the tier above), inserted as most recent in the order given;
* :meth:`~EvictionPolicy.evict` — remove at least ``n`` blocks (exactly ``n`` unless the
  policy evicts in units, as :class:`OraclePolicy` does) and return them in eviction order;
  :meth:`~EvictionPolicy.discard` does the same and returns only how many (``lru``'s
  skips building the list: a tier without a mover needs no more).

Keys are plain ints (the chained block keys of :mod:`kvtool.trace.hashing` or a
Mooncake trace's ``hash_ids``): no per-block objects, so that a tier of ten million
blocks fits in about 80 bytes per block with ``lru`` (bench/replay_memory.py).

One module per policy, each with a ``make`` function; :data:`POLICIES` registers them
(name → module, and what the name implies for the tier). The ``--policy`` choices, a tiers
file's ``policy`` values and a cluster file's come from there (:mod:`kvtool.cache.names`).
This package imports no policy module until one is made, so argument parsing stays cheap.
Adding a policy: docs/architecture.md, "Where to add…".

Policies (docs/definitions.md; replay semantics in docs/replay.md):

========================  ===============================================================
``lru``                   head-first LRU: insertion-ordered store, touched head → tail
``lru-tail-first``        vLLM's free queue: touched tail → head, so tails go first
``radix``                 SGLang: LRU among blocks with no cached child (leaf-only)
``prefix-fair``           kvtool's policy: leaf-only, deepest of the oldest leaves first
``oracle``                the fixed-subset bound (docs/plan.md): keep a fixed subset of sessions
``mooncake``              ``lru`` with watermark batch eviction (a tier option)
``vllm``                  vLLM v1's prefix-cache pool exactly (GPU tier only; the default
                          there): :class:`VllmPolicy`
``arc``                   ARC (Megiddo and Modha, FAST 2003)
``s3fifo``                S3-FIFO (Yang et al., SOSP 2023)
``lfu``                   least frequently used
``vllm-lru``              vLLM 0.33.0's CPU offloading manager with its LRU policy
``vllm-arc``              vLLM 0.33.0's CPU offloading manager with its ARC policy
========================  ===============================================================
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, NamedTuple

from kvtool.lazy import exports

if TYPE_CHECKING:
    from kvtool.cache.policies.admission import Admission, AdmittedPolicy
    from kvtool.cache.policies.arc import ArcPolicy
    from kvtool.cache.policies.base import EvictionPolicy
    from kvtool.cache.policies.lfu import LfuPolicy
    from kvtool.cache.policies.lru import LruPolicy
    from kvtool.cache.policies.lru_tail_first import LruTailFirstPolicy
    from kvtool.cache.policies.oracle import OraclePolicy
    from kvtool.cache.policies.prefix_fair import PrefixFairPolicy
    from kvtool.cache.policies.radix import RadixPolicy
    from kvtool.cache.policies.s3fifo import S3FifoPolicy
    from kvtool.cache.policies.vllm import VllmPolicy
    from kvtool.cache.policies.vllm_arc import VllmArcPolicy
    from kvtool.cache.policies.vllm_lru import VllmLruPolicy


class Policy(NamedTuple):
    """A registered policy."""

    module: str
    """The module of this package whose ``make(*, window, block_tokens, admission)`` makes
    a fresh one."""
    watermark: tuple[float, float] | None = None
    """Watermark batch eviction the policy implies: (high watermark, batch ratio)."""
    pooled: bool = False
    """A whole block pool that serves requests itself (only on :data:`POOLED_TIERS`)."""


POLICIES: dict[str, Policy] = {
    "lru": Policy("lru"),
    "lru-tail-first": Policy("lru_tail_first"),
    "radix": Policy("radix"),
    "prefix-fair": Policy("prefix_fair"),
    "oracle": Policy("oracle"),
    "mooncake": Policy("mooncake", watermark=(0.90, 0.05)),
    "vllm": Policy("vllm", pooled=True),
    "arc": Policy("arc"),
    "s3fifo": Policy("s3fifo"),
    "lfu": Policy("lfu"),
    "vllm-lru": Policy("vllm_lru"),
    "vllm-arc": Policy("vllm_arc"),
}
"""Policy names accepted by ``--policy``, the tiers file and the cluster file, in the order
``--help`` lists them: the one registry."""

WATERMARK_DEFAULTS: dict[str, tuple[float, float]] = {
    name: p.watermark for name, p in POLICIES.items() if p.watermark is not None}
"""Policies that imply watermark batch eviction: name → (high watermark, batch ratio)."""

POOLED_TIERS: tuple[str, ...] = ("gpu",)
"""Tiers a pooled policy (``vllm``) may manage: the top tier, where requests run."""


def make_policy(name: str, *, window: int | None = None, block_tokens: int = 1,
                admission: Admission | None = None) -> EvictionPolicy:
    """A fresh policy by name (one of :data:`POLICIES`); ``window`` tunes
    ``prefix-fair``, ``block_tokens`` sizes ``vllm``'s blocks (the others ignore them);
    ``admission`` puts the policy behind an admission rule (the ``vllm-*`` policies apply
    it inside their store, as vLLM does; the ``vllm`` GPU pool takes none)."""
    module = importlib.import_module(f"{__name__}.{POLICIES[name].module}")
    policy: EvictionPolicy = module.make(window=window, block_tokens=block_tokens,
                                         admission=admission)
    return policy


__getattr__, __dir__ = exports(__name__, {
    "Admission": "admission",
    "AdmittedPolicy": "admission",
    "ArcPolicy": "arc",
    "EvictionPolicy": "base",
    "LfuPolicy": "lfu",
    "LruPolicy": "lru",
    "LruTailFirstPolicy": "lru_tail_first",
    "OraclePolicy": "oracle",
    "PrefixFairPolicy": "prefix_fair",
    "RadixPolicy": "radix",
    "S3FifoPolicy": "s3fifo",
    "VllmPolicy": "vllm",
    "VllmArcPolicy": "vllm_arc",
    "VllmLruPolicy": "vllm_lru",
})

__all__ = [
    "POLICIES",
    "POOLED_TIERS",
    "WATERMARK_DEFAULTS",
    "Admission",
    "AdmittedPolicy",
    "ArcPolicy",
    "EvictionPolicy",
    "LfuPolicy",
    "LruPolicy",
    "LruTailFirstPolicy",
    "OraclePolicy",
    "Policy",
    "PrefixFairPolicy",
    "RadixPolicy",
    "S3FifoPolicy",
    "VllmArcPolicy",
    "VllmLruPolicy",
    "VllmPolicy",
    "make_policy",
]
