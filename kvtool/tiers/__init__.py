"""Data tiers: where the bytes of KV blocks live in data-mode replay.

* :mod:`kvtool.tiers.base` — the tier interface (:class:`DataTier`: lookup /
  prepare_load / complete_load / prepare_store / complete_store / evict), the shape of
  vLLM's offloading connector, so other stores (Mooncake Store) plug in beside these;
* :mod:`kvtool.tiers.gpu` — the CPU "GPU" tier: one paged KV pool with vLLM v1 block-pool
  semantics (block ids, reference counts, the hash → block map, the free queue);
* :mod:`kvtool.tiers.dram` — a preallocated host pool (numpy);
* :mod:`kvtool.tiers.nvme` — kvtool's object store on any store URL (file, block device,
  ``nvme+tcp://``);
* :mod:`kvtool.tiers.option` — the ``--dram 1GiB`` / ``--nvme 2GiB@/var/tmp/kv.img``
  option syntax.

Which blocks a tier holds, and which it evicts, is decided by the replayer
(:mod:`kvtool.cache`); a data tier moves bytes and frees space when told.
"""

from typing import TYPE_CHECKING

from kvtool.lazy import exports

if TYPE_CHECKING:
    from kvtool.tiers.base import DataTier, Link, TierError, TransferJob
    from kvtool.tiers.dram import DramTier
    from kvtool.tiers.gpu import GpuBlockPool
    from kvtool.tiers.option import TierOption

__getattr__, __dir__ = exports(__name__, {
    "DataTier": "base",
    "DramTier": "dram",
    "GpuBlockPool": "gpu",
    "Link": "base",
    "TierError": "base",
    "TierOption": "option",
    "TransferJob": "base",
})

__all__ = ["DataTier", "DramTier", "GpuBlockPool", "Link", "TierError", "TierOption",
           "TransferJob"]
