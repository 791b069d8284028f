"""``kvtool plan TRACE``: the one-pass LRU curve equals replays; SHARDS estimates; the CLI."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtool.cache.replayer import CacheConfig, TierSpec, replay
from kvtool.plan.curve import TARGETS, lru_curve, sweep_capacities
from kvtool.trace.reader import read_trace
from kvtool.units import Capacity
from tests.conftest import FIXTURES, run, run_json
from tests.helpers.cache import requests_of, write_multi_turn
from tests.helpers.cli import one_error_line

FIXTURE_PATH = FIXTURES / "traces" / "multiturn-8x12.jsonl"
FIXTURE = str(FIXTURE_PATH)


@pytest.fixture
def shared_prompt(tmp_path: Path) -> Path:
    """Sessions sharing a system prompt, with a partial last block (input not a multiple
    of the block), so hit tokens are capped at the input length."""
    return write_multi_turn(tmp_path / "mt.jsonl", sessions=7, rounds=9, input_tokens=700,
                            output_tokens=130, block_tokens=256, system_prompt_tokens=600,
                            seed=5)


def _replayed(requests: list, capacities: list[int], policy: str = "lru") -> list[int]:
    configs = [CacheConfig([TierSpec("dram", Capacity.parse(f"{c}blk"), policy)])
               for c in capacities]
    return [r["hit_tokens"]["total"]
            for r in replay(requests, configs, block_tokens=requests[0].block_tokens)]


@pytest.mark.parametrize("trace", ["fixture", "shared_prompt"])
def test_lru_curve_equals_replay_at_every_sampled_size(trace: str, shared_prompt: Path) -> None:
    path = FIXTURE_PATH if trace == "fixture" else shared_prompt
    reqs = requests_of(path)
    curve = lru_curve(reqs)
    assert curve.exact
    caps = sorted({1, 2, 3, 5, 8, 13, 40, 100, 200, 299, 300, 301,
                   *(curve.capacity_for(f) for f in TARGETS),
                   *(curve.capacity_for(f) - 1 for f in TARGETS), curve.unique_blocks + 10})
    caps = [c for c in caps if c > 0]
    assert [curve.hit_tokens(c) for c in caps] == _replayed(reqs, caps)


def test_target_capacity_is_the_smallest_that_reaches_it() -> None:
    curve = lru_curve(requests_of(FIXTURE_PATH))
    for f in TARGETS:
        c = curve.capacity_for(f)
        assert curve.hit_tokens(c) >= f * curve.max_hit_tokens
        assert curve.hit_tokens(c - 1) < f * curve.max_hit_tokens
    # the maximum is the infinite cache's, as trace stats computes it independently
    from kvtool.trace.stats import trace_stats

    assert curve.max_hit_ratio == trace_stats(read_trace(FIXTURE))["max_token_hit_ratio"]


def test_mooncake_trace_equals_replay(tmp_path: Path) -> None:
    """A Mooncake-format trace (hash_ids, 512-token blocks) through the same reader."""
    gen = write_multi_turn(tmp_path / "g.jsonl", sessions=5, rounds=6, input_tokens=900,
                           output_tokens=100, block_tokens=512, seed=9)
    out = tmp_path / "mc.jsonl"
    assert run("trace", "convert", str(gen), "--to", "mooncake", "-o", str(out)).exit_code == 0
    reqs = requests_of(out)
    curve = lru_curve(reqs)
    caps = [1, 4, 9, 17, 33, 60]
    assert [curve.hit_tokens(c) for c in caps] == _replayed(reqs, caps)


def test_shards_sampling_estimates_the_curve() -> None:
    reqs = requests_of(FIXTURE_PATH)
    exact = lru_curve(reqs)
    sampled = lru_curve(reqs, max_tracked=exact.unique_blocks // 3)
    assert not sampled.exact and 0 < sampled.rate < 0.5
    assert sampled.unique_blocks == pytest.approx(exact.unique_blocks, rel=0.3)
    for f in (0.5, 0.9):
        assert sampled.capacity_for(f) == pytest.approx(exact.capacity_for(f), rel=0.3)
    # sampling never sees a block beyond the limit
    sampled_small = lru_curve(reqs, max_tracked=10)
    assert sampled_small.rate < sampled.rate


def test_plan_trace_json_and_plot(tmp_path: Path) -> None:
    png = tmp_path / "plan.png"
    doc = run_json("plan", FIXTURE, "--model", "deepseek-v4-flash", "--dtype", "fp8",
                   "--plot", str(png))
    assert doc["policy"] == "lru" and doc["exact"] is True
    assert doc["block_bytes"] == 1002240
    caps = [t["capacity_blocks"] for t in doc["targets"]]
    assert caps == sorted(caps) and [t["fraction_of_max"] for t in doc["targets"]] == list(TARGETS)
    for t in doc["targets"]:
        assert t["capacity_bytes"] == t["capacity_blocks"] * 1002240
        assert t["token_hit_ratio"] >= t["fraction_of_max"] * doc["max_token_hit_ratio"] - 1e-12
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plan_trace_target_equals_cli_replay() -> None:
    doc = run_json("plan", FIXTURE)
    t = doc["targets"][2]
    rep = run_json("replay", FIXTURE, "--simulate", "--dram", f"{t['capacity_blocks']}blk")
    assert rep["token_hit_ratio"] == t["token_hit_ratio"]


def test_sweep_of_lru_equals_the_one_pass_curve() -> None:
    doc = run_json("plan", FIXTURE, "--sweep", "6")
    one = lru_curve(requests_of(FIXTURE_PATH))
    assert [p["capacity_blocks"] for p in doc["curve"]] == sweep_capacities(one.unique_blocks, 6)
    for p in doc["curve"]:
        assert p["token_hit_ratio"] == one.hit_ratio(p["capacity_blocks"])


def test_a_policy_without_a_one_pass_curve_asks_for_a_sweep() -> None:
    one_error_line(run("plan", FIXTURE, "--policy", "radix"), "--sweep", "radix")
    doc = run_json("plan", FIXTURE, "--policy", "radix", "--sweep", "5")
    assert doc["policy"] == "radix" and len(doc["curve"]) == 5


def test_formula_and_trace_options_do_not_mix() -> None:
    one_error_line(run("plan", FIXTURE, "--sessions", "4"), "--sessions", "TRACE")
    one_error_line(run("plan", "--sessions", "4", "--plot", "x.png"), "--plot", "TRACE")
    one_error_line(run("plan", "--sessions", "4"), "--input-tokens", "kvtool plan TRACE")


def test_human_output_names_the_basis() -> None:
    result = run("plan", FIXTURE, "--block-bytes", "1MiB")
    assert result.exit_code == 0, result.stderr
    assert "exact: LRU stack distances" in result.stdout
    assert "99%" in result.stdout
