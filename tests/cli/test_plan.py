"""``kvtool plan`` through the CLI."""

from __future__ import annotations

import pytest

from kvtool.geometry import block_size
from kvtool.plan import Storage, Workload, plan
from kvtool.units import Capacity
from tests.conftest import REPO, run, run_json

REPORT = ["plan", "--sessions", "112", "--input-tokens", "109030", "--output-tokens", "5000",
          "--dram", "429.5GB", "--model", "deepseek-v4-flash", "--dtype", "fp8"]


def test_report_case_json() -> None:
    doc = run_json(*REPORT)
    assert round(doc["collapse_round"], 2) == 8.59
    assert round(doc["formula"]["R"], 2) == 8.59
    assert doc["eviction_round"] == 9
    terms = doc["formula"]["terms"]
    assert (terms["b"], terms["C"], terms["delta"], terms["M"]) == (3915.0, 112, 114030, 429.5e9)
    assert doc["storage"]["block_bytes"] == 1_002_240
    assert any("block rounding" in u for u in doc["formula"]["uses"])
    # Same as the library with the same inputs.
    size = block_size("deepseek-v4-flash", dtype="fp8")
    assert size is not None
    lib = plan(Workload(sessions=112, rounds=20, input_tokens=109030, output_tokens=5000), Storage(1_002_240,
                        size=size),
               dram=Capacity.parse("429.5GB")).to_dict()
    assert doc == lib


def test_block_bytes_equals_model() -> None:
    by_model = run_json(*REPORT)
    by_bytes = run_json(*REPORT[:-4], "--block-bytes", "1002240")
    assert by_bytes["collapse_round"] == by_model["collapse_round"]
    assert by_bytes["rounds"] == by_model["rounds"]


def test_watermark_percent_and_nvme() -> None:
    doc = run_json(*REPORT, "--watermark", "90%", "--nvme", "46.09TB", "--rounds", "50")
    assert round(doc["collapse_round"], 2) > 50  # 46 TB holds every round
    assert doc["cliff_round"] is None
    dram_only = doc["scenarios"]["without_nvme"]
    assert round(dram_only["collapse_round"], 2) == 7.73 and dram_only["cliff_round"] == 8
    # Round 50 hits round 49's stored context (whole blocks) and recomputes the new input.
    assert doc["steady_hit_ratio"] == pytest.approx(
        (49 * 114030 // 256 * 256) / (49 * 114030 + 109030))


def test_human_output_states_the_formula_terms() -> None:
    result = run(*REPORT)
    assert result.exit_code == 0, result.stderr
    out = result.stdout
    assert "R = h·M / (ρ·C·b·Δ)" in out and "R = 8.59" in out
    assert "terms used" in out and "block rounding" in out
    assert "collapse round" in out and "8.59" in out
    assert "not measurements" in out


def test_blocks_without_a_model() -> None:
    doc = run_json("plan", "--sessions", "16", "--input-tokens", "2000", "--output-tokens", "500",
                   "--dram", "2000blk", "--answer-kv", "next-round")
    assert doc["eviction_round"] == 14
    assert doc["rounds"][0]["footprint_bytes"] is None
    result = run("plan", "--sessions", "16", "--input-tokens", "2000", "--output-tokens", "500",
                 "--dram", "2000blk")
    assert result.exit_code == 0 and "blk" in result.stdout


@pytest.mark.parametrize(("extra", "field"), [
    (["--dram", "lots"], "--dram"),
    (["--dram", "-5GB"], "--dram"),
    (["--dram", "0"], "--dram"),
    (["--dram", "1GB", "--watermark", "150%"], "--watermark"),
    (["--dram", "1GB", "--block-bytes", "1MiB", "--model", "llama-3-8b"], "--block-bytes"),
    (["--dram", "1GB", "--model", "no-such-model"], "--model"),
    (["--dram", "1GB", "--dtype", "fp8"], "--dtype"),
    (["--dram", "1GB", "--block-bytes", "1MiB", "--replicas", "0"], "--replicas"),
    (["--dram", "1GB"], "--dram"),
])
def test_bad_values_are_one_line_exit_2(extra: list[str], field: str) -> None:
    result = run("plan", "--sessions", "4", "--input-tokens", "100", "--output-tokens", "10",
                 *extra)
    assert result.exit_code == 2
    assert result.stderr.startswith(f"kvtool: error: field '{field}': ")
    assert result.stderr.count("\n") == 1


def test_plan_predicts_the_replayed_collapse_of_the_fixture() -> None:
    """plan (answer KV stored when re-sent, as in a trace) vs kvtool replay, DRAM-only lru."""
    fixture = "fixtures/traces/multiturn-8x12.jsonl"  # 8 sessions × 12 rounds, S=2048, B=256
    predicted = run_json("plan", "--sessions", "8", "--rounds", "12", "--input-tokens", "1024",
                         "--output-tokens", "256", "--system-prompt-tokens", "2048",
                         "--dram", "300blk", "--answer-kv", "next-round")
    replayed = run_json("replay", "--simulate", str(REPO / fixture), "--dram", "300blk", "--policy", "lru")
    assert predicted["cliff_round"] is not None and replayed["cliff_round"] is not None
    assert abs(predicted["cliff_round"] - replayed["cliff_round"]) <= 1
    # Before the onset nothing is evicted, so prediction and replay agree exactly.
    onset = predicted["eviction_round"]
    for p_row, r_row in zip(predicted["rounds"][:onset - 1], replayed["rounds"], strict=False):
        assert p_row["hit_ratio"]["lru"] == pytest.approx(r_row["token_hit_ratio"], abs=1e-12)
