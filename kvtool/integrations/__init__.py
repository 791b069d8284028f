"""kvtool's tiers under real inference engines.

* :mod:`kvtool.integrations.spec` — the tier words an integration takes (as ``kvtool
  replay``'s: ``dram``, ``nvme``, ``policy``, ``tiers``, host NQN and DH-HMAC-CHAP key files);
* :mod:`kvtool.integrations.blockstore` — :class:`BlockStore`: the tier hierarchy and the
  data mover of data-mode replay, with the engine's KV cache as the top tier, CRC32C on
  every load and durable NVMe / shared-memory tiers;
* :mod:`kvtool.integrations.vllm` — ``KvtoolConnector``, a vLLM v1 KV connector
  (``kv_connector_module_path="kvtool.integrations.vllm"``; needs ``kvtool[vllm]``);
* :mod:`kvtool.integrations.lmcache` — an LMCache remote storage plugin;
* :mod:`kvtool.integrations.tinymodel` — a small random-weight Llama checkpoint, made once
  and cached, so a real engine runs on any box (not a real model);
* :mod:`kvtool.integrations.engine_replay` — ``kvtool replay TRACE --engine vllm``.

Docs: docs/integrations.md.
"""

from typing import TYPE_CHECKING

from kvtool.lazy import exports

if TYPE_CHECKING:
    from kvtool.integrations.blockstore import BlockStore, block_keys
    from kvtool.integrations.spec import StoreSpec

__getattr__, __dir__ = exports(__name__, {
    "BlockStore": "blockstore",
    "StoreSpec": "spec",
    "block_keys": "blockstore",
})

__all__ = ["BlockStore", "StoreSpec", "block_keys"]
