"""The serving model timing what the tier hierarchy decides (kvtool.serving.serveorder):
whatever the engine does — batch, preempt, admit a later request while an earlier one
cannot be held, take arrivals out of the list's order — the hierarchy serves the requests
exactly once each, in serve order, so it counts what feeding them one after the other
counts; and the engine's two ways of advancing time give the same times."""

from __future__ import annotations

import functools
import math
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtool.cache.replayer import CacheConfig, Replayer, TierSpec
from kvtool.serving.load import Load
from kvtool.serving.roofline import StepModel
from kvtool.serving.router import make_router
from kvtool.serving.serveorder import ServeOrderStack
from kvtool.serving.sim import ClusterSetup, EngineSetup, Simulation, TierSetup
from kvtool.trace.schema import Request
from kvtool.units import Capacity

B = 16


class Recording:
    """A replayer that records the order it was asked in."""

    def __init__(self, cfg: CacheConfig) -> None:
        self.replayer = Replayer(cfg, B)
        self.names = self.replayer.names
        self.order: list[int] = []

    def decide(self, req: Any) -> tuple[list[int], list[int]]:
        self.order.append(req.line - 1)
        return self.replayer.decide(req)


def _cfg(gpu: int, dram: int, nvme: int) -> CacheConfig:
    tiers = [TierSpec("gpu", Capacity.parse(f"{gpu}blk"), policy="vllm")] if gpu else []
    tiers.append(TierSpec("dram", Capacity.parse(f"{dram}blk")))
    if nvme:
        tiers.append(TierSpec("nvme", Capacity.parse(f"{nvme}blk")))
    return CacheConfig(tiers)


def _setup(pool_blocks: int, nvme: bool) -> ClusterSetup:
    from kvtool.geometry.presets import lookup
    from kvtool.serving.gpus import resolve_gpu

    step = StepModel(lookup("llama-3-8b"), resolve_gpu("h100-sxm"), 1, block_tokens=B)
    engine = EngineSetup(name="engine0", node="n0", role="both", num_gpu_blocks=pool_blocks,
                         block_bytes=B * 131072, pcie_gbps=25.0, step=step, max_num_seqs=4,
                         max_num_batched_tokens=64, describe={}, enable_caching=False)
    tiers = [TierSetup("dram", math.inf, "lru", node="n0")]
    if nvme:
        tiers.append(TierSetup("nvme", math.inf, "lru", targets=(("nvme", 5.0, 5.0),)))
    return ClusterSetup([engine], {"n0": math.inf}, tiers, "round-robin", {}, name="t")


@st.composite
def workloads(draw: Any) -> tuple[list[Request], Load, CacheConfig, int]:
    requests = []
    history: dict[int, list[int]] = {}
    t = 0.0
    for i in range(draw(st.integers(1, 20))):
        s = draw(st.integers(0, 3))
        prev = history.get(s, [])[:8]
        keys = prev + [1000 * s + 10 * i + j for j in range(draw(st.integers(1, 4)))]
        if draw(st.integers(0, 9)) == 0:  # more blocks than the engine's pool holds
            keys += [10**6 + 100 * i + j for j in range(12)]
        out = draw(st.integers(1, 3 * B))
        history[s] = keys
        t += draw(st.sampled_from([0.0, 0.001, 0.05]))
        requests.append(Request(timestamp=t * 1000, input_length=len(keys) * B, output_length=out,
                                block_keys=keys, block_tokens=B, session=s, line=i + 1))
    load = draw(st.sampled_from([Load("concurrency", 1), Load("concurrency", 3),
                                 Load("request-rate", math.inf), Load("timestamps", 1.0)]))
    cfg = _cfg(draw(st.sampled_from([0, 3, 8])), draw(st.integers(1, 12)),
               draw(st.sampled_from([0, 6, 40])))
    return requests, load, cfg, draw(st.integers(12, 20))


def _run(requests: list[Request], load: Load, cfg: CacheConfig, pool: int, exact: bool
         ) -> tuple[Recording, Simulation, dict[str, Any]]:
    rec = Recording(cfg)
    sim = Simulation(requests, _setup(pool, any(t.name == "nvme" for t in cfg.tiers)),
                     load, block_tokens=B, router=make_router("round-robin"), exact_steps=exact,
                     stack=functools.partial(ServeOrderStack, decider=rec, requests=requests))
    doc = sim.run()
    assert isinstance(sim.tiers, ServeOrderStack)
    sim.tiers.finish()
    return rec, sim, doc


@pytest.mark.slow
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_the_hierarchy_serves_every_request_once_in_serve_order(
        w: tuple[list[Request], Load, CacheConfig, int]) -> None:
    requests, load, cfg, pool = w
    rec, sim, doc = _run(requests, load, cfg, pool, exact=False)
    assert rec.order == list(range(len(requests)))
    alone = Replayer(cfg, B)
    for r in requests:
        alone.feed(r)
    assert rec.replayer.result() == alone.result()
    # the engine's two ways of advancing time: the same times for the same decisions
    _rec2, sim2, doc2 = _run(requests, load, cfg, pool, exact=True)
    assert doc2["serving"] == doc["serving"]
    assert [(s.first_token, s.finish) if s else None for s in sim.seqs] == \
        [(s.first_token, s.finish) if s else None for s in sim2.seqs]


def test_a_request_the_engine_cannot_hold_is_still_served_in_order() -> None:
    big = [10**6 + j for j in range(40)]
    requests = [Request(timestamp=0.0, input_length=len(k) * B, output_length=4, block_keys=k,
                        block_tokens=B, session=i, line=i + 1)
                for i, k in enumerate([[1, 2], big, [1, 2, 3]])]
    rec, sim, doc = _run(requests, Load("concurrency", 3), _cfg(0, 100, 0), 16, exact=False)
    assert rec.order == [0, 1, 2]
    assert doc["serving"]["failed"] == 1 and doc["serving"]["completed"] == 2
    # the third request found the first one's two blocks in DRAM and loaded them
    assert sim.tiers.blocks_loaded == {"dram": 2}
