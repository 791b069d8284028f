"""The serving model end to end: loads, properties, P/D split, sweeps and the CLI."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from kvtool.serving.load import Load
from kvtool.serving.run import ServingSettings, run_serving, write_csv
from kvtool.serving.setup import build_setup
from kvtool.serving.sim import Simulation
from kvtool.trace import read_trace
from kvtool.trace.writer import write_records
from tests.conftest import run as run_cli

REPO = Path(__file__).resolve().parents[2]
MULTITURN = REPO / "fixtures" / "traces" / "multiturn-8x12.jsonl"

ENGINE = """
[[engine]]
gpu = "a100-sxm"
model = "llama-3-8b"
tp = 1
"""


def cluster(tmp: Path, body: str, name: str = "c.toml") -> str:
    p = tmp / name
    p.write_text(body)
    return str(p)


def tiered(nic: float = 25.0, target: float = 5.0, engines: int = 1, dram: str = "2000blk",
           nvme: str = "100000blk", caching: bool = True, blocks: int | None = 200) -> str:
    eng = (f'[[engine]]\nnode = "n0"\ncount = {engines}\ngpu = "a100-sxm"\n'
           f'model = "llama-3-8b"\ntp = 1\n'
           + (f"num_gpu_blocks = {blocks}\n" if blocks else "")
           + ("" if caching else "enable_prefix_caching = false\n"))
    return (f'name = "t"\nrouter = "kv-aware"\n[[node]]\nname = "n0"\nnic_gbps = {nic}\n'
            f'dram = "{dram}"\n' + eng
            + f'[nvme]\ncapacity = "{nvme}"\n[[nvme.target]]\nname = "t0"\n'
            f"read_gbps = {target}\nwrite_gbps = {target}\n")


def simulate(path: str, load: Load, trace: Path = MULTITURN) -> Simulation:
    reader = read_trace(str(trace))
    reqs = list(reader)
    built = build_setup(path, block_tokens=reader.block_tokens)
    sim = Simulation(reqs, built.setup, load, block_tokens=built.block_tokens,
                     router=built.make_router(), trace_block_tokens=reader.block_tokens)
    sim.run()
    return sim


def test_smallest_cluster_file_serves_every_request(tmp_path: Path) -> None:
    doc = run_serving(ServingSettings(str(MULTITURN), clusters=(cluster(tmp_path, ENGINE),),
                                      loads=(Load("concurrency", 4),)))
    s = doc["serving"]
    assert s["completed"] == 96 and s["failed"] == 0
    for key in ("duration", "request_throughput", "output_throughput", "total_token_throughput"):
        assert s[key] > 0
    for m in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "p90", "p99"):
            assert f"{stat}_{m}_ms" in s
    assert s["median_ttft_ms"] <= s["p99_ttft_ms"] <= s["mean_e2el_ms"] * 96
    assert doc["runs"][0]["basis"] == "simulated"


def test_closed_loop_keeps_at_most_c_requests_in_flight(tmp_path: Path) -> None:
    sim = simulate(cluster(tmp_path, ENGINE), Load("concurrency", 3))
    events = sorted([(s.arrival, 1) for s in sim.done] + [(s.finish, -1) for s in sim.done],
                    key=lambda e: (e[0], e[1]))
    level = peak = 0
    for _t, d in events:
        level += d
        peak = max(peak, level)
    assert peak == 3
    # a session's next round is sent only after its previous one ended
    by_session: dict[object, list[tuple[float, float]]] = {}
    for s in sim.done:
        by_session.setdefault(s.session, []).append((s.arrival, s.finish))
    for rounds in by_session.values():
        rounds.sort()
        for (_a, f), (a2, _f2) in itertools.pairwise(rounds):
            assert a2 >= f


def test_zero_size_tiers_and_no_prefix_cache_mean_recompute_only(tmp_path: Path) -> None:
    path = cluster(tmp_path, tiered(dram="0", nvme="0", caching=False))
    sim = simulate(path, Load("concurrency", 2))
    cache = sim.report()["cache"]
    assert cache["gpu_hit_tokens"] == 0 and cache["external_hit_tokens"] == 0
    assert cache["recompute_tokens"] == cache["prompt_tokens"] > 0


def test_tiers_below_the_gpu_serve_hits_the_gpu_pool_lost(tmp_path: Path) -> None:
    cache = simulate(cluster(tmp_path, tiered()), Load("concurrency", 8)).report()["cache"]
    assert cache["external_hit_tokens"] > 0
    assert cache["bytes_loaded"] and cache["bytes_stored"]["nvme"] > 0


@pytest.mark.parametrize("slow,fast", [((5.0, 1.0), (25.0, 5.0)), ((25.0, 0.5), (25.0, 50.0)),
                                       ((1.0, 5.0), (100.0, 5.0))])
def test_more_bandwidth_is_never_slower(tmp_path: Path, slow: tuple[float, float],
                                        fast: tuple[float, float]) -> None:
    a = simulate(cluster(tmp_path, tiered(*slow), "a.toml"), Load("concurrency", 8)).report()
    b = simulate(cluster(tmp_path, tiered(*fast), "b.toml"), Load("concurrency", 8)).report()
    sa, sb = a["serving"], b["serving"]
    assert sb["duration"] <= sa["duration"] * (1 + 1e-9)
    assert sb["mean_ttft_ms"] <= sa["mean_ttft_ms"] * (1 + 1e-9)


def test_more_engines_never_lower_saturated_throughput(tmp_path: Path) -> None:
    out = []
    for n in (1, 2, 4):
        path = cluster(tmp_path, tiered(engines=n, blocks=None), f"e{n}.toml")
        out.append(simulate(path, Load("request-rate", float("inf"))).report()["serving"])
    tput = [s["output_throughput"] for s in out]
    assert tput == sorted(tput) and tput[-1] > tput[0]


def test_open_loop_poisson_is_seeded_and_ignores_completions(tmp_path: Path) -> None:
    path = cluster(tmp_path, ENGINE)
    a = simulate(path, Load("request-rate", 2.0, seed=1))
    b = simulate(path, Load("request-rate", 2.0, seed=1))
    c = simulate(path, Load("request-rate", 2.0, seed=2))
    arr = lambda sim: sorted(s.arrival for s in sim.done)  # noqa: E731
    assert arr(a) == arr(b) != arr(c)
    assert arr(a)[0] == 0.0 and len(arr(a)) == 96


def test_trace_timestamps_with_speedup(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    write_records([{"timestamp": 1000.0 * i, "input_length": 300, "output_length": 4,
                         "hash_ids": [i]} for i in range(5)], trace)
    path = cluster(tmp_path, ENGINE)
    sim = simulate(path, Load("timestamps", 2.0), trace=trace)
    assert sorted(s.arrival for s in sim.done) == [0.0, 0.5, 1.0, 1.5, 2.0]


def test_prefill_decode_split_moves_the_kv(tmp_path: Path) -> None:
    body = ('[[node]]\nname = "p"\nnic_gbps = 25\n[[node]]\nname = "d"\nnic_gbps = 25\n'
            '[[engine]]\nnode = "p"\nrole = "prefill"\ngpu = "a100-sxm"\nmodel = "llama-3-8b"\n'
            '[[engine]]\nnode = "d"\nrole = "decode"\ngpu = "a100-sxm"\nmodel = "llama-3-8b"\n')
    sim = simulate(cluster(tmp_path, body), Load("concurrency", 4))
    doc = sim.report()
    assert doc["serving"]["completed"] == 96
    assert doc["cache"]["pd_transfer_bytes"] > 0
    assert doc["links"]["nic/p"]["up"]["bytes"] == doc["links"]["nic/d"]["down"]["bytes"] > 0
    prefill, decode = doc["engines"]
    assert prefill["decode_tokens"] == 0 and decode["prefill_tokens"] == 0
    assert all(s.num_output == s.target_tokens for s in sim.done)


def test_sweep_one_run_per_load_and_csv(tmp_path: Path) -> None:
    loads = (Load("concurrency", 1), Load("concurrency", 4), Load("concurrency", 16))
    doc = run_serving(ServingSettings(str(MULTITURN), clusters=(cluster(tmp_path, ENGINE),),
                                      loads=loads))
    assert [r["load"]["value"] for r in doc["runs"]] == [1, 4, 16]
    tput = [r["serving"]["output_throughput"] for r in doc["runs"]]
    assert tput[0] < tput[1] <= tput[2]
    write_csv(doc, tmp_path / "s.csv")
    assert len((tmp_path / "s.csv").read_text().splitlines()) == 4


def test_cli_json_and_bad_cluster_file(tmp_path: Path) -> None:
    path = cluster(tmp_path, ENGINE)
    res = run_cli("replay", str(MULTITURN), "--simulate", "--cluster", path,
                  "--sweep", "concurrency=1,8", "--json", "--csv", str(tmp_path / "s.csv"),
                  "--plot", str(tmp_path / "s.png"))
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert len(doc["runs"]) == 2 and (tmp_path / "s.png").stat().st_size > 1000
    bad = cluster(tmp_path, ENGINE.replace("tp = 1", "tp = 0"), "bad.toml")
    res = run_cli("replay", str(MULTITURN), "--simulate", "--cluster", bad)
    assert res.exit_code == 2
    assert "bad.toml" in res.stderr and "tp" in res.stderr and "Traceback" not in res.stderr
    res = run_cli("replay", str(MULTITURN), "--simulate", "--request-rate", "2")
    assert res.exit_code == 2 and "--cluster" in res.stderr


DATA_CLUSTER = """
name = "dm"
block_tokens = 16
router = "kv-aware"
[[node]]
name = "n0"
dram = "150blk"
[[engine]]
node = "n0"
count = 2
gpu = "a100-sxm"
model = "llama-3-8b"
num_gpu_blocks = 100
[nvme]
capacity = "1500blk"
[[nvme.target]]
name = "t0"
read_gbps = 5
write_gbps = 5
"""


def small_trace(tmp: Path) -> Path:
    out = tmp / "small.jsonl"
    res = run_cli("trace", "gen", "--sessions", "6", "--rounds", "4", "--input-tokens", "256",
                  "--output-tokens", "32", "-o", str(out))
    assert res.exit_code == 0, res.stderr
    return out


@pytest.mark.slow
def test_data_mode_moves_and_checks_real_bytes_in_simulated_order(tmp_path: Path) -> None:
    trace = small_trace(tmp_path)
    path = cluster(tmp_path, DATA_CLUSTER)
    img = tmp_path / "nvme.img"
    res = run_cli("--json", "replay", str(trace), "--cluster", path, "--concurrency", "3",
                  "--nvme", str(img))
    assert res.exit_code == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["mode"] == "data"
    run = doc["runs"][0]
    data = run["data"]
    assert data["verified_blocks"] > 0 and data["corrupt_blocks"] == 0 and data["lost_blocks"] == 0
    # every block loaded from a tier in the model was read and checked in data mode
    blocks_loaded = sum(run["cache"]["blocks_loaded"].values())
    assert data["verified_blocks"] == blocks_loaded
    # and every block the model stored was written, into the tier it names
    for tier, n in run["cache"]["blocks_stored"].items():
        promoted = run["cache"]["blocks_promoted"].get(tier, 0)
        assert 0 < data["tiers"][tier]["blocks_written"] <= n + promoted
    assert data["tiers"]["nvme"]["blocks_written"] > 0
    # the simulated report is the same as --simulate's: bytes only follow the clock
    sim = run_cli("--json", "replay", str(trace), "--cluster", path, "--concurrency", "3",
                  "--simulate")
    assert json.loads(sim.stdout)["runs"][0]["serving"] == run["serving"]


@pytest.mark.slow
def test_data_mode_finds_a_corrupted_block_and_never_serves_it(tmp_path: Path) -> None:
    from kvtool.replay.servingdata import open_cluster_data

    trace = small_trace(tmp_path)
    path = cluster(tmp_path, DATA_CLUSTER)
    reader = read_trace(str(trace))
    built = build_setup(path, block_tokens=reader.block_tokens)
    data = open_cluster_data(built, seed=3, nvme_place=str(tmp_path / "n.img"))
    real_store = data.on_store

    def corrupting_store(tier: str, node: str | None, keys: list[int], engine: int) -> None:
        real_store(tier, node, keys, engine)
        if tier == "dram" and keys:
            row = data.tiers[("dram", node)].row(keys[0])  # type: ignore[attr-defined]
            row[100] ^= 0xFF   # the medium flips a byte after the write

    data.on_store = corrupting_store  # type: ignore[method-assign]
    try:
        sim = Simulation(list(reader), built.setup, Load("concurrency", 3),
                         block_tokens=built.block_tokens, router=built.make_router(),
                         trace_block_tokens=reader.block_tokens, backend=data)
        sim.run()
        result = data.result()
    finally:
        data.close()
    assert result["corrupt_blocks"] > 0
    assert all(p["kind"] == "corrupt" and p["tier"] == "dram" for p in result["problems"])
    cache = sim.report()["cache"]
    # never served: each failed block and what followed it was recomputed, the stale copy
    # rewritten on the next store
    assert cache["recomputed_after_check_blocks"] >= result["corrupt_blocks"]
    assert cache["repaired_blocks"] > 0
