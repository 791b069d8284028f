"""From a cluster file to what the event loop runs: engines' setups, tiers, links, router.

:func:`build_setup` reads a cluster file (:func:`kvtool.serving.topology.load_cluster`),
applies overrides of the roofline's scalars (calibration, what-ifs) and returns a
:class:`BuiltCluster`: the :class:`~kvtool.serving.sim.ClusterSetup` the loop needs, a fresh
router per run, and the summary the report shows.

The engines' block size is the cluster file's ``block_tokens`` when it gives one, else the
trace's (the trace's keys then need no rescaling).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from kvtool.errors import UsageError
from kvtool.serving.load import check_block_sizes
from kvtool.serving.roofline import Scalars, StepModel
from kvtool.serving.router import Router, make_router
from kvtool.serving.sim import ClusterSetup, EngineSetup, TierSetup
from kvtool.serving.topology import ClusterSpec, load_cluster


@dataclass
class BuiltCluster:
    name: str
    spec: ClusterSpec
    setup: ClusterSetup
    block_tokens: int
    scalars: Scalars

    def make_router(self) -> Router:
        return make_router(self.spec.router.name, defaults={"block_tokens": self.block_tokens},
                           **self.spec.router.params)

    def describe(self) -> dict[str, Any]:
        doc = self.spec.to_dict()
        groups: list[dict[str, Any]] = []
        for e in self.setup.engines:
            d = e.describe
            key = (d["model"], d["gpu"], d["tp"], d["role"], e.num_gpu_blocks)
            for g in groups:
                if g["_key"] == key:
                    g["count"] += 1
                    break
            else:
                groups.append({"_key": key, "count": 1, "model": d["model"], "gpu": d["gpu"],
                               "tp": d["tp"], "role": d["role"],
                               "num_gpu_blocks": e.num_gpu_blocks})
        for g in groups:
            del g["_key"]
        doc["engine_groups"] = groups
        doc["router"] = self.spec.router.name
        doc["router_params"] = dict(self.spec.router.params)
        doc["engine_block_tokens"] = self.block_tokens
        doc["scalars"] = dataclasses.asdict(self.scalars)
        return doc


def build_setup(path: str, *, block_tokens: int, scalars: dict[str, Any] | None = None,
                num_gpu_blocks: int | None = None) -> BuiltCluster:
    """Read the cluster file at ``path`` for a trace of ``block_tokens``-token blocks;
    ``num_gpu_blocks``, when given, is every engine's KV pool instead of the file's (an
    experiment's inferred pool, ``[serving] num_gpu_blocks``)."""
    spec = load_cluster(path, default_block_tokens=block_tokens)
    B = spec.block_tokens
    check_block_sizes(block_tokens, B)
    try:
        sc = Scalars(**(scalars or {}))
    except TypeError as exc:
        raise UsageError(f"unknown roofline scalar: {exc}", field="scalars") from None
    steps: dict[int, StepModel] = {}
    engines = []
    for e in spec.engines:
        step = e.step
        if scalars and getattr(step, "kind", "roofline") == "roofline":
            key = id(e.step)
            if key not in steps:
                steps[key] = StepModel(e.model, e.gpu, e.tp, weight_dtype=e.dtype,
                                       kv_dtype=e.kv_dtype, scalars=sc, block_tokens=B)
            step = steps[key]
        engines.append(EngineSetup(
            name=e.name, node=e.node, role=e.role,
            num_gpu_blocks=e.num_gpu_blocks if num_gpu_blocks is None else num_gpu_blocks,
            block_bytes=e.all_ranks_block_bytes, pcie_gbps=e.host_link_gbps, step=step,
            max_num_seqs=e.max_num_seqs, max_num_batched_tokens=e.max_num_batched_tokens,
            describe={"model": e.model.name, "gpu": e.gpu.name, "tp": e.tp, "role": e.role,
                      "kv_dtype": e.kv_dtype, "block_bytes": e.all_ranks_block_bytes},
            enable_caching=e.enable_prefix_caching, share_gpus=e.share_gpus))
    tiers: list[TierSetup] = []
    for n in spec.nodes:
        if n.dram is not None:
            tiers.append(TierSetup("dram", spec.capacity_blocks(n.dram), n.dram_policy, node=n.name))
    if spec.mooncake is not None:
        tiers.append(TierSetup("mooncake", spec.capacity_blocks(spec.mooncake.capacity),
                               spec.mooncake.policy, gbps=spec.mooncake.gbps))
    if spec.nvme is not None:
        tiers.append(TierSetup("nvme", spec.capacity_blocks(spec.nvme.capacity), spec.nvme.policy,
                               targets=tuple((t.name, t.read_gbps, t.write_gbps)
                                             for t in spec.nvme.targets)))
    nodes = {n.name: n.nic_gbps for n in spec.nodes}
    setup = ClusterSetup(engines=engines, nodes=nodes, tiers=tiers, router=spec.router.name,
                         router_params=dict(spec.router.params), name=spec.name,
                         connector=spec.connector, pd_transfer=spec.pd_transfer)
    return BuiltCluster(spec.name, spec, setup, B, sc)


__all__ = ["BuiltCluster", "build_setup"]
