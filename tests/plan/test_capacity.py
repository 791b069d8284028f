"""Capacity planning against hand-computed cases and the report's numbers."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from kvtool.errors import UsageError
from kvtool.geometry import block_size, resolve
from kvtool.plan import Storage, Workload, plan
from kvtool.trace import read_trace
from kvtool.trace.gen import MultiTurn, multi_turn
from kvtool.trace.stats import trace_stats
from kvtool.trace.writer import write_records
from kvtool.units import Capacity

GB = Capacity.parse


def test_hand_computed_small_case() -> None:
    # C=4 sessions, Δ = 192 + 64 = 256 tokens = one block per session per round, s = 1000 B:
    # F_r = 4000·r bytes; M = 10 000 B → crosses during round 3, at 2 + 2000/4000 = 2.5.
    p = plan(Workload(sessions=4, rounds=5, input_tokens=192, output_tokens=64), Storage(1000),
                      dram=GB("10000"))
    d = p.to_dict()
    assert [row["footprint_bytes"] for row in d["rounds"]] == [4000, 8000, 12000, 16000, 20000]
    assert d["formula"]["R"] == pytest.approx(2.5)
    assert d["collapse_round"] == pytest.approx(2.5)
    assert d["eviction_round"] == 3
    # Round 2 hits the 256 stored tokens of 448; round 3: half the sessions (those served
    # before the crossing) hit 512 of 704 tokens, the rest nothing; then nothing.
    lru = [row["hit_ratio"]["lru"] for row in d["rounds"]]
    assert lru == pytest.approx([0, 256 / 448, 0.5 * 512 / 704, 0, 0])
    assert d["cliff_round"] == 3
    # Best case keeps ⌊10000 / (1000·r)⌋ of 4 sessions: r=3 → 3, r=4 → 2, r=5 → 2.
    best = [row["hit_ratio"]["best"] for row in d["rounds"]]
    assert best == pytest.approx([0, 256 / 448, 0.75 * 512 / 704, 0.5 * 768 / 960,
                                  0.5 * 1024 / 1216])
    assert d["capacity_needed"]["bytes"] == 20000
    # Under lru a missing session rewrites its whole chain (docs/plan.md): half the sessions in
    # round 3 (4·(0.5·1 + 0.5·3) blocks), all of them from round 4 (4·r blocks).
    assert [row["lru_writes_bytes"] for row in d["rounds"]] == pytest.approx(
        [4000, 4000, 8000, 16000, 20000])
    assert d["tiers"]["dram"]["shortfall_bytes"] == 10000


def test_system_prompt_is_stored_once_and_rounded_to_blocks() -> None:
    # S = 600 tokens at B = 256: 2 shared full blocks; the block holding the boundary is
    # per session. L_r = 600 + 256·r → U_r = 2 + 4·(⌊L_r/256⌋ − 2).
    w = Workload(sessions=4, rounds=3, input_tokens=200, output_tokens=56, system_prompt_tokens=600)
    assert [w.unique_blocks(r) for r in (1, 2, 3)] == [2 + 4 * 1, 2 + 4 * 2, 2 + 4 * 3]
    d = plan(w, Storage(1000), dram=GB("9000")).to_dict()
    # F = 6000, 10000, …: crosses 9000 in round 2 at 1 + 3000/4000.
    assert d["collapse_round"] == pytest.approx(1.75)
    # Without rounding or the system prompt the closed form says 9000/(4·1000) = 2.25.
    assert d["formula"]["R"] == pytest.approx(2.25)
    # Round 1: sessions 2..4 hit the 512 shared tokens of 800.
    assert d["rounds"][0]["hit_ratio"]["no_eviction"] == pytest.approx(0.75 * 512 / 800)
    # After the cascade a session still hits the always-recent shared blocks.
    assert d["rounds"][2]["hit_ratio"]["lru"] == pytest.approx(512 / 1312)


@pytest.mark.parametrize(("h", "rho", "expected"), [(1.0, 1, 2.5), (0.9, 1, 2.25),
                                                    (1.0, 2, 1.25), (0.8, 2, 1.0)])
def test_watermark_and_replicas(h: float, rho: int, expected: float) -> None:
    d = plan(Workload(sessions=4, rounds=20, input_tokens=192, output_tokens=64), Storage(1000, rho, h),
                      dram=GB("10000")).to_dict()
    assert d["formula"]["R"] == pytest.approx(expected)
    assert d["collapse_round"] == pytest.approx(expected)
    terms = d["formula"]["terms"]
    assert (terms["h"], terms["rho"], terms["t"], terms["C"], terms["delta"]) == (h, rho, 1, 4,
                                                                                  256)


@pytest.mark.parametrize(("model", "tp", "s", "t"), [
    ("llama-3-70b", 1, 83_886_080, 1), ("llama-3-70b", 8, 83_886_080 // 8, 1),
    ("deepseek-v3", 1, None, 1), ("deepseek-v3", 8, None, 8)])
def test_sizes_are_per_rank(model: str, tp: int, s: int | None, t: int) -> None:
    """A tier of M bytes holds M / s blocks with s one rank's object: GQA sharded over 8 ranks
    fits 8x the blocks, MLA (every rank holds a full copy) the same number."""
    size = block_size(model, tp=tp)
    assert size is not None
    assert size.per_rank_duplication == t and (s is None or size.block_bytes == s)
    one = block_size(model)
    assert one is not None and size.copy_bytes == one.copy_bytes
    w = Workload(sessions=4, rounds=20, input_tokens=192, output_tokens=64)
    d = plan(w, Storage(size.block_bytes, size=size), dram=GB("10GB")).to_dict()
    d1 = plan(w, Storage(one.block_bytes, size=one), dram=GB("10GB")).to_dict()
    assert d["formula"]["R"] == pytest.approx(d1["formula"]["R"] * tp / t)
    assert d["formula"]["terms"]["t"] == t
    assert d["storage"]["block_size"] == size.to_dict()


def test_write_policy_sets_the_hierarchy_capacity() -> None:
    w = Workload(sessions=4, rounds=20, input_tokens=192, output_tokens=64)
    through = plan(w, Storage(1000), gpu=GB("4000"), dram=GB("10000"), nvme=GB("30000"))
    back = plan(w, Storage(1000, write_policy="write-back"), gpu=GB("4000"), dram=GB("10000"),
                nvme=GB("30000"))
    assert through.to_dict()["collapse_round"] == pytest.approx(7.5)   # max = 30 000
    assert back.to_dict()["collapse_round"] == pytest.approx(11.0)     # sum = 44 000
    d = through.to_dict()
    assert d["scenarios"]["without_nvme"]["collapse_round"] == pytest.approx(2.5)
    assert d["scenarios"]["with_nvme"]["nvme_sized_to_need"] is False
    assert d["tiers"]["gpu"]["holds_rounds"] == pytest.approx(1.0)


def test_nvme_sized_to_need_keeps_the_no_eviction_ratio() -> None:
    d = plan(Workload(sessions=4, rounds=10, input_tokens=192, output_tokens=64), Storage(1000),
                      dram=GB("10000")).to_dict()
    nv = d["scenarios"]["with_nvme"]
    assert nv["nvme_sized_to_need"] is True
    assert nv["tiers"]["nvme"]["bytes"] == d["capacity_needed"]["bytes"] == 40000
    assert nv["cliff_round"] is None
    assert nv["steady_hit_ratio"]["lru"] == nv["steady_hit_ratio"]["no_eviction"]
    # 1 − new/total: round 10 re-sends 9·256 of 9·256 + 192 tokens.
    assert nv["steady_hit_ratio"]["lru"] == pytest.approx(2304 / 2496)
    assert d["scenarios"]["without_nvme"]["steady_hit_ratio"]["lru"] == 0


def test_unbounded_dram_never_collapses() -> None:
    d = plan(Workload(sessions=4, rounds=20, input_tokens=192, output_tokens=64), Storage(1000),
                      dram=GB("inf")).to_dict()
    assert d["collapse_round"] is None and d["eviction_round"] is None
    assert d["cliff_round"] is None and d["formula"]["R"] is None


def test_capacities_in_blocks_without_geometry() -> None:
    d = plan(Workload(sessions=16, rounds=20, input_tokens=2000, output_tokens=500), Storage(None),
                      dram=GB("2000blk")).to_dict()
    # Δ = 2500 tokens; U_r = 16·⌊2500 r/256⌋: U_12 = 16·117 = 1872, U_13 = 16·126 = 2016.
    assert d["eviction_round"] == 13
    assert d["collapse_round"] == pytest.approx(12 + 128 / 144)
    assert d["rounds"][0]["footprint_bytes"] is None
    assert d["rounds"][0]["footprint_blocks"] == 16 * 9
    with pytest.raises(UsageError) as err:
        plan(Workload(sessions=16, rounds=20, input_tokens=2000, output_tokens=500), Storage(None),
                      dram=GB("1GB"))
    assert err.value.field == "dram"


def test_report_sanity_check() -> None:
    """docs/plan.md, the report's case: 429.5 GB, 3915 B/token, C = 112, Δ ≈ 114 030 → R = 8.59."""
    geo = resolve("deepseek-v4-flash", dtype="fp8")
    assert (geo.copy_block_bytes, geo.bytes_per_token) == (1_002_240, 3915.0)
    w = Workload(sessions=112, rounds=20, input_tokens=109_030, output_tokens=5_000)
    d = plan(w, Storage(geo.copy_block_bytes), dram=GB("429.5GB")).to_dict()
    assert d["formula"]["R"] == pytest.approx(429.5e9 / (112 * 3915 * 114_030))
    assert round(d["formula"]["R"], 2) == 8.59
    assert round(d["collapse_round"], 2) == 8.59
    assert d["eviction_round"] == 9
    # Round-1 writes are the report's ~50 GB.
    assert d["rounds"][0]["writes_bytes"] == pytest.approx(50e9, rel=0.002)
    # Mooncake's 0.90 watermark moves the onset into round 8, where the report saw it.
    d90 = plan(w, Storage(geo.copy_block_bytes, watermark=0.9), dram=GB("429.5GB")).to_dict()
    assert round(d90["collapse_round"], 2) == 7.73
    assert d90["eviction_round"] == 8 and d90["cliff_round"] == 8


@pytest.mark.parametrize(("c", "n", "m", "s", "b"), [(4, 300, 100, 600, 64), (3, 50, 70, 0, 16),
                                                     (5, 256, 0, 256, 256)])
def test_no_eviction_curve_matches_trace_stats_of_the_generated_workload(
        tmp_path: Path, c: int, n: int, m: int, s: int, b: int) -> None:
    """The plan's infinite-cache curve equals what trace stats measures on `trace gen`."""
    rounds = 6
    write_records(multi_turn(MultiTurn(c, rounds, n, m, s, b, form="hash_ids")),
                  tmp_path / "t.jsonl")
    stats = trace_stats(read_trace(tmp_path / "t.jsonl"))
    d = plan(Workload(sessions=c, rounds=rounds, input_tokens=n, output_tokens=m, system_prompt_tokens=s,
                      block_tokens=b, answer_kv="next-round"), Storage(None),
             dram=GB("inf")).to_dict()
    measured = [row["max_token_hit_ratio"] for row in stats["per_round"]]
    predicted = [row["hit_ratio"]["no_eviction"] for row in d["rounds"]]
    assert predicted == pytest.approx(measured, abs=1e-12)
    assert d["rounds"][-1]["unique_blocks"] == stats["unique_blocks"]
    assert d["scenarios"]["without_nvme"]["token_hit_ratio"]["no_eviction"] == pytest.approx(
        stats["max_token_hit_ratio"], abs=1e-12)


@pytest.mark.parametrize(("make", "field"), [
    (lambda: Workload(sessions=0, rounds=20, input_tokens=1, output_tokens=1), "sessions"),
    (lambda: Workload(sessions=1, rounds=20, input_tokens=-1, output_tokens=1), "input_tokens"),
    (lambda: Workload(sessions=1, rounds=20, input_tokens=0, output_tokens=0), "input_tokens"),
    (lambda: Workload(sessions=1, rounds=0, input_tokens=1, output_tokens=1), "rounds"),
    (lambda: Workload(sessions=1, rounds=100_001, input_tokens=1, output_tokens=1), "rounds"),
    (lambda: Workload(sessions=1, rounds=20, input_tokens=1, output_tokens=1, answer_kv="never"),
                      "answer_kv"),
    (lambda: Storage(0), "block_bytes"),
    (lambda: Storage(1, replicas=0), "replicas"),
    (lambda: Storage(1, watermark=1.5), "watermark"),
    (lambda: plan(Workload(sessions=1, rounds=20, input_tokens=1, output_tokens=1), Storage(1), dram=GB("0")),
                           "dram"),
])
def test_bad_values_name_the_option(make: object, field: str) -> None:
    with pytest.raises(UsageError) as err:
        make()  # type: ignore[operator]
    assert err.value.field == field


def test_onset_search_finds_far_rounds() -> None:
    # R ≈ 195.9 (docs/plan.md, Δ = 5 000 output tokens only).
    d = plan(Workload(sessions=112, rounds=3, input_tokens=0, output_tokens=5000), Storage(1_002_240),
                      dram=GB("429.5GB")).to_dict()
    assert d["formula"]["R"] == pytest.approx(195.9, abs=0.05)
    assert math.ceil(d["collapse_round"]) == d["eviction_round"]
    assert abs(d["collapse_round"] - d["formula"]["R"]) < 1
