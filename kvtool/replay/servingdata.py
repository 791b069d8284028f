"""Data mode of the serving model: the engines and router drive tiers that hold real bytes.

``kvtool replay TRACE --cluster FILE`` without ``--simulate`` runs the same event loop as
``--simulate`` (:mod:`kvtool.serving.sim`) with a :class:`ClusterData` attached to its
tiers. Whenever the simulated clock says a block enters a tier, is loaded from it or leaves
it, the bytes move then, in that order:

* **store** (a store flow has arrived, or a loaded block is promoted into its node's DRAM):
  the block's bytes — the payload of its chain hash and the seed, exactly what the GPU pool
  computed (:class:`~kvtool.store.payload.Payload`) — are written into the tier;
* **load** (a request starts loading its hit prefix): the blocks are read from the tier
  into a staging buffer of the engine's GPU pool and **every block is checked** against its
  payload; a block that does not match, or that the tier lost, is counted, named and never
  served (the report counts it as recomputed);
* **evict**: the tier frees the block's space.

The tiers: each node's DRAM tier and the cluster-wide Mooncake pool are DRAM pools in this
process (:class:`~kvtool.tiers.dram.DramTier`); the NVMe pool is kvtool's object store on
the running built-in target (``kvtool target up``), on ``--nvme PLACE``, or on a store
file in the cache directory. Capacities are the cluster file's, so data mode needs files
whose tiers fit this machine (``--simulate`` for the rest).

What is measured: the bytes and the wall seconds each tier's reads and writes took here;
what is simulated: every time in the ``serving`` report (labelled so).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from kvtool.errors import UsageError, param
from kvtool.units import format_size

if TYPE_CHECKING:
    from kvtool.nvme.hostauth import HostCredentials
    from kvtool.serving.setup import BuiltCluster
    from kvtool.tiers.base import DataTier

MAX_NAMED = 100


@dataclass
class TierCounters:
    """Measured traffic of one data tier."""

    blocks_written: int = 0
    blocks_read: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    write_s: float = 0.0
    read_s: float = 0.0
    evicted: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {**self.__dict__,
                "write_gbps": self.bytes_written / self.write_s / 1e9 if self.write_s > 0 else None,
                "read_gbps": self.bytes_read / self.read_s / 1e9 if self.read_s > 0 else None}


@dataclass
class ClusterData:
    """Real tiers behind a serving-model run (module docstring); a
    :class:`~kvtool.serving.sim.DataBackend`."""

    block_bytes: int
    seed: int
    tiers: dict[tuple[str, str | None], DataTier]
    places: dict[str, str] = field(default_factory=dict)
    verified: int = 0
    corrupt: int = 0
    lost: int = 0
    named: list[dict[str, Any]] = field(default_factory=list)
    counters: dict[str, TierCounters] = field(default_factory=dict)

    def __post_init__(self) -> None:
        from kvtool.store.payload import Payload

        self.payload = Payload(self.block_bytes, self.seed)
        self._src = np.empty(self.block_bytes, dtype=np.uint8)
        self._want = np.empty(self.block_bytes, dtype=np.uint8)
        self._stage: list[np.ndarray] = []

    def _tier(self, tier: str, node: str | None) -> DataTier:
        return self.tiers[(tier, node if tier == "dram" else None)]

    def _count(self, tier: str) -> TierCounters:
        c = self.counters.get(tier)
        if c is None:
            c = self.counters[tier] = TierCounters()
        return c

    def on_store(self, tier: str, node: str | None, keys: list[int], engine: int) -> None:
        t = self._tier(tier, node)
        srcs = []
        for k in keys:
            buf = np.empty(self.block_bytes, dtype=np.uint8)
            self.payload.fill(k, buf)
            srcs.append(buf)
        start = time.perf_counter()
        job = t.prepare_store(keys, srcs)
        t.complete_store(job)
        c = self._count(tier)
        c.write_s += time.perf_counter() - start
        c.blocks_written += len(keys)
        c.bytes_written += len(keys) * self.block_bytes

    def on_load(self, tier: str, node: str | None, keys: list[int], engine: int) -> list[int]:
        t = self._tier(tier, node)
        while len(self._stage) < len(keys):
            self._stage.append(np.empty(self.block_bytes, dtype=np.uint8))
        dsts = self._stage[: len(keys)]
        start = time.perf_counter()
        ok = t.complete_load(t.prepare_load(keys, dsts))
        c = self._count(tier)
        c.read_s += time.perf_counter() - start
        from kvtool.store.payload import equal

        failed: list[int] = []
        for k, good, buf in zip(keys, ok, dsts, strict=True):
            if not good:
                self.lost += 1
                self._name("lost", k, tier, engine)
                failed.append(k)
                continue
            c.blocks_read += 1
            c.bytes_read += self.block_bytes
            self.payload.fill(k, self._want)
            if equal(buf, self._want):
                self.verified += 1
            else:
                self.corrupt += 1
                self._name("corrupt", k, tier, engine)
                failed.append(k)
        return failed

    def on_evict(self, tier: str, node: str | None, keys: list[int]) -> None:
        self._tier(tier, node).evict(keys)
        self._count(tier).evicted += len(keys)

    def _name(self, kind: str, key: int, tier: str, engine: int) -> None:
        if len(self.named) < MAX_NAMED:
            self.named.append({"kind": kind, "key": key, "tier": tier, "engine": engine})

    def result(self) -> dict[str, Any]:
        return {"mode": "data", "block_bytes": self.block_bytes, "seed": self.seed,
                "places": dict(self.places),
                "verified_blocks": self.verified, "corrupt_blocks": self.corrupt,
                "lost_blocks": self.lost, "problems": list(self.named),
                "tiers": {k: v.to_dict() for k, v in sorted(self.counters.items())},
                "basis": "measured"}

    def close(self) -> None:
        for t in self.tiers.values():
            t.close()


def open_cluster_data(built: BuiltCluster, *, seed: int, nvme_place: str | None = None,
                      read_qd: int = 32, credentials: HostCredentials | None = None) -> ClusterData:
    """Open the real tiers of ``built``'s cluster for data mode; check they fit here."""
    from kvtool.replay.run import MEMORY_SHARE, default_nvme_place, mem_available, nvme_engine
    from kvtool.tiers.base import TierError
    from kvtool.tiers.dram import DramTier
    from kvtool.tiers.nvme import NvmeTier

    spec = built.spec
    bb = built.setup.engines[0].block_bytes
    tiers: dict[tuple[str, str | None], DataTier] = {}
    places: dict[str, str] = {}
    need = 0
    dram: list[tuple[str, str | None, int]] = []
    for t in built.setup.tiers:
        if not t.capacity_blocks > 0:
            continue
        if t.capacity_blocks == math.inf:
            raise UsageError(f"data mode holds real bytes: the {t.name} tier of {spec.name} needs "
                             f"a size (use {param('simulate')} for an unbounded tier)",
                             field="cluster")
        if t.name in ("dram", "mooncake"):
            slots = int(t.capacity_blocks)
            dram.append((t.name, t.node, slots))
            need += slots * bb
    avail = mem_available()
    if avail is not None and need > MEMORY_SHARE * avail:
        raise UsageError(f"data mode needs {format_size(need)} of memory for the DRAM tiers of "
                         f"{spec.name}, but this machine has {format_size(avail)} available; use "
                         f"{param('simulate')}", field="cluster")
    try:
        for name, node, slots in dram:
            tiers[(name, node)] = DramTier(slots, bb, name=name)
            places[name if node is None else f"{name}/{node}"] = "DRAM of this process"
        nvme = next((t for t in built.setup.tiers if t.name == "nvme" and t.capacity_blocks > 0),
                    None)
        if nvme is not None:
            want = int(nvme.capacity_blocks)
            from kvtool.align import round_up

            size = want * round_up(bb, 4096) + (64 << 20)
            if nvme_place:
                place, why = nvme_place, "given"
                create = None if place.startswith("nvme+tcp://") or os.path.exists(place) \
                    else size
            else:
                place, why, create = default_nvme_place()
                if create is not None:
                    create = max(create, size)
            engine = nvme_engine(place, create, read_qd, credentials)
            try:
                tier = NvmeTier(engine, block_bytes=bb, url=place, max_slots=want,
                                read_qd=read_qd, seed=seed, keyed_payload=True)
            except TierError as exc:
                engine.close()
                raise UsageError(str(exc), field="nvme") from None
            if tier.slots < want:
                tier.close()
                raise UsageError(
                    f"{place} holds {tier.slots:,} blocks of {bb:,} B; the nvme tier of "
                    f"{spec.name} is {want:,} blocks: use a bigger place or {param('simulate')}",
                    field="nvme")
            tiers[("nvme", None)] = tier
            places["nvme"] = f"{place} ({why})"
    except BaseException:
        for opened in tiers.values():
            opened.close()
        raise
    return ClusterData(bb, seed, tiers, places)
