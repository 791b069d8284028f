"""Jumping from event to event gives the report of stepping one engine step at a time.

The serving model's engines advance time either step by step (``exact_steps``, the
reference: every step scheduled on its own, every running request touched) or from event
to event (the default: runs of identical decode steps computed in one go,
:mod:`kvtool.serving.engine`). The two must give the same report: the same hits, counts,
puts and bytes, and the same per-request TTFT, TPOT and E2E to 1e-9 relative (they are in
fact equal bit for bit). Checked on the fixture traces against every cluster fixture (P/D
included) under three loads, on the Mooncake traces, on the plain replay's one-engine
case, and on random small clusters built to preempt, chunk and share prefixes.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtool.serving.engine import EventEngine, SteppedEngine
from kvtool.serving.load import Load
from kvtool.serving.roofline import StepModel
from kvtool.serving.setup import build_setup
from kvtool.serving.sim import ClusterSetup, EngineSetup, Simulation, TierSetup
from kvtool.trace import read_trace
from kvtool.trace.schema import Request

REPO = Path(__file__).resolve().parents[2]
CLUSTERS = sorted((REPO / "fixtures" / "clusters").glob("*.toml"))
TRACES = [REPO / "fixtures" / "traces" / n for n in (
    "multiturn-8x12.jsonl", "multiturn-4x6.tokens.jsonl", "bailian-sample.jsonl",
    "azure-conv-head.csv")]
REL = 1e-9


def _same(a: Any, b: Any, path: str, out: list[str]) -> None:
    """Collect where two report documents differ: floats beyond ``REL``, anything else at all."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in a.keys() | b.keys():
            _same(a.get(k), b.get(k), f"{path}.{k}", out)
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{path}[{i}]", out)
    elif isinstance(a, float) and isinstance(b, float):
        if not (a == b or math.isclose(a, b, rel_tol=REL, abs_tol=1e-12)):
            out.append(f"{path}: {a!r} != {b!r}")
    elif a != b or type(a) is not type(b):
        out.append(f"{path}: {a!r} != {b!r}")


def per_request(sim: Simulation) -> list[tuple[Any, ...]]:
    """Each request's TTFT, TPOT and E2E (seconds), output tokens and preemptions."""
    out: list[tuple[Any, ...]] = []
    for s in sim.seqs:
        if s is None or s.finish < 0:
            out.append((None if s is None else s.status,))
            continue
        tpot = (s.finish - s.first_token) / (s.num_output - 1) if s.num_output > 1 else 0.0
        out.append((s.first_token - s.arrival, tpot, s.finish - s.arrival, s.num_output,
                    s.preemptions, s.local_hit_tokens, s.ext_tokens))
    return out


def both(requests: list[Any], setup: ClusterSetup, load: Load, block_tokens: int,
         router: Any, trace_block_tokens: int | None = None) -> tuple[Simulation, Simulation]:
    """The same run stepped and jumped; assert the reports and the requests agree."""
    sims = []
    for exact in (True, False):
        sim = Simulation(requests, setup, load, block_tokens=block_tokens, router=router(),
                         exact_steps=exact, trace_block_tokens=trace_block_tokens)
        sim.run()
        sims.append(sim)
    stepped, jumped = sims
    diffs: list[str] = []
    _same(stepped.report(), jumped.report(), "report", diffs)
    _same(per_request(stepped), per_request(jumped), "requests", diffs)
    assert not diffs, "\n".join(diffs[:20])
    for s, j, es in zip(stepped.engines, jumped.engines, setup.engines, strict=True):
        assert isinstance(s, SteppedEngine)
        # engines sharing GPUs step one step per event in both (docs/serving.md)
        assert isinstance(j, EventEngine) or s.max_num_seqs > s.max_num_batched_tokens \
            or es.share_gpus is not None
        assert j.plans <= s.plans
    return stepped, jumped


def run_file(trace: Path | str, cluster: Path, load: Load | None, *, fmt: str = "auto",
             block_tokens: int | None = None, limit: int | None = None
             ) -> tuple[Simulation, Simulation] | None:
    reader = read_trace(str(trace), fmt=fmt, block_tokens=block_tokens)
    requests = list(reader)[:limit]
    if load is None:
        if not reader.timed:
            return None
        load = Load("timestamps", 1.0)
    built = build_setup(str(cluster), block_tokens=reader.block_tokens)
    return both(requests, built.setup, load, built.block_tokens, built.make_router,
                reader.block_tokens)


@pytest.mark.parametrize("cluster", CLUSTERS, ids=lambda p: p.stem)
def test_every_cluster_fixture_on_the_fixture_traces(cluster: Path) -> None:
    steps = plans = 0
    shared = False
    for trace in TRACES:
        for load in (Load("concurrency", 4), Load("request-rate", math.inf), None):
            pair = run_file(trace, cluster, load)
            if pair is not None:
                steps += sum(e.stats.steps for e in pair[0].engines)
                plans += sum(e.plans for e in pair[1].engines)
                shared = all(e.share_gpus for e in pair[1].setup.engines)
    # the jumps skipped steps (engines sharing GPUs step one at a time: no jumps)
    assert plans == steps if shared else plans < steps


def test_pd_through_the_store_on_separate_gpus(tmp_path: Path) -> None:
    """wqs-pd-400-141g without ``share_gpus``: P/D through the store on event engines."""
    src = (REPO / "fixtures" / "clusters" / "wqs-pd-400-141g.toml").read_text()
    apart = tmp_path / "wqs-pd-apart.toml"
    apart.write_text("\n".join(line for line in src.splitlines()
                               if not line.startswith("share_gpus")))
    test_every_cluster_fixture_on_the_fixture_traces(apart)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["conversation_trace.jsonl", "synthetic_trace.jsonl"])
@pytest.mark.parametrize("cluster", ["gp7000.toml", "a100-llama2.toml", "wqs-pd-400-141g.toml",
                                     "gp7000-mini.toml"])
def test_mooncake_traces(mooncake_traces: Path, name: str, cluster: str) -> None:
    # the first 1,000 requests at their timestamps and the first 300 closed-loop: stepping
    # the whole traces takes minutes (the conversation trace on gp7000: 30 s, 1.9 M steps)
    for load, limit in ((None, 1000), (Load("concurrency", 32), 300)):
        run_file(mooncake_traces / name, REPO / "fixtures" / "clusters" / cluster, load,
                 fmt="mooncake", block_tokens=512, limit=limit)


@pytest.mark.slow
def test_plain_replay_one_engine_case(mooncake_traces: Path) -> None:
    """The times of ``kvtool replay TRACE --simulate --dram N`` (kvtool.replay.timing)."""
    from kvtool.cache.replayer import CacheConfig, TierSpec
    from kvtool.replay.timing import one_engine_times
    from kvtool.units import Capacity

    requests = list(read_trace(str(mooncake_traces / "conversation_trace.jsonl"),
                               fmt="mooncake", block_tokens=512))[:1500]
    cfg = CacheConfig([TierSpec("dram", Capacity(5859, "blocks"), "lru")])
    kw: dict[str, Any] = dict(block_tokens=512, block_bytes=None, model=None, dtype=None,
                              tp=None, gpu=None, concurrency=None, read_gbps={}, timed=True)
    stepped, d1 = one_engine_times(requests, cfg, exact_steps=True, **kw)
    jumped, d2 = one_engine_times(requests, cfg, **kw)
    diffs: list[str] = []
    _same(d1, d2, "time_model", diffs)
    _same([vars(t) for t in stepped], [vars(t) for t in jumped], "times", diffs)
    assert not diffs, "\n".join(diffs[:20])


# ---------------------------------------------------------------- random small clusters

def _cluster(draw: Any) -> tuple[ClusterSetup, int]:
    from kvtool.geometry import lookup
    from kvtool.serving.gpus import resolve_gpu

    B = draw(st.sampled_from([4, 16]))
    step = StepModel(lookup("llama-3-8b"), resolve_gpu("a100-sxm"), 1, block_tokens=B)
    pd = draw(st.booleans())
    n = draw(st.integers(1, 3))
    roles = ["prefill", "decode"] + ["both"] * (n - 1) if pd else ["both"] * n
    engines = []
    for i, role in enumerate(roles):
        seqs = draw(st.sampled_from([2, 4, 64]))
        engines.append(EngineSetup(
            name=f"e{i}", node=f"n{i % 2}", role=role,
            num_gpu_blocks=draw(st.integers(14, 40)), block_bytes=step.block_tokens * 1000,
            pcie_gbps=draw(st.sampled_from([0.001, 1.0, math.inf])), step=step,
            max_num_seqs=seqs, max_num_batched_tokens=draw(st.sampled_from([seqs, 24, 64, 2048])),
            describe={}, enable_caching=draw(st.booleans())))
    tiers = []
    if draw(st.booleans()):
        tiers.append(TierSetup("dram", draw(st.integers(4, 80)), "lru", node="n0"))
        tiers.append(TierSetup("dram", draw(st.integers(4, 80)), "lru", node="n1"))
    if draw(st.booleans()):
        tiers.append(TierSetup("nvme", 500, "lru", targets=(("t0", 0.002, 0.002),
                                                            ("t1", 1.0, 1.0))))
    setup = ClusterSetup(engines, {"n0": 0.01, "n1": math.inf}, tiers,
                         draw(st.sampled_from(["round-robin", "kv-aware", "least-loaded"])), {})
    return setup, B


@st.composite
def workloads(draw: Any) -> tuple[ClusterSetup, int, list[Request], Load]:
    setup, B = _cluster(draw)
    requests = []
    sessions = draw(st.integers(1, 6))
    t = 0.0
    history: dict[int, list[int]] = {}
    for i in range(draw(st.integers(1, 24))):
        s = draw(st.integers(0, sessions - 1))
        prev = history.get(s, [])
        if len(prev) > 8:  # a new conversation with the same system prompt
            prev = prev[:1]
        new = draw(st.integers(1, 4))
        keys = prev + [1000 * s + 10 * i + j for j in range(new)]
        extra = draw(st.integers(0, B - 1))
        out = draw(st.integers(1, 3 * B))
        history[s] = keys + [1000 * s + 10 * i + 5 + j for j in range(out // B)]
        t += draw(st.sampled_from([0.0, 0.001, 0.05]))
        requests.append(Request(timestamp=t * 1000, input_length=len(keys) * B + extra,
                                output_length=out, block_keys=keys, block_tokens=B,
                                session=s, line=i + 1))
    load = draw(st.sampled_from([Load("concurrency", 1), Load("concurrency", 3),
                                 Load("request-rate", math.inf), Load("request-rate", 50.0),
                                 Load("timestamps", 1.0)]))
    return setup, B, requests, load


@pytest.mark.slow
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_small_clusters(w: tuple[ClusterSetup, int, list[Request], Load]) -> None:
    from kvtool.serving.router import make_router

    setup, B, requests, load = w
    both(requests, setup, load, B, lambda: make_router(setup.router), B)


def test_cli_exact_steps_gives_the_same_reports() -> None:
    from tests.conftest import run, run_json

    trace = str(TRACES[0])
    cluster = str(REPO / "fixtures" / "clusters" / "gp7000-mini.toml")
    for args in (["replay", trace, "--simulate", "--cluster", cluster, "--concurrency", "8"],
                 ["replay", trace, "--simulate", "--dram", "300blk"]):
        assert run_json(*args, "--exact-steps") == run_json(*args)
    bad = run("replay", trace, "--simulate", "--no-times", "--exact-steps")
    assert bad.exit_code == 2 and "--no-times" in bad.stderr and "Traceback" not in bad.stderr
