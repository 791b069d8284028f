"""The serving model's event loop: arrivals → router → engines → tiers below → report.

:func:`simulate` replays a list of requests on a cluster (:class:`ClusterSpec`) under one
:class:`Load` and returns the report document (schema: docs/serving.md). Everything in it
is **simulated**: the clock advances by roofline step times (:mod:`kvtool.serving.roofline`)
and by flows over links (:mod:`kvtool.serving.links`); nothing is timed on this machine.

The loop keeps one heap of events (request arrivals, the end of an engine's steps) and asks
the flow network for its next completion; whichever is earlier happens next. An engine
reports its next event itself (:meth:`Engine.plan`: the end of the steps it planned, one
step or a run of identical decode steps, see :mod:`kvtool.serving.engine`), so the clock
jumps from event to event. Simultaneous events go in one fixed order, whichever way
engines advance time: flow completions first, then arrivals released before that time
(a trace's timestamps, Poisson arrivals, the first users), then engines' step ends by
engine index, then arrivals released at that time (by a request that finished then, in
release order). An outside event that reaches a busy engine (an arrival routed to it, a
load that arrived) calls :meth:`Engine.cut` with its place in that order. One that reaches
an idle engine lets it plan once the arrivals of its part of that order have come (after
the early arrivals when a flow or an early arrival woke it, else after the released
ones): requests arriving together are scheduled in one step.

The tiers below the GPU (:class:`TierStack`) are block metadata with the eviction policies
of :mod:`kvtool.cache` (a node's DRAM, a cluster-wide Mooncake pool, an NVMe-oF pool over
its targets): one :class:`~kvtool.cache.hierarchy.TierHierarchy` per node
(:class:`Below`), which decides and counts every hit, read, insert and eviction through
its timed protocol, while this module times them. A block is found in the highest tier
that holds it; a request loads the hit prefix beyond its GPU hit when loading is faster
than recomputing (each cut at a tier boundary is weighed: bytes over the path's bottleneck
bandwidth against the roofline prefill time of those tokens), else recomputes and the
declined tokens are counted. Loads are flows GPU ← PCIe ← (NIC ← Mooncake transfer path |
NIC ← target), a request's prefill waits for all of them. Every full block a request
computed is stored, write-through, into every tier below when it finishes (flows the other
way); a block enters a tier when its flow has arrived. Stores never stall compute; they
share links with loads, which is how a full link slows prefill.
"""

from __future__ import annotations

import collections
import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Final, Protocol

from kvtool.cache.hierarchy import TierHierarchy
from kvtool.cache.policies import make_policy
from kvtool.cache.stats import RoundStats
from kvtool.cache.tier import Tier, TimedMover
from kvtool.serving.engine import FAILED, FINISHED, LOADING, Engine, Seq, make_engine
from kvtool.serving.kvpool import KVPool
from kvtool.serving.lanes import Lanes, use_lanes
from kvtool.serving.links import FlowNetwork
from kvtool.serving.load import Arrivals, ArrivalSource, Load, output_block_keys
from kvtool.serving.report import describe, serving_metrics
from kvtool.serving.router import Router

# event kinds (one Final name each: compiled, a Final int is a constant)
ARRIVAL: Final = 0
STEP: Final = 1
PLAN: Final = 2
TIMER: Final = 3
# the order of simultaneous events (module docstring)
_EARLY: Final = 0
_PLAN_EARLY: Final = 1
_STEPS: Final = 2
_RELEASED: Final = 3
_PLAN_LATE: Final = 4


@dataclass
class EngineSetup:
    """What the loop needs of one engine (built from the cluster file)."""

    name: str
    node: str
    role: str
    num_gpu_blocks: int
    block_bytes: int
    """KV bytes of one block over all the engine's ranks (what a load or store moves)."""
    pcie_gbps: float
    step: Any
    max_num_seqs: int
    max_num_batched_tokens: int
    describe: dict[str, Any]
    enable_caching: bool = True
    """vLLM's ``enable_prefix_caching``."""
    share_gpus: str | None = None
    """Engines of one group time-share their GPUs: one steps at a time, in turn."""


@dataclass
class TierSetup:
    name: str
    """``dram`` (per node), ``mooncake`` or ``nvme``."""
    capacity_blocks: float
    policy: str
    node: str | None = None
    gbps: float = math.inf
    targets: tuple[tuple[str, float, float], ...] = ()
    """``nvme``: (name, read GB/s, write GB/s) of each target."""


@dataclass
class ClusterSetup:
    """A cluster as the loop sees it: engines, tiers, links, router."""

    engines: list[EngineSetup]
    nodes: dict[str, float]
    """Node name → NIC GB/s per direction (``inf``: unlimited)."""
    tiers: list[TierSetup]
    router: str
    router_params: dict[str, Any]
    name: str = ""
    connector: Any = None
    """The KV connector's costs (:class:`kvtool.serving.topology.ConnectorSpec`), or None."""
    pd_transfer: str = "direct"
    """P/D split: ``direct`` (engine to engine) or ``store`` (through the tiers below)."""


class DataBackend(Protocol):
    """Moves the bytes behind the tiers' metadata, called in simulated-time order (data
    mode): ``tier`` is ``dram``, ``mooncake`` or ``nvme``; ``node`` names the node of a
    ``dram`` tier (else ``None``); ``engine`` the engine whose GPU pool the bytes leave
    or reach."""

    def on_store(self, tier: str, node: str | None, keys: list[int], engine: int) -> None: ...
    def on_load(self, tier: str, node: str | None, keys: list[int], engine: int
                ) -> list[int]:
        """Read and check ``keys``; return those that failed the check (corrupt or lost)."""
    def on_evict(self, tier: str, node: str | None, keys: list[int]) -> None: ...


class Below:
    """The tiers below one node's engines, highest first: the node's DRAM (when it has
    some), then the shared tiers, as one :class:`~kvtool.cache.hierarchy.TierHierarchy`
    (every node's holds the same shared :class:`Tier` objects), with what it counted."""

    __slots__ = ("dram", "hier", "names", "specs", "stats")

    def __init__(self, tiers: list[tuple[str, Tier, TierSetup | None]],
                 stale: set[tuple[str, int]], mover: TimedMover | None) -> None:
        self.hier = TierHierarchy([t for _n, t, _s in tiers], pooled=False, timed_mover=mover,
                                  stale=stale)
        self.names = [n for n, _t, _s in tiers]
        self.specs = [s for _n, _t, s in tiers]
        self.stats = RoundStats(len(tiers))
        self.dram = 0 if self.names[0] == "dram" else -1
        """The index of the node's DRAM tier (-1: none)."""


class NodeMover:
    """A :class:`DataBackend` as the timed mover of one node's hierarchy (its ``dram`` tier
    is that node's)."""

    __slots__ = ("backend", "node")

    def __init__(self, backend: DataBackend, node: str) -> None:
        self.backend = backend
        self.node = node

    def on_store(self, tier: str, keys: list[int], by: int) -> None:
        self.backend.on_store(tier, self.node if tier == "dram" else None, keys, by)

    def on_load(self, tier: str, keys: list[int], by: int) -> list[int]:
        return self.backend.on_load(tier, self.node if tier == "dram" else None, keys, by)

    def on_evict(self, tier: str, keys: list[int]) -> None:
        self.backend.on_evict(tier, self.node if tier == "dram" else None, keys)


class TierStack:
    """The tiers below the engines' GPU pools (module docstring); implements the engine's
    :class:`~kvtool.serving.engine.Offload`. Their metadata is a tier hierarchy per node
    (:class:`Below`), driven by its timed protocol: it decides every hit, read, insert and
    eviction and counts them; this class times them as flows. With a
    :class:`DataBackend` (data mode), each hierarchy's mover (:class:`NodeMover`) moves
    real bytes as it loads, inserts and evicts, at the simulated time it happens."""

    serve_order = False
    """The tiers' own metadata decides hits (:class:`kvtool.serving.serveorder.ServeOrderStack`:
    the tier hierarchy, in serve order)."""

    def __init__(self, sim: Simulation, setup: ClusterSetup, block_tokens: int,
                 backend: DataBackend | None = None) -> None:
        self.sim = sim
        self.backend = backend
        self.B = block_tokens
        self.net: FlowNetwork | Lanes = sim.net
        """Where the loads and stores flow: the sim's network, or :class:`Lanes` over it
        when every path is one hop that no other path crosses (:func:`use_lanes`)."""
        self.node_dram: dict[str, Tier] = {}
        self.shared: list[tuple[str, Tier, TierSetup]] = []
        for t in setup.tiers:
            if not t.capacity_blocks > 0:
                continue
            tier = Tier(t.name, t.capacity_blocks, make_policy(t.policy))
            if t.name == "dram":
                assert t.node is not None
                self.node_dram[t.node] = tier
            else:
                self.shared.append((t.name, tier, t))
        self.bytes_loaded: dict[str, int] = {}
        self.bytes_stored: dict[str, int] = {}
        self.blocks_stored: dict[str, int] = {}
        self.stale: set[tuple[str, int]] = set()
        """Data mode: (tier, key) whose copy failed its check; a miss until rewritten (every
        node's hierarchy holds this set)."""
        self.recomputed_after_check = 0
        self.promoting = False
        """Whether a load found blocks to promote into a node's DRAM."""
        self.load_decisions = {"load": 0, "recompute": 0}
        self.pd_bytes = 0
        self.connector = setup.connector
        self.pd_direct = setup.pd_transfer == "direct"
        """P/D split: the decode engine pulls the prompt from the prefill engine (else it
        loads it from the tiers below, where the prefill engine stored it)."""
        self.connector_s = 0.0
        """Seconds loads waited on the connector's lookups and chunks (summed)."""
        self.below: dict[str, Below] = {}
        """Each node's tiers below (made when one of its engines first needs them)."""
        # what depends only on the engine (the tiers, their paths and rates), made once
        self._below_of: dict[int, Below | None] = {}
        self._paths: dict[tuple[int, str, str | None, bool], list[tuple[str, str]]] = {}
        self._rates: dict[tuple[int, str], float] = {}

    @property
    def present(self) -> bool:
        return bool(self.node_dram or self.shared)

    def _tiers_for(self, engine: Engine) -> Below | None:
        """The tiers below ``engine``: its node's DRAM, then the shared ones (None: none)."""
        if engine.index in self._below_of:
            return self._below_of[engine.index]
        below = self.below.get(engine.node)
        if below is None:
            tiers: list[tuple[str, Tier, TierSetup | None]] = []
            d = self.node_dram.get(engine.node)
            if d is not None:
                tiers.append(("dram", d, None))
            tiers.extend(self.shared)
            if tiers:
                mover = None if self.backend is None else NodeMover(self.backend, engine.node)
                below = self.below[engine.node] = Below(tiers, self.stale, mover)
        self._below_of[engine.index] = below
        return below

    def _path(self, engine: Engine, tier: str, spec: TierSetup | None, target: str | None,
              load: bool) -> list[tuple[str, str]]:
        key = (engine.index, tier, target, load)
        path = self._paths.get(key)
        if path is None:
            path = self._paths[key] = self._make_path(engine, tier, target, load)
        return path

    def _make_path(self, engine: Engine, tier: str, target: str | None, load: bool
                   ) -> list[tuple[str, str]]:
        into_gpu, out_gpu = "down", "up"
        pcie = (f"pcie/{engine.name}", into_gpu if load else out_gpu)
        hops = [pcie]
        if self.connector is not None and math.isfinite(self.connector.gbps):
            hops.append((f"connector/{engine.name}", into_gpu if load else out_gpu))
        if tier == "dram":
            return hops
        nic = (f"nic/{engine.node}", "down" if load else "up")
        if tier == "mooncake":
            return [("mooncake", "up" if load else "down"), nic, *hops]
        assert target is not None
        return [(f"target/{target}", "up" if load else "down"), nic, *hops]

    def _bottleneck(self, path: list[tuple[str, str]]) -> float:
        caps = self.sim.caps
        return min(caps[hop] for hop in path)

    # ---------------------------------------------------------------- Offload protocol
    def host_prefix_blocks(self, engine: Engine, keys: Sequence[int]) -> int:
        below = self._tiers_for(engine)
        if below is None or below.dram < 0:
            return 0
        return below.hier.held_prefix(below.dram, keys)

    def plan_load(self, engine: Engine, seq: Seq, start_tokens: int, limit_tokens: int
                  ) -> tuple[int, int]:
        B = self.B
        first = start_tokens // B
        last = limit_tokens // B
        if last <= first:
            return 0, 0
        below = self._tiers_for(engine)
        if below is None:
            return 0, 0
        src = below.hier.find(seq.block_hashes[first:last])
        found = len(src)
        if not found:
            return 0, 0
        if seq.decode_only or (self.connector is not None and self.connector.load == "always"):
            # P/D through the store: the decode engine reads what the prefill engine wrote;
            # a vLLM connector loads every token it reports found
            return found * B, 0
        bb = self.sim.setups[engine.index].block_bytes
        step = self.sim.setups[engine.index].step
        best_blocks = 0
        best_gain = 0.0
        blocks = 0
        load_s = 0.0
        fixed = self.connector.load_s if self.connector is not None else None
        for ti, c in _runs(src):
            blocks += c
            load_s += c * bb / (self._tier_rate(engine, below.names[ti], below.specs[ti]) * 1e9)
            extra = fixed(blocks * B) if fixed is not None else 0.0
            gain = step.prefill_time(blocks * B, start_tokens) - load_s - extra
            if gain > best_gain:
                best_gain, best_blocks = gain, blocks
        return best_blocks * B, (found - best_blocks) * B

    def note_decision(self, load: bool) -> None:
        self.load_decisions["load" if load else "recompute"] += 1

    def _tier_rate(self, engine: Engine, name: str, spec: TierSetup | None) -> float:
        """Uncontended GB/s of a load from tier ``name`` (the path's bottleneck)."""
        key = (engine.index, name)
        rate = self._rates.get(key)
        if rate is None:
            rate = self._rates[key] = self._make_rate(engine, name, spec)
        return rate

    def _make_rate(self, engine: Engine, name: str, spec: TierSetup | None) -> float:
        if name == "nvme":
            assert spec is not None
            total = sum(r for _t, r, _w in spec.targets)
            return min(total, self._bottleneck(self._path(engine, "dram", None, None, True)),
                       self.sim.caps[(f"nic/{engine.node}", "down")])
        return self._bottleneck(self._path(engine, name, spec, None, True))

    def start_load(self, engine: Engine, seq: Seq, start_tokens: int, tokens: int,
                   now: float) -> None:
        B = self.B
        if seq.decode_only and self.pd_direct:
            self._start_pd(engine, seq, tokens, now)
            return
        below = self._tiers_for(engine)
        keys = seq.block_hashes[start_tokens // B: (start_tokens + tokens) // B]
        bb = self.sim.setups[engine.index].block_bytes
        per_flow: dict[tuple[int, str | None], list[int]] = {}
        by_tier: dict[str, int] = {}
        if below is None:
            pass
        elif len(below.names) == 1 and not self.stale and (below.specs[0] is None
                                                           or not below.specs[0].targets):
            # one tier, one flow: the keys it holds
            name, spec1 = below.names[0], below.specs[0]
            held = below.hier.held(0, keys)
            if self.backend is None and name == "dram":
                # the loop below for that one flow (no check can fail, nothing to promote)
                if not seq.decode_only:
                    seq.ext_by_tier = {name: len(held) * B} if held else {}
                if not held:
                    seq.loads_pending = 0
                    return
                below.hier.read(0, held, seq.index, below.stats)
                seq.loads_pending = 1
                nbytes = len(held) * bb
                self.bytes_loaded[name] = self.bytes_loaded.get(name, 0) + nbytes
                self.net.start(now, nbytes, self._path(engine, name, spec1, None, True),
                               self._load_done(engine, seq, tokens))
                return
            if held:
                per_flow[(0, None)] = held
                by_tier[name] = len(held)
        else:
            self._group_loads(below, keys, per_flow, by_tier)
        if not seq.decode_only:  # (a decode engine's read of a P/D prompt is no hit)
            seq.ext_by_tier = {n: c * B for n, c in by_tier.items()}
        seq.loads_pending = len(per_flow)
        if below is None:
            return
        # the hierarchy reads what was hit (and refreshes it, as a store's lookup does)
        for ti in range(len(below.names)):
            hit = [k for (t, _target), ks in per_flow.items() if t == ti for k in ks]
            if hit:
                below.hier.read(ti, hit, seq.index, below.stats)
        promote: list[int] = []
        failed: set[int] = set()
        for (ti, target), ks in per_flow.items():
            name = below.names[ti]
            failed.update(below.hier.load(ti, ks, engine.index))
            nbytes = len(ks) * bb
            self.bytes_loaded[name] = self.bytes_loaded.get(name, 0) + nbytes
            if name != "dram":
                promote.extend(ks)
            path = self._path(engine, name, below.specs[ti], target, True)
            self.net.start(now, nbytes, path, self._load_done(engine, seq, tokens))
        if failed:
            self._cut_load(seq, keys, failed, start_tokens, tokens)
            promote = [k for k in promote if k not in failed]
        if promote and below.dram >= 0:
            rec = below.hier.put(below.dram, promote, seq.index, below.stats, by=engine.index,
                                 kept=True)
            below.stats.promoted_blocks[below.dram] += len(rec)
            self.promoting = True

    def _group_loads(self, below: Below, keys: Sequence[int],
                     per_flow: dict[tuple[int, str | None], list[int]],
                     by_tier: dict[str, int]) -> None:
        """Each key to the first tier holding a good copy: into ``per_flow`` by tier and
        target, counted in ``by_tier``."""
        names, specs = below.names, below.specs
        for key, ti in zip(keys, below.hier.locate(keys), strict=True):
            if ti < 0:
                continue
            spec = specs[ti]
            target = None
            if spec is not None and spec.targets:
                target = spec.targets[key % len(spec.targets)][0]
            per_flow.setdefault((ti, target), []).append(key)
            name = names[ti]
            by_tier[name] = by_tier.get(name, 0) + 1

    def _cut_load(self, seq: Seq, keys: Sequence[int], failed: set[int], start_tokens: int,
                  tokens: int) -> None:
        """Never serve a block that failed its check: the load ends before the first one,
        and the request computes the rest (vLLM's recompute on a failed load)."""
        B = self.B
        first_bad = next(i for i, k in enumerate(keys) if k in failed)
        kept = first_bad * B
        self.recomputed_after_check += (tokens - kept) // B
        seq.num_computed_tokens = start_tokens + kept
        seq.ext_tokens = kept

    def _load_done(self, engine: Engine, seq: Seq, tokens: int = 0
                   ) -> Callable[[float], None]:
        """The callback of a load's flows: after the last, the request holds its blocks —
        once the connector's lookup and chunks (``tokens`` loaded) have been paid too."""
        # one closure: compiled (mypyc), closures share their function's environment, and
        # one that called a sibling would hold it in a reference cycle
        def done(t: float) -> None:
            seq.loads_pending -= 1
            if seq.loads_pending:
                return
            extra = self.connector.load_s(tokens) if self.connector is not None else 0.0
            if extra > 0:
                self.connector_s += extra
                self.sim.at(t + extra, partial(self._arrived, engine, seq))
            else:
                self._arrived(engine, seq, t)
        return done

    def _arrived(self, engine: Engine, seq: Seq, t: float) -> None:
        if seq.status == LOADING:
            engine.loaded(seq)
            self.sim.wake(engine, t)

    def _start_pd(self, engine: Engine, seq: Seq, tokens: int, now: float) -> None:
        """P/D split: the decode engine pulls the prompt's KV from the prefill engine."""
        src = self.sim.engines[seq.pd_source]
        bb = self.sim.setups[engine.index].block_bytes
        nbytes = -(-tokens // self.B) * bb
        self.pd_bytes += nbytes
        path = [(f"pcie/{src.name}", "up")]
        if src.node != engine.node:
            path += [(f"nic/{src.node}", "up"), (f"nic/{engine.node}", "down")]
        path.append((f"pcie/{engine.name}", "down"))
        seq.loads_pending = 1
        self.net.start(now, nbytes, path, self._load_done(engine, seq))

    def store(self, engine: Engine, seq: Seq, now: float,
              stored: Callable[[float], None] | None = None) -> None:
        """Write the request's computed full blocks through to every tier below; call
        ``stored(t)`` when every one of them is there (at once when none was missing)."""
        B = self.B
        n = min(seq.num_computed_tokens // B, len(seq.block_hashes))
        pending = [0]
        one_done: Callable[[float], None] | None = None
        if stored is not None:  # (else nobody waits for the flows)
            def all_done(t: float) -> None:
                pending[0] -= 1
                if not pending[0] and stored is not None:
                    stored(t)
            one_done = all_done

        below = self._tiers_for(engine) if n > 0 else None
        if below is None:
            if stored is not None:
                stored(now)
            return
        keys = seq.block_hashes[:n]
        bb = self.sim.setups[engine.index].block_bytes
        hier = below.hier
        for i, name in enumerate(below.names):
            new = hier.lacks(i, keys)
            if not new:
                hier.touch(i, keys, seq.index)
                continue
            spec = below.specs[i]
            if spec is not None and spec.targets:
                groups: dict[str | None, list[int]] = {}
                for k in new:
                    groups.setdefault(spec.targets[k % len(spec.targets)][0], []).append(k)
            else:
                groups = {None: new}
            for target, ks in groups.items():
                nbytes = len(ks) * bb
                self.bytes_stored[name] = self.bytes_stored.get(name, 0) + nbytes
                self.blocks_stored[name] = self.blocks_stored.get(name, 0) + len(ks)
                path = self._path(engine, name, spec, target, False)
                pending[0] += 1
                self.net.start(now, nbytes, path,
                               self._store_done(below, i, ks, seq.index, engine, one_done))
        if not pending[0] and stored is not None:
            stored(now)

    def _store_done(self, below: Below, i: int, keys: list[int], session: int,
                    engine: Engine, then: Callable[[float], None] | None = None
                    ) -> Callable[[float], None]:
        def done(t: float) -> None:
            below.hier.put(i, keys, session, below.stats, by=engine.index)
            if then is not None:
                then(t)
        return done

    def counted(self) -> dict[str, dict[str, int]]:
        """What the hierarchies counted, summed per tier name over the nodes: blocks
        loaded (read), promoted into a node's DRAM, evicted (only tiers with some)."""
        loaded: dict[str, int] = {}
        evictions: dict[str, int] = {}
        promoted: dict[str, int] = {"dram": 0} if self.promoting else {}
        for below in self.below.values():
            st = below.stats
            for j, name in enumerate(below.names):
                for out, n in ((loaded, st.blocks_read[j]), (evictions, st.evictions[j])):
                    if n:
                        out[name] = out.get(name, 0) + n
                if st.promoted_blocks[j]:
                    promoted[name] = promoted.get(name, 0) + st.promoted_blocks[j]
        return {"blocks_loaded": loaded, "blocks_promoted": promoted, "evictions": evictions}

    def to_dict(self) -> dict[str, Any]:
        tiers = []
        for node, tier in self.node_dram.items():
            tiers.append({"name": "dram", "node": node, "capacity_blocks": _cap(tier.capacity),
                          "occupancy_blocks": len(tier)})
        for name, tier, _spec in self.shared:
            tiers.append({"name": name, "capacity_blocks": _cap(tier.capacity),
                          "occupancy_blocks": len(tier)})
        counted = self.counted()
        return {"tiers": tiers, "bytes_loaded": dict(self.bytes_loaded),
                "bytes_stored": dict(self.bytes_stored),
                "blocks_loaded": counted["blocks_loaded"],
                "blocks_stored": dict(self.blocks_stored),
                "blocks_promoted": counted["blocks_promoted"],
                "evictions": counted["evictions"],
                "load_or_recompute": dict(self.load_decisions), "pd_transfer_bytes": self.pd_bytes,
                "connector_wait_s": self.connector_s,
                "recomputed_after_check_blocks": self.recomputed_after_check,
                "repaired_blocks": sum(b.hier.repaired for b in self.below.values())}


def _runs(src: list[int]) -> list[tuple[int, int]]:
    """A lookup as runs: (tier index, consecutive blocks found there), head first."""
    runs: list[tuple[int, int]] = []
    cur = src[0]
    count = 0
    for ti in src:
        if ti == cur:
            count += 1
        else:
            runs.append((cur, count))
            cur, count = ti, 1
    runs.append((cur, count))
    return runs


def _cap(c: float) -> int | None:
    return None if c == math.inf else int(c)


class Simulation:
    """One run of the serving model (module docstring)."""

    def __init__(self, requests: Sequence[Any], setup: ClusterSetup, load: Load, *,
                 block_tokens: int, router: Any, exact_steps: bool = False,
                 trace_block_tokens: int | None = None,
                 backend: DataBackend | None = None, lanes: bool = True,
                 stack: Callable[[Simulation, ClusterSetup, int], TierStack] | None = None
                 ) -> None:
        """``lanes``: flows over one-hop paths no other path crosses skip the flow network
        (:mod:`kvtool.serving.lanes`; the same report, bit for bit; False: the network).
        ``stack``: makes the tiers below the GPUs instead of :class:`TierStack` (with
        ``backend``), e.g. :class:`kvtool.serving.serveorder.ServeOrderStack`."""
        self.requests = requests
        self.setup = setup
        self.setups = setup.engines
        self.load = load
        self.B = block_tokens
        self.router = router
        self._router_tracks_ends = (getattr(type(router), "finished", None)
                                    is not Router.finished)
        """A router that keeps the base class's ``finished`` ignores it: not called."""
        self.net = FlowNetwork()
        self.caps: dict[tuple[str, str], float] = {}
        for node, gbps in setup.nodes.items():
            self._link(f"nic/{node}", gbps, gbps)
        for t in setup.tiers:
            if t.name == "mooncake":
                self._link("mooncake", t.gbps, t.gbps)
            for name, r, w in t.targets:
                self._link(f"target/{name}", r, w)
        self.tiers = (TierStack(self, setup, block_tokens, backend) if stack is None else
                      stack(self, setup, block_tokens))
        offload = self.tiers if self.tiers.present or any(e.role == "decode" for e in setup.engines) \
            else None
        self.engines: list[Engine] = []
        conn = setup.connector
        for i, es in enumerate(setup.engines):
            self._link(f"pcie/{es.name}", es.pcie_gbps, es.pcie_gbps)
            if conn is not None and math.isfinite(conn.gbps):
                self._link(f"connector/{es.name}", conn.gbps, conn.gbps)
            pool = KVPool(es.num_gpu_blocks, block_tokens, es.enable_caching)
            self.engines.append(make_engine(
                i, es.name, es.node, pool, es.step,
                exact_steps=exact_steps or es.share_gpus is not None,
                block_tokens=block_tokens, max_num_seqs=es.max_num_seqs,
                max_num_batched_tokens=es.max_num_batched_tokens, offload=offload,
                role=es.role))
        if lanes and use_lanes(self):
            self.tiers.net = Lanes(self.net)
        self.pd = any(e.role == "prefill" for e in setup.engines)
        self.prefill_pool = [e for e in self.engines if e.role in ("prefill", "both")]
        self.decode_pool = [e for e in self.engines if e.role in ("decode", "both")]
        self._heap: list[tuple[float, int, int, int, int, int]] = []
        self._order = 0
        self._version = [0] * len(self.engines)
        self._plan_due = [False] * len(self.engines)
        # GPU sharing: engines of a group step one at a time (stepped engines, so a step is
        # one event); the group's holder is the engine whose step runs, the others wait
        # their turn in order and take it when that step ends
        names = sorted({es.share_gpus for es in setup.engines if es.share_gpus is not None})
        self._group: list[int] = [names.index(es.share_gpus) if es.share_gpus is not None
                                  else -1 for es in setup.engines]
        self._holder: list[int] = [-1] * len(names)
        self._turns: list[collections.deque[int]] = [collections.deque() for _ in names]
        self._timers: dict[int, Callable[[float], None]] = {}
        self._after = -1
        """The current event's place among simultaneous step ends (Engine.cut's ``after``)."""
        self.arrivals: ArrivalSource = Arrivals(requests, load)
        self.keys = output_block_keys(requests, trace_block_tokens or block_tokens, block_tokens)
        self.seqs: list[Seq | None] = [None] * len(requests)
        self.done: list[Seq] = []
        self.failed = 0
        self.now = 0.0

    def _link(self, name: str, up: float, down: float) -> None:
        """A link of ``up``/``down`` GB/s (``up``: leaving the GPU, node or target)."""
        self.net.add_link(name, up, down)
        self.caps[(name, "up")] = up
        self.caps[(name, "down")] = down

    # ---------------------------------------------------------------- events
    def _push_arrival(self, t: float, idx: int, released: bool) -> None:
        self._order += 1
        heapq.heappush(self._heap, (t, _RELEASED if released else _EARLY, self._order,
                                    ARRIVAL, idx, 0))

    def at(self, t: float, fn: Callable[[float], None]) -> None:
        """Call ``fn(t)`` at simulated time ``t`` (among the outside events of its time, as
        a flow completion: a connector's fixed cost after a load's last byte)."""
        self._order += 1
        self._timers[self._order] = fn
        heapq.heappush(self._heap, (t, _EARLY, self._order, TIMER, self._order, 0))

    def _push_step(self, t: float, i: int) -> None:
        self._version[i] += 1
        heapq.heappush(self._heap, (t, _STEPS, i, STEP, i, self._version[i]))

    def wake(self, engine: Engine, now: float) -> None:
        """Something changed for ``engine`` at ``now``: if idle, plan its steps once the
        other events of its kind due at ``now`` have happened; else let it end its planned
        steps early (:meth:`Engine.cut`)."""
        if engine.busy:
            new_end = engine.cut(now, self._after)
            if new_end is not None:
                self._push_step(new_end, engine.index)
            return
        # An idle engine plans once the arrivals due at ``now`` have come: requests arriving
        # together are scheduled together (as vLLM's engine core takes every queued request
        # before a step, and Dynamo's mocker every arrival before a pass). Woken before the
        # step ends at ``now`` (a flow, an early arrival), it plans before them; woken after
        # (a step end, a released arrival), after the released arrivals.
        i = engine.index
        if not self._plan_due[i]:
            self._plan_due[i] = True
            self._order += 1
            heapq.heappush(self._heap, (now, _PLAN_EARLY if self._after < 0 else _PLAN_LATE,
                                        self._order, PLAN, i, 0))

    def _plan(self, engine: Engine, now: float) -> None:
        i = engine.index
        self._plan_due[i] = False
        if engine.busy:
            return
        g = self._group[i]
        if g >= 0:
            holder = self._holder[g]
            if holder >= 0 and holder != i:
                if i not in self._turns[g]:
                    self._turns[g].append(i)  # the GPUs are busy: wait for the turn
                return
        end = engine.plan(now)
        if end is not None:
            self._push_step(end, i)
            if g >= 0:
                self._holder[g] = i

    def _next_turn(self, engine: Engine, now: float) -> None:
        """``engine`` (sharing GPUs) ended a step: the engines waiting take their turn in
        order, ``engine`` itself after them; the first with work to do steps."""
        g = self._group[engine.index]
        self._holder[g] = -1
        turns = self._turns[g]
        if not turns:
            self._plan(engine, now)
            return
        turns.append(engine.index)
        while turns and self._holder[g] < 0:
            self._plan(self.engines[turns.popleft()], now)

    def _arrive(self, idx: int, now: float) -> None:
        r = self.requests[idx]
        seq = Seq(idx, r.input_length, r.output_length, self.keys[idx], self.B, now,
                  session=r.session)
        self.seqs[idx] = seq
        pool = self.prefill_pool
        if self.pd:
            seq.target_tokens = seq.max_tokens
            seq.max_tokens = 1
        keys = self.keys[idx]
        role = "prefill" if self.pd else None
        j = self.router.route(r, pool, role, keys=keys[: r.input_length // self.B])
        engine = pool[j]
        if not engine.fits(seq):
            self.router.finished(r, role)
            self._fail(seq, now)
            return
        engine.add(seq)
        self.wake(engine, now)

    def _fail(self, seq: Seq, now: float) -> None:
        seq.status = FAILED
        self.failed += 1
        for t, nxt in self.arrivals.on_finish(seq.index, now):
            self._push_arrival(t, nxt, True)

    def _finished(self, engine: Engine, seq: Seq, now: float) -> None:
        handoff = self.pd and not seq.decode_only
        through_store = handoff and not self.tiers.pd_direct
        if self.tiers.present:
            # P/D through the store: the decode engine is handed the request once the
            # prefill engine's KV is in the tiers below (WQS's design)
            self.tiers.store(engine, seq, now,
                             (lambda t: self._handoff(engine, seq, t)) if through_store else None)
        if self._router_tracks_ends:
            self.router.finished(self.requests[seq.index], "decode" if seq.decode_only else
                                 "prefill" if self.pd else None)
        if handoff:
            if not through_store:
                self._handoff(engine, seq, now)
            return
        self.done.append(seq)
        for t, nxt in self.arrivals.on_finish(seq.index, now):
            self._push_arrival(t, nxt, True)

    def _handoff(self, engine: Engine, seq: Seq, now: float) -> None:
        """Prefill done: hand the request to a decode engine, which pulls the prompt's KV
        from the prefill engine (``direct``) or loads it from the tiers below (``store``)."""
        request = self.requests[seq.index]
        seq.decode_only = True
        seq.max_tokens = seq.target_tokens
        seq.num_output = 0
        seq.num_tokens = seq.num_prompt_tokens
        seq.num_computed_tokens = 0
        seq.first_token = -1.0
        seq.block_hashes = seq.full_keys[: seq.num_prompt_tokens // self.B]
        seq.pd_source = engine.index
        j = self.router.route(request, self.decode_pool, "decode",
                              keys=seq.block_hashes)
        dst = self.decode_pool[j]
        if not dst.fits(seq):
            self.router.finished(request, "decode")
            self._fail(seq, now)
            return
        dst.add(seq)
        self.wake(dst, now)

    def run(self, progress: Callable[[int], None] | None = None) -> dict[str, Any]:
        # The arrivals known up front wait in a sorted list beside the heap (the entries
        # _push_arrival would push, taken in the same order: a smaller heap for the rest)
        early: list[tuple[float, int, int, int, int, int]] = []
        for t, idx in self.arrivals.initial():
            self._order += 1
            early.append((t, _EARLY, self._order, ARRIVAL, idx, 0))
        early.sort()
        n_early = len(early)
        ei = 0
        heap = self._heap
        net = self.tiers.net
        version = self._version
        engines = self.engines
        last = len(engines)
        pop = heapq.heappop
        reported = 0
        # a router that keeps the base class's prefill_done ignores it: not called
        tracks = getattr(type(self.router), "prefill_done", None) is not Router.prefill_done
        while True:
            t_net = net.next_completion()
            # (a flag, not ``entry is early[ei]``: compiled, a tuple is boxed at each read)
            in_early = ei < n_early and not (heap and heap[0] < early[ei])
            if in_early:
                entry = early[ei]
            elif heap:
                entry = heap[0]
            elif t_net is not None:
                self.now = t_net
                self._after = -1
                net.advance(t_net)
                continue
            else:
                break
            if t_net is not None and t_net <= entry[0]:
                self.now = t_net
                self._after = -1
                net.advance(t_net)
                continue
            if in_early:
                ei += 1
            else:
                pop(heap)
            t, cls, _o, kind, a, b = entry
            self.now = t
            if kind == ARRIVAL:
                self._after = last if cls == _RELEASED else -1
                self._arrive(a, t)
                continue
            if kind == TIMER:
                self._after = -1
                self._timers.pop(a)(t)
                continue
            if kind == PLAN:
                self._plan(engines[a], t)
                continue
            if b != version[a]:
                continue
            self._after = a
            engine = engines[a]
            finished = engine.end_step()
            if engine.first_tokens:
                for seq in engine.first_tokens if tracks else ():
                    if not seq.decode_only:
                        self.router.prefill_done(self.requests[seq.index],
                                                 "prefill" if self.pd else None)
                engine.first_tokens.clear()
            for seq in finished:
                self._finished(engine, seq, t)
            if self._group[a] >= 0:
                self._next_turn(engine, t)
            else:
                self._plan(engine, t)
            if progress is not None and len(self.done) - reported >= 256:
                progress(len(self.done) - reported)
                reported = len(self.done)
        if progress is not None and len(self.done) > reported:
            progress(len(self.done) - reported)
        return self.report()

    def release(self) -> None:
        """Break the run's reference cycles (the engines, the tiers below and the loop refer
        to one another; the flow network's links to their flow classes) so that reference
        counting frees the simulation once it is dropped: the cyclic collector then has
        none of it to walk (``replay``'s timed run reads the times, then drops it). Its
        report and requests stay readable; it cannot run again."""
        for engine in self.engines:
            engine.offload = None
        self.tiers.sim = None  # type: ignore[assignment]
        self._timers.clear()
        if self.tiers.net is not self.net:
            self.tiers.net.release()
        self.net.release()

    # ---------------------------------------------------------------- report
    def _overload(self, done: Sequence[Seq]) -> dict[str, Any]:
        """Whether the offered load exceeded the modelled capacity (:mod:`.overload`); with
        a P/D split the capacity is the smaller of the prefill and the decode pool's."""
        from kvtool.serving.overload import assess

        busy = [e.stats.busy_s for e in self.engines]
        pools = [[s.pd_source for s in done], [s.engine for s in done]] if self.pd else \
            [[s.engine for s in done]]
        best: dict[str, Any] | None = None
        for owners in pools:
            counts = [0] * len(self.engines)
            for i in owners:
                if i >= 0:
                    counts[i] += 1
            got = assess([s.arrival for s in done], [s.first_scheduled for s in done],
                         counts, [b if c else 0.0 for b, c in zip(busy, counts, strict=True)],
                         self.load.kind)
            if best is None or (got["capacity_rps"] or 0) < (best["capacity_rps"] or 0):
                best = got
        assert best is not None
        return best

    def report(self) -> dict[str, Any]:
        done = self.done
        arrivals = [s.arrival for s in self.seqs if s is not None]
        start = min(arrivals) if arrivals else 0.0
        end = max((s.finish for s in done), default=start)
        itl_v: list[float] = []
        itl_c: list[int] = []
        for e in self.engines:
            itl_v.extend(e.itl_values)
            itl_c.extend(e.itl_counts)
        serving = serving_metrics(
            start=start, end=end,
            input_tokens=[s.num_prompt_tokens for s in done],
            output_tokens=[s.num_output for s in done],
            ttft_s=[s.first_token - s.arrival for s in done],
            e2el_s=[s.finish - s.arrival for s in done],
            itl_values_s=itl_v, itl_counts=itl_c, failed=self.failed)
        serving["unfinished"] = sum(1 for s in self.seqs
                                    if s is not None and s.status not in (FINISHED, FAILED))
        span = end - start
        queue = describe([(s.first_scheduled - s.arrival) * 1000.0 for s in done])
        serving["mean_queue_ms"] = queue["mean"]
        serving["p99_queue_ms"] = queue["p99"]
        prompt = sum(s.num_prompt_tokens for s in done)
        gpu_hit = sum(max(0, s.local_hit_tokens) for s in done)
        ext_hit = sum(s.ext_tokens for s in done)
        by_tier: dict[str, int] = {}
        for s in done:
            for n, c in s.ext_by_tier.items():
                by_tier[n] = by_tier.get(n, 0) + c
        engines = []
        for es, e in zip(self.setups, self.engines, strict=True):
            d = {**es.describe, "name": e.name, "node": e.node, "role": e.role,
                 "num_gpu_blocks": es.num_gpu_blocks}
            d.update(e.stats.to_dict(span))
            engines.append(d)
        links = {}
        for name, dirs in self.net.stats().items():
            links[name] = {d: {"bytes": int(v["bytes"]),
                               "busy_fraction": (v["busy_s"] / span if span > 0 else 0.0)}
                           for d, v in dirs.items()}
        return {
            "serving": serving,
            "load": self.load.to_dict(),
            "cache": {
                "prompt_tokens": prompt,
                "gpu_hit_tokens": gpu_hit,
                "external_hit_tokens": ext_hit,
                "external_hit_tokens_by_tier": by_tier,
                "recompute_tokens": prompt - gpu_hit - ext_hit,
                "token_hit_ratio": (gpu_hit + ext_hit) / prompt if prompt else 0.0,
                "declined_external_tokens": sum(s.ext_declined_tokens for s in done),
                "preemptions": sum(s.preemptions for s in done),
                **self.tiers.to_dict(),
            },
            "engines": engines,
            "links": links,
            "overload": self._overload(done),
            "basis": "simulated",
        }
