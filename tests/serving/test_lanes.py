"""Lanes (kvtool.serving.lanes) give the flow network's report, bit for bit.

Where every flow runs over a one-hop path no other path crosses (each node's DRAM the only
tier below, no P/D split, no connector hop), the loads and stores skip the flow network:
each hop is a processor-sharing queue with the network's own arithmetic. The report, the
per-request times and the links' counters must equal the network's exactly, on the
fixture traces against every cluster fixture (the lanes are used where they apply), on
random small clusters, and on the plain replay's one-engine case.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtool.serving.lanes import Lanes
from kvtool.serving.load import Load
from kvtool.serving.setup import build_setup
from kvtool.serving.sim import ClusterSetup, EngineSetup, Simulation, TierSetup
from kvtool.trace import read_trace
from kvtool.trace.schema import Request

REPO = Path(__file__).resolve().parents[2]
CLUSTERS = sorted((REPO / "fixtures" / "clusters").glob("*.toml"))
TRACES = [REPO / "fixtures" / "traces" / n for n in (
    "multiturn-8x12.jsonl", "multiturn-4x6.tokens.jsonl")]


def per_request(sim: Simulation) -> list[tuple[Any, ...]]:
    """Each request's times, output tokens, preemptions and hits (exact)."""
    return [(s.status, s.arrival, s.first_token, s.finish, s.num_output, s.preemptions,
             s.local_hit_tokens, s.ext_tokens, dict(s.ext_by_tier)) if s is not None else None
            for s in sim.seqs]


def lanes_and_network(requests: list[Any], setup: ClusterSetup, load: Load, block_tokens: int,
                      router: Any, trace_block_tokens: int | None = None,
                      exact_steps: bool = False) -> bool:
    """Run with lanes and without; assert the same report, requests and link counters.
    Returns whether the lanes were used."""
    docs = []
    used = False
    for lanes in (True, False):
        sim = Simulation(requests, setup, load, block_tokens=block_tokens, router=router(),
                         exact_steps=exact_steps, trace_block_tokens=trace_block_tokens,
                         lanes=lanes)
        if lanes:
            used = isinstance(sim.tiers.net, Lanes)
        else:
            assert sim.tiers.net is sim.net
        doc = sim.run()
        docs.append((doc, per_request(sim), sim.net.stats(), sim.tiers.to_dict()))
    assert docs[0] == docs[1]
    return used


def test_fixture_clusters_on_the_fixture_traces() -> None:
    used = 0
    for cluster in CLUSTERS:
        for trace in TRACES:
            reader = read_trace(str(trace))
            requests = list(reader)
            built = build_setup(str(cluster), block_tokens=reader.block_tokens)
            for load in (Load("concurrency", 4), Load("request-rate", math.inf)):
                used += lanes_and_network(requests, built.setup, load, built.block_tokens,
                                          built.make_router, reader.block_tokens)
    assert used  # some fixture has only DRAM below its engines


@st.composite
def workloads(draw: Any) -> tuple[ClusterSetup, int, list[Request], Load]:
    """Small clusters with each node's DRAM below (the lanes' case, mostly: a PCIe link may
    be unlimited, which the lanes leave to the network), loads that share the PCIe links
    (slow links, requests arriving together) and stores that evict."""
    from kvtool.geometry import lookup
    from kvtool.serving.gpus import resolve_gpu
    from kvtool.serving.roofline import StepModel

    B = draw(st.sampled_from([4, 16]))
    step = StepModel(lookup("llama-3-8b"), resolve_gpu("a100-sxm"), 1, block_tokens=B)
    engines = []
    for i in range(draw(st.integers(1, 3))):
        seqs = draw(st.sampled_from([2, 4, 64]))
        engines.append(EngineSetup(
            name=f"e{i}", node=f"n{i % 2}", role="both",
            num_gpu_blocks=draw(st.integers(14, 40)), block_bytes=step.block_tokens * 1000,
            pcie_gbps=draw(st.sampled_from([0.0005, 0.001, 1.0, math.inf])), step=step,
            max_num_seqs=seqs, max_num_batched_tokens=draw(st.sampled_from([seqs, 24, 2048])),
            describe={}, enable_caching=draw(st.booleans())))
    tiers = [TierSetup("dram", draw(st.integers(2, 80)), draw(st.sampled_from(["lru", "arc"])),
                       node=n) for n in ("n0", "n1") if draw(st.booleans())]
    setup = ClusterSetup(engines, {"n0": 0.01, "n1": math.inf}, tiers,
                         draw(st.sampled_from(["round-robin", "kv-aware", "least-loaded"])), {})
    requests = []
    sessions = draw(st.integers(1, 4))
    t = 0.0
    history: dict[int, list[int]] = {}
    for i in range(draw(st.integers(1, 24))):
        s = draw(st.integers(0, sessions - 1))
        keys = history.get(s, [])[:8] + [1000 * s + 10 * i + j
                                         for j in range(draw(st.integers(1, 4)))]
        out = draw(st.integers(1, 3 * B))
        history[s] = keys + [1000 * s + 10 * i + 5 + j for j in range(out // B)]
        t += draw(st.sampled_from([0.0, 0.001, 0.05]))
        requests.append(Request(timestamp=t * 1000,
                                input_length=len(keys) * B + draw(st.integers(0, B - 1)),
                                output_length=out, block_keys=keys, block_tokens=B,
                                session=s, line=i + 1))
    load = draw(st.sampled_from([Load("concurrency", 1), Load("concurrency", 3),
                                 Load("request-rate", math.inf), Load("timestamps", 1.0)]))
    return setup, B, requests, load


@pytest.mark.slow
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_small_clusters(w: tuple[ClusterSetup, int, list[Request], Load]) -> None:
    from kvtool.serving.router import make_router

    setup, B, requests, load = w
    for exact in (False, True):
        lanes_and_network(requests, setup, load, B, lambda: make_router(setup.router), B,
                          exact_steps=exact)


@pytest.mark.slow
def test_plain_replay_one_engine_case(mooncake_traces: Path) -> None:
    """The one-engine case of ``kvtool replay TRACE --simulate --dram N`` (overloaded: its
    loads share the PCIe link most of the time)."""
    from kvtool.cache.replayer import CacheConfig, TierSpec
    from kvtool.replay import timing
    from kvtool.units import Capacity

    requests = list(read_trace(str(mooncake_traces / "conversation_trace.jsonl"),
                               fmt="mooncake", block_tokens=512))[:3000]
    cfg = CacheConfig([TierSpec("dram", Capacity(5859, "blocks"), "lru")])
    kw: dict[str, Any] = dict(block_tokens=512, block_bytes=None, model=None, dtype=None,
                              tp=None, gpu=None, concurrency=None, read_gbps={}, timed=True)
    got = timing.one_engine_times(requests, cfg, **kw)
    real = Simulation.__init__

    def no_lanes(self: Simulation, *a: Any, **k: Any) -> None:
        real(self, *a, **{**k, "lanes": False})

    Simulation.__init__ = no_lanes  # type: ignore[method-assign]
    try:
        ref = timing.one_engine_times(requests, cfg, **kw)
    finally:
        Simulation.__init__ = real  # type: ignore[method-assign]
    assert [vars(t) for t in got[0]] == [vars(t) for t in ref[0]]
    assert got[1] == ref[1]
