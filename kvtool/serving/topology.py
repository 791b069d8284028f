"""The cluster file: nodes, GPUs, engines, links, tiers and router in one TOML file.

:func:`load_cluster` reads the file with :mod:`kvtool.configfile` and returns a frozen
:class:`ClusterSpec`; every error is an :class:`~kvtool.errors.InputError` naming the file,
the line and the key (``gp7000.toml:31: field 'engine[0].tp': ...``), and unknown keys are
errors. The format, with an annotated example, is in docs/serving.md ("The cluster file").
The smallest valid file::

    [[engine]]
    gpu = "a100-sxm"
    model = "llama-2-7b"
    tp = 1

Invariants of a :class:`ClusterSpec`:

* ``engines`` holds one :class:`EngineSpec` per replica (``count`` expanded), in file
  order, ``index`` = position; names are unique and every engine's node is in ``nodes``;
* every engine runs the same model with the same KV dtype (blocks move between engines
  and tiers, so they must be the same bytes); TP may differ unless a tier's capacity is
  given in bytes;
* each engine's ``num_gpu_blocks`` is resolved: given, or modelled from GPU memory
  (:meth:`kvtool.serving.roofline.StepModel.kv_pool_blocks`), null block included;
* P/D split: if any engine's role is ``prefill`` or ``decode``, there is at least one of
  each (``both`` engines serve in both pools);
* link names derived from it are unique: ``pcie/<engine>``, ``nic/<node>``,
  ``target/<target>`` and ``mooncake``;
* the Mooncake ``master`` is a node, and a target's ``node`` a storage node (``storage =
  true``), when given; every node has an engine unless it is a storage node.

``[placement]`` (where ``kvtool cluster up`` runs the nodes) is the deployment's: this
reader lets it be and :mod:`kvtool.cluster.placement` reads it (docs/cluster.md).

Bandwidths are GB/s (1e9 B/s) per direction; ``math.inf`` means unlimited.
"""

from __future__ import annotations

import ipaddress
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtool.cache.policies import POLICIES
from kvtool.configfile import ConfigDocument, ConfigTable, parse_config_text, read_config, show_value
from kvtool.errors import InputError, UsageError
from kvtool.geometry.dtypes import canonical_dtype
from kvtool.geometry.model import ModelSpec
from kvtool.geometry.params import weight_dtype as canonical_weight_dtype
from kvtool.serving.gpus import GPU, gpu_from_table, resolve_gpu, vllm_batch_defaults
from kvtool.serving.roofline import StepModel
from kvtool.serving.router import ROUTERS, make_router
from kvtool.units import Capacity

ROLES = ("both", "prefill", "decode")
DEFAULT_BLOCK_TOKENS = 16
"""vLLM's ``CacheConfig.DEFAULT_BLOCK_SIZE`` (vllm/config/cache.py, vLLM 0.33.0)."""
DEFAULT_GPU_MEMORY_UTILIZATION = 0.92
"""vLLM's ``CacheConfig.gpu_memory_utilization`` default (vllm/config/cache.py, vLLM 0.33.0)."""
DEFAULT_ROUTER = "round-robin"
DEFAULT_POLICY = "lru"

_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_TOP_KEYS = {"name", "block_tokens", "router", "gpu", "node", "engine", "mooncake", "nvme",
             "placement", "connector", "pd_transfer"}
_CONNECTOR_KEYS = {"name", "lookup_ms", "chunk_tokens", "chunk_ms", "gbps", "source", "load"}
CONNECTOR_LOADS = ("always", "faster")
"""When a request loads the hit the tiers below hold: ``always`` (vLLM's connectors load
every token they report found: LMCache, the offloading connector) or ``faster`` (only when
loading beats recomputing, kvtool's default without a connector)."""
CLUSTER_KEYS: dict[str, frozenset[str]] = {}
"""Each table's keys (``""``: the top level), filled below: what a file may say."""
PD_TRANSFERS = ("direct", "store")
"""How a P/D split moves a prompt's KV: the decode engine pulls it from the prefill engine
(``direct``, vLLM's P2P connectors), or the prefill engine writes it to the tiers below and
the decode engine reads it back (``store``, the WQS report's design)."""
_NODE_KEYS = {"name", "gpus", "nic_gbps", "dram", "dram_policy", "pcie_gbps", "storage",
              "address"}
_ENGINE_KEYS = {"name", "node", "count", "gpu", "model", "tp", "dtype", "kv_dtype", "role",
                "max_num_seqs", "max_num_batched_tokens", "num_gpu_blocks",
                "gpu_memory_utilization", "enable_prefix_caching", "step_time", "share_gpus"}
STEP_TIMES = ("roofline", "dynamo-mocker")
"""An engine's step time: kvtool's roofline (default), or NVIDIA Dynamo's mocker polynomial
(:mod:`kvtool.serving.mockerstep`: routing compared with Dynamo on the same clock)."""
_MOONCAKE_KEYS = {"capacity", "policy", "gbps", "master", "segment"}
_NVME_KEYS = {"capacity", "policy", "target"}
_TARGET_KEYS = {"name", "read_gbps", "write_gbps", "node", "size", "config"}
CLUSTER_KEYS.update({"": frozenset(_TOP_KEYS), "node": frozenset(_NODE_KEYS),
                     "engine": frozenset(_ENGINE_KEYS), "mooncake": frozenset(_MOONCAKE_KEYS),
                     "nvme": frozenset(_NVME_KEYS), "nvme.target": frozenset(_TARGET_KEYS),
                     "connector": frozenset(_CONNECTOR_KEYS)})
DEFAULT_TARGET_BYTES = 64 << 20
"""A placed target's namespace when the file gives no ``size`` (memory-backed)."""
DEFAULT_SEGMENT_BYTES = 64 << 20
"""A node's Mooncake segment when the file gives no ``segment``."""
_QUANTISED = ("fp8", "int8", "fp4", "int4")

Path_ = tuple[str | int, ...]


@dataclass(frozen=True)
class RouterSpec:
    """The router's name (one of :data:`ROUTERS`) and its parameters
    (:func:`kvtool.serving.router.make_router`)."""

    name: str
    params: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class NodeSpec:
    """One machine: its NIC, its optional DRAM KV tier, its GPUs' PCIe."""

    name: str
    nic_gbps: float = math.inf
    """NIC bandwidth per direction (GB/s); ``inf``: unlimited."""
    dram: Capacity | None = None
    """A per-node DRAM KV tier shared by the node's engines (``None``: none)."""
    dram_policy: str = DEFAULT_POLICY
    pcie_gbps: float | None = None
    """GPU↔host bandwidth per GPU and direction; ``None``: each engine's GPU's own."""
    gpus: int | None = None
    """GPUs in the node, when given (the engines' TP sizes must fit)."""
    auto: bool = False
    """Made for an engine that named no node."""
    storage: bool = False
    """A storage node: it runs NVMe/TCP targets and needs no engine."""
    address: str | None = None
    """Its IPv4 address (placement kind ``hosts``: where its Ray worker runs and what its
    services listen on)."""


@dataclass(frozen=True)
class EngineSpec:
    """One engine (one replica): a model on ``tp`` GPUs of one node."""

    index: int
    name: str
    node: str
    gpu: GPU
    model: ModelSpec
    tp: int
    dtype: str
    """Weights' dtype."""
    kv_dtype: str
    role: str
    max_num_seqs: int
    max_num_batched_tokens: int
    num_gpu_blocks: int
    """vLLM's ``num_gpu_blocks``, the null block included (given, or modelled)."""
    num_gpu_blocks_basis: str
    """``given`` (from the file) or ``modelled`` (from memory, weights and utilisation)."""
    gpu_memory_utilization: float
    pcie_gbps: float
    """GPU↔host bandwidth of ONE GPU per direction (GB/s)."""
    block_bytes: int
    """One rank's KV object for one block (the size tiers count, docs/definitions.md)."""
    all_ranks_block_bytes: int
    """What all ranks hold for one block (what one engine's load or store moves)."""
    step: StepModel = field(compare=False, repr=False)
    """The engine's roofline (shared by the replicas of one ``[[engine]]`` table)."""
    enable_prefix_caching: bool = True
    """vLLM's ``enable_prefix_caching`` (on by default in vLLM v1)."""
    share_gpus: str | None = None
    """Engines naming the same group time-share one set of GPUs: one of them steps at a
    time (a prefill and a decode engine on the same cards, the WQS report's scenario 2)."""

    @property
    def host_link_gbps(self) -> float:
        """All ranks' PCIe together (``tp × pcie_gbps``): one engine's GPU↔host path."""
        return self.tp * self.pcie_gbps

    def to_dict(self) -> dict[str, Any]:
        return {"index": self.index, "name": self.name, "node": self.node, "gpu": self.gpu.name,
                "model": self.model.name, "tp": self.tp, "dtype": self.dtype,
                "kv_dtype": self.kv_dtype, "role": self.role, "max_num_seqs": self.max_num_seqs,
                "max_num_batched_tokens": self.max_num_batched_tokens,
                "num_gpu_blocks": self.num_gpu_blocks,
                "num_gpu_blocks_basis": self.num_gpu_blocks_basis,
                "gpu_memory_utilization": self.gpu_memory_utilization,
                "pcie_gbps": self.pcie_gbps, "block_bytes": self.block_bytes,
                "all_ranks_block_bytes": self.all_ranks_block_bytes,
                "share_gpus": self.share_gpus,
                "enable_prefix_caching": self.enable_prefix_caching,
                "step_time": getattr(self.step, "kind", "roofline")}


@dataclass(frozen=True)
class PoolSpec:
    """The cluster-wide Mooncake DRAM pool."""

    capacity: Capacity
    policy: str = DEFAULT_POLICY
    gbps: float = math.inf
    """Its transfer path per direction (GB/s); ``inf``: unlimited."""
    master: str | None = None
    """The node running the master (placement; ``None``: the first node)."""
    segment: int = DEFAULT_SEGMENT_BYTES
    """Bytes each node lends to the pool when ``cluster up`` runs it."""


@dataclass(frozen=True)
class TargetSpec:
    """One NVMe-oF target: its own bandwidth per direction (GB/s)."""

    name: str
    read_gbps: float = math.inf
    write_gbps: float = math.inf
    node: str | None = None
    """The storage node it runs on (placement; ``None``: not placed)."""
    size: int = DEFAULT_TARGET_BYTES
    """Bytes of its namespace when ``cluster up`` runs it (without ``config``)."""
    config: str | None = None
    """A kvtool target config (absolute path) whose subsystems and namespaces ``cluster up``
    serves instead of one memory namespace of ``size``; it sets listeners and hosts."""


@dataclass(frozen=True)
class NvmeSpec:
    """The NVMe-oF pool: blocks are spread over its targets."""

    capacity: Capacity
    targets: tuple[TargetSpec, ...]
    policy: str = DEFAULT_POLICY


@dataclass(frozen=True)
class ConnectorSpec:
    """What the KV connector between the engines and the tiers below costs (``[connector]``:
    LMCache over Mooncake in the WQS report). Defaults are the WQS report's, where a
    ``[connector]`` table is given; without one the connector costs nothing."""

    name: str = "lmcache"
    lookup_ms: float = 50.0
    """Per request that loads from the tiers below, once: the connector's lookup of the
    prompt's chunks and its store round trips before the first byte moves. Default: fitted
    to the WQS report's 1k-token iteration 2 (TTFT ≈ 300 ms; 243 ms without it, 293 ms with
    it, at the report's 50 prompts and concurrency 16)."""
    chunk_tokens: int = 256
    """The connector's chunk (LMCache ``chunk_size`` 256 in the WQS report)."""
    chunk_ms: float = 0.0
    """Per chunk a request loads, one after another within the request (a store round trip
    per chunk). Default 0: with the ceiling below, the WQS report's 100k-token iteration 2
    (≈ 16 s) leaves no room for one (18.8 s without it; 1 ms a chunk adds 0.8 s)."""
    gbps: float = 43.75
    """Ceiling of the engine's KV traffic to and from the tiers below, per direction (GB/s):
    WQS measured the framework's peak at 300–350 Gb/s (350 Gb/s = 43.75 GB/s), whatever the
    NIC (400 or 800 Gb/s)."""
    source: str = ("WQS report (../shared/seeds/003): 300–350 Gb/s peak; lookup and chunk "
                   "costs fitted to its 1k and 100k iteration-2 TTFTs")
    load: str = "always"
    """``always`` load what the tiers hold (vLLM's connectors), or only when ``faster``."""

    def load_s(self, tokens: int) -> float:
        """The fixed seconds a load of ``tokens`` pays besides moving its bytes."""
        if tokens <= 0:
            return 0.0
        chunks = -(-tokens // self.chunk_tokens)
        return (self.lookup_ms + chunks * self.chunk_ms) / 1000.0

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "lookup_ms": self.lookup_ms,
                "chunk_tokens": self.chunk_tokens, "chunk_ms": self.chunk_ms,
                "gbps": None if math.isinf(self.gbps) else self.gbps, "load": self.load,
                "source": self.source}


@dataclass(frozen=True)
class ClusterSpec:
    """A whole cluster as the cluster file describes it (module docstring: invariants)."""

    name: str
    block_tokens: int
    router: RouterSpec
    nodes: tuple[NodeSpec, ...]
    engines: tuple[EngineSpec, ...]
    gpus: Mapping[str, GPU] = field(default_factory=dict)
    """User-defined GPUs (``[[gpu]]``), by name."""
    mooncake: PoolSpec | None = None
    nvme: NvmeSpec | None = None
    source: str | None = None
    connector: ConnectorSpec | None = None
    """The KV connector's costs (``None``: none)."""
    pd_transfer: str = "direct"
    """P/D split: ``direct`` (engine to engine) or ``store`` (through the tiers below)."""

    @property
    def pd(self) -> bool:
        """Prefill/decode split: some engine only prefills (and so some only decodes)."""
        return any(e.role != "both" for e in self.engines)

    @property
    def model(self) -> ModelSpec:
        return self.engines[0].model

    def node(self, name: str) -> NodeSpec:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(name)

    def engines_on(self, node: str) -> tuple[EngineSpec, ...]:
        return tuple(e for e in self.engines if e.node == node)

    def capacity_blocks(self, capacity: Capacity) -> float:
        """Whole blocks a tier of ``capacity`` holds (``inf`` when unbounded).

        Bytes are divided by one rank's block object (docs/definitions.md); the loader has
        checked that every engine's is the same when a capacity is in bytes.
        """
        return capacity.blocks(self.engines[0].block_bytes, self.block_tokens)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary (the report's ``cluster`` object)."""
        def cap(c: Capacity | None) -> dict[str, Any] | None:
            if c is None:
                return None
            blocks = self.capacity_blocks(c)
            return {"capacity": str(c), "blocks": None if math.isinf(blocks) else int(blocks)}

        def bw(x: float | None) -> float | None:
            return None if x is None or math.isinf(x) else x

        return {
            "name": self.name, "source": self.source, "block_tokens": self.block_tokens,
            "router": {"name": self.router.name, **dict(self.router.params)},
            "pd": self.pd,
            "nodes": [{"name": n.name, "nic_gbps": bw(n.nic_gbps), "pcie_gbps": bw(n.pcie_gbps),
                       "gpus": n.gpus,
                       "dram": None if n.dram is None else {**(cap(n.dram) or {}),
                                                             "policy": n.dram_policy}}
                      for n in self.nodes],
            "engines": [e.to_dict() for e in self.engines],
            "mooncake": None if self.mooncake is None else {
                **(cap(self.mooncake.capacity) or {}), "policy": self.mooncake.policy,
                "gbps": bw(self.mooncake.gbps)},
            "nvme": None if self.nvme is None else {
                **(cap(self.nvme.capacity) or {}), "policy": self.nvme.policy,
                "targets": [{"name": t.name, "read_gbps": bw(t.read_gbps),
                             "write_gbps": bw(t.write_gbps)} for t in self.nvme.targets]},
            "connector": None if self.connector is None else self.connector.to_dict(),
            "pd_transfer": self.pd_transfer if self.pd else None,
        }


# -- reading ------------------------------------------------------------------------------------


TargetCheck = Callable[[Path], "str | None"]
"""Checks a ``[[nvme.target]]``'s ``config`` file: a message saying why it cannot serve as
a cluster target, or ``None``. The layer that runs targets (:mod:`kvtool.cluster`) passes
one; this module does not read target configs itself (it sits below :mod:`kvtool.target`)."""


def load_cluster(path: str | Path, *, default_block_tokens: int | None = None,
                 target_check: TargetCheck | None = None) -> ClusterSpec:
    """Read and validate a cluster file (TOML, or JSON with the same structure).

    ``default_block_tokens``: the block size when the file gives none (the replay passes
    its trace's; otherwise vLLM's default, :data:`DEFAULT_BLOCK_TOKENS`).
    ``target_check``: also check each target's ``config`` file (its error names this
    file's line and key)."""
    p = Path(path)
    return cluster_from_document(read_config(p), default_name=p.stem, base_dir=p.parent,
                                 default_block_tokens=default_block_tokens,
                                 target_check=target_check)


def parse_cluster(text: str, *, source: str | None = None, name: str = "cluster",
                  base_dir: str | Path | None = None) -> ClusterSpec:
    """Parse and validate cluster TOML text (see :func:`load_cluster`)."""
    return cluster_from_document(parse_config_text(text, source=source), default_name=name,
                                 base_dir=Path(base_dir) if base_dir is not None else None)


def cluster_from_document(doc: ConfigDocument, *, default_name: str = "cluster",
                          base_dir: Path | None = None,
                          default_block_tokens: int | None = None,
                          target_check: TargetCheck | None = None) -> ClusterSpec:
    """Validate a parsed cluster file (errors name file, line and key)."""
    return _Reader(doc, base_dir, target_check).cluster(default_name, default_block_tokens)


class _Reader:
    """One pass over the document through :class:`~kvtool.configfile.ConfigTable` (errors
    name file, line and key); the methods here read the values only a cluster file has:
    names, bandwidths, capacities, policies, addresses."""

    def __init__(self, doc: ConfigDocument, base_dir: Path | None,
                 target_check: TargetCheck | None = None) -> None:
        self.doc = doc
        self.base_dir = base_dir
        self.target_check = target_check

    # -- typed values ------------------------------------------------------------------------

    def fail(self, message: str, path: Path_) -> InputError:
        return self.doc.error(message, path)

    @staticmethod
    def text(t: ConfigTable, key: str, default: str | None = None) -> str | None:
        v = t.text(key, nonempty=True)
        return default if v is None else v.strip()

    def name(self, t: ConfigTable, key: str, default: str | None = None) -> str | None:
        v = self.text(t, key, default)
        if v is not None and not _NAME_RE.match(v):
            t.fail(f"a name is 1-64 of A-Z a-z 0-9 _ . -, got {v!r}", t.at(key))
        return v

    @staticmethod
    def gbps(t: ConfigTable, key: str, default: float = math.inf) -> float:
        if not t.has(key):
            return default
        v = t.data[key]
        if isinstance(v, str) and v.strip().lower() in ("inf", "unlimited"):
            return math.inf
        if isinstance(v, bool) or not isinstance(v, int | float) or math.isnan(v) or v <= 0:
            t.fail(f"expected a bandwidth in GB/s > 0 (or \"inf\"), got {show_value(v)}",
                   t.at(key))
        return float(v)

    @staticmethod
    def capacity(t: ConfigTable, key: str, *, required: bool = False) -> Capacity | None:
        if not t.has(key):
            if required:
                t.require(key)
            return None
        v = t.data[key]
        if isinstance(v, bool) or not isinstance(v, int | str):
            t.fail(f"expected a capacity such as \"53.7GB\", \"5000blk\" or \"inf\", got "
                   f"{show_value(v)}", t.at(key))
        try:
            return Capacity.parse(v, field=key)
        except UsageError as exc:
            t.fail(exc.message, t.at(key))

    @staticmethod
    def size(t: ConfigTable, key: str, default: int) -> int:
        n = t.size(key)
        if n is None:
            return default
        if n < 1 << 20:
            t.fail(f"must be at least 1MiB, got {t.data[key]!r}", t.at(key))
        return n

    @staticmethod
    def positive(t: ConfigTable, key: str) -> float | None:
        if not t.has(key):
            return None
        v = t.number(key, 0.0)
        if v <= 0 or math.isinf(v):
            t.fail(f"expected a number > 0, got {show_value(t.data[key])}", t.at(key))
        return v

    def policy(self, t: ConfigTable, key: str) -> str:
        v = self.text(t, key, DEFAULT_POLICY) or DEFAULT_POLICY
        if v.lower() not in POLICIES:
            t.fail(f"unknown policy {v!r} (known: {', '.join(POLICIES)})", t.at(key))
        return v.lower()

    # -- sections ----------------------------------------------------------------------------

    def cluster(self, default_name: str, default_block_tokens: int | None = None) -> ClusterSpec:
        data = self.doc.table()
        data.check_keys(_TOP_KEYS)
        name = self.text(data, "name", default_name) or default_name
        block_tokens = data.integer("block_tokens", default_block_tokens or DEFAULT_BLOCK_TOKENS,
                                    lo=1)
        router = self.router(data)
        gpus = self.user_gpus(data)
        nodes = self.nodes(data)
        engines = self.engines(data, gpus, nodes, block_tokens)
        mooncake = self.mooncake(data)
        nvme = self.nvme(data)
        self.placed_nodes(nodes, mooncake, nvme)
        connector = self.connector(data)
        pd_transfer = data.choice("pd_transfer", PD_TRANSFERS, "direct") or "direct"
        spec = ClusterSpec(name=name, block_tokens=block_tokens, router=router,
                           nodes=tuple(nodes.values()), engines=tuple(engines), gpus=gpus,
                           mooncake=mooncake, nvme=nvme, source=self.doc.source,
                           connector=connector, pd_transfer=pd_transfer)
        if pd_transfer == "store" and spec.pd and not (
                mooncake or nvme or any(n.dram is not None for n in spec.nodes)):
            raise self.fail("P/D through the store needs a tier below the GPUs ([mooncake], "
                            "[nvme] or a node's dram)", ("pd_transfer",))
        self.check_bytes_capacities(spec)
        return spec

    def router(self, data: ConfigTable) -> RouterSpec:
        v = data.data.get("router", DEFAULT_ROUTER)
        params: dict[str, Any] = {}
        path: Path_ = ("router",)
        if isinstance(v, dict):
            t = ConfigTable(self.doc, v, path)
            t.require("name")
            params = {k: x for k, x in v.items() if k != "name"}
            name = self.text(t, "name")
            path = (*path, "name")
        elif isinstance(v, str):
            name = v
        else:
            raise self.fail(f"expected a router name or a [router] table, got {show_value(v)}",
                            path)
        assert name is not None
        key = name.strip().lower()
        if key not in ROUTERS:
            raise self.fail(f"unknown router {name!r} (known: {', '.join(ROUTERS)})", path)
        # Parameters are checked by the router itself, so that the file and the library agree.
        try:
            make_router(key, **params)
        except UsageError as exc:
            where: Path_ = ("router", exc.field) if exc.field in params else ("router",)
            raise self.fail(exc.message, where) from None
        return RouterSpec(key, params)

    def user_gpus(self, data: ConfigTable) -> dict[str, GPU]:
        v = data.data.get("gpu")
        if v is None:
            return {}
        items: list[tuple[Path_, Any]]
        if isinstance(v, dict):  # [gpu.NAME] tables: the key is the name
            items = [(("gpu", k), t) for k, t in v.items()]
        elif isinstance(v, list):
            items = [(("gpu", i), t) for i, t in enumerate(v)]
        else:
            raise self.fail(f"expected [[gpu]] tables, got {show_value(v)}", ("gpu",))
        out: dict[str, GPU] = {}
        for path, t in items:
            if isinstance(path[-1], int) and isinstance(t, dict) and "name" not in t:
                raise self.fail("missing required key 'name'", (*path, "name"))
            gpu = gpu_from_table(t, (self.doc, path))
            if gpu.name.lower() in {g.lower() for g in out}:
                raise self.fail(f"GPU {gpu.name!r} is defined twice", (*path, "name"))
            out[gpu.name] = gpu
        return out

    def nodes(self, data: ConfigTable) -> dict[str, NodeSpec]:
        out: dict[str, NodeSpec] = {}
        for t in data.tables("node"):
            t.check_keys(_NODE_KEYS)
            path = t.path
            t.require("name")
            name = self.name(t, "name")
            assert name is not None
            if name in out:
                raise self.fail(f"node {name!r} is defined twice", (*path, "name"))
            storage = t.flag("storage")
            if t.has("dram_policy") and not t.has("dram"):
                raise self.fail("dram_policy without dram (the node's DRAM tier capacity)",
                                (*path, "dram_policy"))
            out[name] = NodeSpec(
                name=name, nic_gbps=self.gbps(t, "nic_gbps"),
                dram=self.capacity(t, "dram"), dram_policy=self.policy(t, "dram_policy"),
                pcie_gbps=self.gbps(t, "pcie_gbps") if t.has("pcie_gbps") else None,
                gpus=t.integer("gpus", lo=1), storage=storage, address=self.address(t))
        return out

    def address(self, t: ConfigTable) -> str | None:
        """A node's ``address``: one IPv4 address a service can listen on."""
        path = t.path
        text = self.text(t, "address")
        if text is None:
            return None
        try:
            ip = ipaddress.ip_address(text)
        except ValueError:
            raise self.fail(f"expected an IPv4 address such as '192.168.1.10', got "
                            f"{text!r}", (*path, "address")) from None
        if not isinstance(ip, ipaddress.IPv4Address) or ip.is_unspecified \
                or ip.is_multicast:
            raise self.fail(f"expected one host's IPv4 address, got {text!r}",
                            (*path, "address"))
        return str(ip)

    def engines(self, data: ConfigTable, gpus: Mapping[str, GPU],
                nodes: dict[str, NodeSpec], block_tokens: int) -> list[EngineSpec]:
        tables = data.tables("engine")
        if not tables:
            raise self.fail("a cluster needs at least one [[engine]] table "
                            "(gpu, model, tp)", ("engine",))
        out: list[EngineSpec] = []
        names: set[str] = set()
        explicit_nodes = set(nodes)
        used_gpus: dict[str, int] = {}
        groups: dict[str, tuple[str, int]] = {}  # share_gpus group → (node, TP)
        first: tuple[EngineSpec, Path_] | None = None
        for t in tables:
            t.check_keys(_ENGINE_KEYS)
            path = t.path
            t.require("gpu")
            t.require("model")
            gpu_name = self.text(t, "gpu")
            assert gpu_name is not None
            try:
                gpu = resolve_gpu(gpu_name, gpus)
            except UsageError as exc:
                raise self.fail(exc.message, (*path, "gpu")) from None
            model = self.model(t, path)
            tp = t.integer("tp", 1, lo=1)
            count = t.integer("count", 1, lo=1)
            assert tp is not None and count is not None
            dtype = self.weight_dtype(t, path, model)
            kv_dtype = self.kv_dtype(t, path, model, dtype)
            role = self.role(t, path)
            max_seqs, max_tokens = self.batch_limits(t, gpu)
            if t.has("num_gpu_blocks") and t.has("gpu_memory_utilization"):
                raise self.fail("give num_gpu_blocks or gpu_memory_utilization, not both",
                                (*path, "gpu_memory_utilization"))
            util = self.utilization(t, path)
            caching = self.prefix_caching(t, path)
            step = self.step_model(model, gpu, tp, dtype, kv_dtype, block_tokens, path)
            blocks, basis = self.gpu_blocks(t, path, step, block_tokens, util)
            if self.step_time(t, path) == "dynamo-mocker":
                from kvtool.serving.mockerstep import MockerStepModel

                step = MockerStepModel(model, gpu, tp, weight_dtype=dtype, kv_dtype=kv_dtype,
                                       block_tokens=block_tokens,
                                       total_kv_tokens=blocks * block_tokens)
            geometry = model.geometry(dtype=kv_dtype, block_tokens=block_tokens, tp=tp)
            node_name = self.name(t, "node")
            if node_name is not None and node_name not in explicit_nodes:
                known = ", ".join(sorted(explicit_nodes)) or "none: add [[node]] tables"
                raise self.fail(f"unknown node {node_name!r} (defined: {known})", (*path, "node"))
            share = self.name(t, "share_gpus")
            base = self.name(t, "name")
            for r in range(count):
                index = len(out)
                name = base if base is not None and count == 1 else \
                    f"{base}-{r}" if base is not None else f"engine{index}"
                if name in names:
                    raise self.fail(f"engine name {name!r} is used twice",
                                    (*path, "name" if base is not None else "count"))
                names.add(name)
                node = self.engine_node(path, name, node_name, share, tp, nodes, groups,
                                        used_gpus)
                node_spec = nodes[node]
                pcie = node_spec.pcie_gbps if node_spec.pcie_gbps is not None else gpu.pcie_gbps
                engine = EngineSpec(
                    index=index, name=name, node=node, gpu=gpu, model=model, tp=tp,
                    dtype=step.weight_dtype, kv_dtype=geometry.dtype, role=role,
                    max_num_seqs=max_seqs, max_num_batched_tokens=max_tokens,
                    num_gpu_blocks=blocks, num_gpu_blocks_basis=basis,
                    gpu_memory_utilization=util, pcie_gbps=pcie,
                    block_bytes=geometry.block_bytes,
                    all_ranks_block_bytes=geometry.all_ranks_block_bytes, step=step,
                    enable_prefix_caching=caching, share_gpus=share)
                if first is None:
                    first = (engine, path)
                else:
                    self.check_same_kv(first[0], engine, path)
                out.append(engine)
        self.check_engine_set(out, explicit_nodes, nodes)
        return out

    def role(self, t: ConfigTable, path: Path_) -> str:
        """An engine's ``role``: one of ``ROLES`` (prefill, decode or both)."""
        role = (self.text(t, "role", "both") or "both").lower()
        if role not in ROLES:
            raise self.fail(f"expected one of {', '.join(ROLES)}, got {t.data['role']!r}",
                            (*path, "role"))
        return role

    def batch_limits(self, t: ConfigTable, gpu: GPU) -> tuple[int, int]:
        """An engine's ``max_num_seqs`` and ``max_num_batched_tokens`` (vLLM's defaults for
        the GPU where the table gives none)."""
        d_tokens, d_seqs = vllm_batch_defaults(gpu)
        max_seqs = t.integer("max_num_seqs", d_seqs, lo=1)
        max_tokens = t.integer("max_num_batched_tokens", d_tokens, lo=1)
        assert max_seqs is not None and max_tokens is not None
        return max_seqs, max_tokens

    def prefix_caching(self, t: ConfigTable, path: Path_) -> bool:
        """An engine's ``enable_prefix_caching`` (default true)."""
        caching = t.data.get("enable_prefix_caching", True)
        if not isinstance(caching, bool):
            raise self.fail(f"expected true or false, got {show_value(caching)}",
                            (*path, "enable_prefix_caching"))
        return caching

    def gpu_blocks(self, t: ConfigTable, path: Path_, step: StepModel, block_tokens: int,
                   util: float) -> tuple[int, str]:
        """An engine's KV pool in blocks and where the number comes from: ``num_gpu_blocks``
        as given, else modelled from the GPU's memory at ``util``."""
        blocks = t.integer("num_gpu_blocks", None, lo=2)
        if blocks is not None:
            return blocks, "given"
        try:
            return step.kv_pool_blocks(block_tokens, util), "modelled"
        except UsageError as exc:
            raise self.fail(exc.message, (*path, "tp")) from None

    def step_time(self, t: ConfigTable, path: Path_) -> str:
        """An engine's ``step_time``: which model times its steps (one of ``STEP_TIMES``)."""
        timing = (self.text(t, "step_time", "roofline") or "roofline").lower()
        if timing not in STEP_TIMES:
            raise self.fail(f"expected one of {', '.join(STEP_TIMES)}, got "
                            f"{t.data['step_time']!r}", (*path, "step_time"))
        return timing

    def engine_node(self, path: Path_, name: str, node_name: str | None, share: str | None,
                    tp: int, nodes: dict[str, NodeSpec], groups: dict[str, tuple[str, int]],
                    used_gpus: dict[str, int]) -> str:
        """The node engine ``name`` runs on (its own automatic node when the table names
        none), its GPUs counted on that node once per ``share_gpus`` group."""
        node = node_name
        if node is None:
            node = f"node-{name}"
            if node in nodes:
                raise self.fail(f"the automatic node name {node!r} is taken; give "
                                "this engine a node", path)
            nodes[node] = NodeSpec(node, auto=True)
        node_spec = nodes[node]
        if share is not None and share in groups:
            g_node, g_tp = groups[share]
            if (g_node, g_tp) != (node, tp):
                raise self.fail(f"engines sharing GPUs ({share!r}) run on one node with "
                                f"one TP size: {g_node!r} TP {g_tp} here, {node!r} TP "
                                f"{tp}", (*path, "share_gpus"))
        else:
            if share is not None:
                groups[share] = (node, tp)
            used_gpus[node] = used_gpus.get(node, 0) + tp
        if node_spec.gpus is not None and used_gpus[node] > node_spec.gpus:
            raise self.fail(f"node {node!r} has {node_spec.gpus} GPUs; its engines' TP "
                            f"sizes add up to {used_gpus[node]}", (*path, "tp"))
        return node

    def check_engine_set(self, engines: list[EngineSpec], explicit_nodes: set[str],
                         nodes: dict[str, NodeSpec]) -> None:
        """Checks on all the engines together: every ``[[node]]`` without storage runs an
        engine, and a prefill/decode split has both roles."""
        unused = [n for n in explicit_nodes
                  if not nodes[n].storage and not any(e.node == n for e in engines)]
        if unused:
            i = list(nodes).index(unused[0])
            raise self.fail(f"node {unused[0]!r} has no engine", ("node", i, "name"))
        roles = {e.role for e in engines}
        if roles & {"prefill", "decode"} and not {"prefill", "decode"} <= roles:
            missing = "decode" if "prefill" in roles else "prefill"
            raise self.fail(f"a prefill/decode split needs at least one {missing!r} engine "
                            f"(roles here: {', '.join(sorted(roles))})", ("engine",))

    def model(self, t: ConfigTable, path: Path_) -> ModelSpec:
        name = self.text(t, "model")
        assert name is not None
        try:
            if name.lower().endswith((".toml", ".json")):
                from kvtool.geometry.custom import from_toml
                p = Path(name)
                if not p.is_absolute() and self.base_dir is not None:
                    p = self.base_dir / p
                return from_toml(p)
            from kvtool.geometry.presets import lookup
            return lookup(name)
        except UsageError as exc:
            raise self.fail(exc.message, (*path, "model")) from None

    def weight_dtype(self, t: ConfigTable, path: Path_, model: ModelSpec) -> str:
        default = model.arch.weight_dtype if model.arch is not None else "bf16"
        v = self.text(t, "dtype", default) or default
        try:
            return canonical_weight_dtype(v, field="dtype")
        except UsageError as exc:
            raise self.fail(exc.message, (*path, "dtype")) from None

    def kv_dtype(self, t: ConfigTable, path: Path_, model: ModelSpec, dtype: str) -> str:
        if t.has("kv_dtype"):
            v = self.text(t, "kv_dtype")
            assert v is not None
            try:
                return canonical_dtype(v, field="kv_dtype")
            except UsageError as exc:
                raise self.fail(exc.message, (*path, "kv_dtype")) from None
        # vLLM's kv_cache_dtype "auto" is the activations' dtype: the weights' when they are
        # a float type, else (quantised checkpoints) the model's own default.
        return model.default_dtype if dtype in _QUANTISED else canonical_dtype(dtype)

    def utilization(self, t: ConfigTable, path: Path_) -> float:
        v = t.data.get("gpu_memory_utilization", DEFAULT_GPU_MEMORY_UTILIZATION)
        if isinstance(v, bool) or not isinstance(v, int | float) or not 0 < v <= 1:
            raise self.fail(f"expected a fraction in (0, 1], got {show_value(v)}",
                            (*path, "gpu_memory_utilization"))
        return float(v)

    def step_model(self, model: ModelSpec, gpu: GPU, tp: int, dtype: str, kv_dtype: str,
                   block_tokens: int, path: Path_) -> StepModel:
        try:
            return StepModel(model, gpu, tp, weight_dtype=dtype, kv_dtype=kv_dtype,
                             block_tokens=block_tokens)
        except UsageError as exc:
            key = {"weight_dtype": "dtype", "dtype": "kv_dtype"}.get(exc.field or "", exc.field)
            if key == "block_tokens":
                raise self.fail(exc.message, ("block_tokens",)) from None
            if key not in _ENGINE_KEYS:
                key = "model"
            raise self.fail(exc.message, (*path, key)) from None

    def check_same_kv(self, a: EngineSpec, b: EngineSpec, path: Path_) -> None:
        if a.model.name != b.model.name:
            raise self.fail(f"every engine must run the same model (KV blocks move between "
                            f"engines and tiers): {a.name} runs {a.model.name}, this one "
                            f"{b.model.name}", (*path, "model"))
        if a.kv_dtype != b.kv_dtype:
            raise self.fail(f"every engine must use the same KV dtype: {a.name} uses "
                            f"{a.kv_dtype}, this one {b.kv_dtype}", (*path, "kv_dtype"))

    def connector(self, data: ConfigTable) -> ConnectorSpec | None:
        t = data.table("connector")
        if t is None:
            return None
        t.check_keys(_CONNECTOR_KEYS)
        path = t.path
        d = ConnectorSpec()

        def ms(key: str, default: float) -> float:
            if not t.has(key):
                return default
            v = t.data[key]
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) \
                    or v < 0:
                raise self.fail(f"expected milliseconds >= 0, got {show_value(v)}", (*path, key))
            return float(v)

        chunk = t.integer("chunk_tokens", d.chunk_tokens, lo=1)
        assert chunk is not None
        load = (self.text(t, "load", d.load) or d.load).lower()
        if load not in CONNECTOR_LOADS:
            raise self.fail(f"expected one of {', '.join(CONNECTOR_LOADS)}, got {t.data['load']!r}",
                            (*path, "load"))
        return ConnectorSpec(name=self.text(t, "name", d.name) or d.name,
                             lookup_ms=ms("lookup_ms", d.lookup_ms), chunk_tokens=chunk,
                             chunk_ms=ms("chunk_ms", d.chunk_ms),
                             gbps=self.gbps(t, "gbps", d.gbps),
                             source=self.text(t, "source", d.source) or d.source,
                             load=load)

    def mooncake(self, data: ConfigTable) -> PoolSpec | None:
        t = data.table("mooncake")
        if t is None:
            return None
        t.check_keys(_MOONCAKE_KEYS)
        cap = self.capacity(t, "capacity", required=True)
        assert cap is not None
        return PoolSpec(cap, self.policy(t, "policy"), self.gbps(t, "gbps"),
                        master=self.name(t, "master"),
                        segment=self.size(t, "segment", DEFAULT_SEGMENT_BYTES))

    def nvme(self, data: ConfigTable) -> NvmeSpec | None:
        t = data.table("nvme")
        if t is None:
            return None
        t.check_keys(_NVME_KEYS)
        path = t.path
        cap = self.capacity(t, "capacity", required=True)
        assert cap is not None
        targets: list[TargetSpec] = []
        for tt in t.tables("target"):
            tt.check_keys(_TARGET_KEYS)
            tpath = tt.path
            name = self.name(tt, "name", f"t{len(targets)}")
            assert name is not None
            if any(x.name == name for x in targets):
                raise self.fail(f"target {name!r} is defined twice", (*tpath, "name"))
            if tt.has("config") and tt.has("size"):
                raise self.fail("give size or config, not both (the config's namespaces "
                                "have their sizes)", (*tpath, "size"))
            targets.append(TargetSpec(name, self.gbps(tt, "read_gbps"),
                                      self.gbps(tt, "write_gbps"),
                                      node=self.name(tt, "node"),
                                      size=self.size(tt, "size", DEFAULT_TARGET_BYTES),
                                      config=self.target_config(tt, tpath)))
        if not targets:
            raise self.fail("the NVMe-oF pool needs at least one [[nvme.target]] "
                            "(name, read_gbps, write_gbps)", path)
        return NvmeSpec(cap, tuple(targets), self.policy(t, "policy"))

    def target_config(self, t: ConfigTable, path: Path_) -> str | None:
        """A target's ``config`` file, resolved; checked by :attr:`target_check` when one
        is given (the target config's own errors name its own file and line)."""
        text = self.text(t, "config")
        if text is None:
            return None
        p = Path(text)
        if not p.is_absolute() and self.base_dir is not None:
            p = self.base_dir / p
        if not p.is_file():
            raise self.fail(f"no such target config: {p}", (*path, "config"))
        why = None if self.target_check is None else self.target_check(p)
        if why is not None:
            raise self.fail(why, (*path, "config"))
        return str(p.resolve())

    def check_bytes_capacities(self, spec: ClusterSpec) -> None:
        sizes = {e.block_bytes for e in spec.engines}
        if len(sizes) == 1:
            return
        paths: list[tuple[Capacity | None, Path_]] = [
            (n.dram, ("node", i, "dram")) for i, n in enumerate(spec.nodes) if not n.auto]
        if spec.mooncake is not None:
            paths.append((spec.mooncake.capacity, ("mooncake", "capacity")))
        if spec.nvme is not None:
            paths.append((spec.nvme.capacity, ("nvme", "capacity")))
        for cap, path in paths:
            if cap is not None and cap.unit == "bytes":
                raise self.fail("the engines' TP sizes give different block sizes "
                                f"({', '.join(str(s) for s in sorted(sizes))} B per rank), so "
                                "a capacity in bytes is ambiguous: give it in blocks (\"…blk\")",
                                path)

    def placed_nodes(self, nodes: dict[str, NodeSpec], mooncake: PoolSpec | None,
                     nvme: NvmeSpec | None) -> None:
        """The Mooncake ``master`` and each target's ``node`` name a node (a target's, a
        storage node). Where they run is the deployment's (:mod:`kvtool.cluster.placement`
        reads ``[placement]``)."""
        node_names = list(nodes)
        if mooncake is not None and mooncake.master is not None \
                and mooncake.master not in nodes:
            raise self.fail(f"unknown node {mooncake.master!r} (defined: "
                            f"{', '.join(node_names)})", ("mooncake", "master"))
        for i, target in enumerate(nvme.targets if nvme is not None else ()):
            where: Path_ = ("nvme", "target", i, "node")
            if target.node is None:
                continue
            if target.node not in nodes:
                raise self.fail(f"unknown node {target.node!r} (defined: "
                                f"{', '.join(node_names)})", where)
            if not nodes[target.node].storage:
                raise self.fail(f"node {target.node!r} is not a storage node (give it "
                                "storage = true)", where)
