"""The report's phenomenon at laptop scale (docs/example-collapse.md), asserted qualitatively
on a small generated multi-turn workload: no timing, only hit ratios, rounds and writes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvtool.cache import CacheConfig, TierSpec, replay
from kvtool.units import Capacity
from tests.conftest import run_json
from tests.helpers.cache import requests_of, write_multi_turn

C, ROUNDS, N, M, B = 8, 14, 1536, 512, 256
DRAM = 512  # blocks: the plan predicts a collapse near round 8


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    path = write_multi_turn(tmp_path_factory.mktemp("ex") / "mt.jsonl", sessions=C,
                            rounds=ROUNDS, input_tokens=N, output_tokens=M, block_tokens=B,
                            seed=7)
    cap = Capacity.parse(f"{DRAM}blk")
    configs = [CacheConfig([TierSpec("dram", cap, p)], label=p)
               for p in ("lru", "lru-tail-first", "radix", "prefix-fair", "oracle")]
    configs.append(CacheConfig([TierSpec("dram", Capacity.parse(f"{DRAM // 8}blk")),
                                TierSpec("nvme", Capacity.parse("inf"))], label="dram/8+nvme"))
    out = replay(requests_of(path), configs, block_tokens=B)
    return {r["label"]: r for r in out}


def ratio(res: dict[str, Any], rnd: int) -> float:
    return next(r["token_hit_ratio"] for r in res["rounds"] if r["round"] == rnd)


def written(res: dict[str, Any], rnd: int) -> int:
    r = next(r for r in res["rounds"] if r["round"] == rnd)
    return sum(r["blocks_written"].values())


def test_lru_collapses_within_one_round_of_the_plan(results: dict[str, dict[str, Any]]) -> None:
    plan = run_json("plan", "--sessions", C, "--input-tokens", N, "--output-tokens", M,
                    "--dram", f"{DRAM}blk", "--block-tokens", B, "--answer-kv", "next-round")
    predicted = plan["collapse_round"]
    cliff = results["lru"]["cliff_round"]
    assert cliff is not None and abs(cliff - predicted) <= 1, (cliff, predicted)
    assert ratio(results["lru"], ROUNDS) < 0.05      # the cliff, not a slope


def test_writes_climb_after_the_collapse(results: dict[str, dict[str, Any]]) -> None:
    lru = results["lru"]
    cliff = lru["cliff_round"]
    before = written(lru, cliff - 1)
    assert written(lru, cliff + 1) > 3 * before
    assert written(lru, ROUNDS) > written(lru, cliff + 1)   # and keep climbing


def test_small_dram_plus_large_nvme_keeps_the_steady_ratio(
        results: dict[str, dict[str, Any]]) -> None:
    res = results["dram/8+nvme"]
    assert res["cliff_round"] is None
    total = N * ROUNDS + M * (ROUNDS - 1)               # last round's input
    assert ratio(res, ROUNDS) == pytest.approx(1 - (N + M) / total, abs=0.01)
    assert res["hit_tokens"]["nvme"] > 0


def test_tail_first_and_radix_collapse_differently(results: dict[str, dict[str, Any]]) -> None:
    lru = results["lru"]
    cliff = lru["cliff_round"]
    for name in ("lru-tail-first", "radix"):
        res = results[name]
        assert res["cliff_round"] is not None            # they collapse too (docs/plan.md)…
        assert ratio(res, cliff) > ratio(lru, cliff)     # …but keep prefixes longer
        assert res["recompute_tokens"] < lru["recompute_tokens"]


def test_kvtool_policy_beats_lru_and_matches_the_oracle(
        results: dict[str, dict[str, Any]]) -> None:
    fair, lru, oracle = results["prefix-fair"], results["lru"], results["oracle"]
    assert fair["cliff_round"] is None
    assert fair["token_hit_ratio"] > lru["token_hit_ratio"] + 0.2
    assert ratio(fair, ROUNDS) > 0.3
    assert fair["token_hit_ratio"] >= 0.95 * oracle["token_hit_ratio"]
    assert oracle["token_hit_ratio"] > lru["token_hit_ratio"]
    assert sum(fair["blocks_written"].values()) < sum(lru["blocks_written"].values())


def test_example_doc_numbers_exist() -> None:
    doc = Path(__file__).resolve().parents[2] / "docs" / "example-collapse.md"
    text = doc.read_text()
    assert "kvtool replay" in text and "kvtool plan" in text and "prefix-fair" in text


def test_prefix_fair_window_must_cover_the_sessions(tmp_path: Path) -> None:
    path = write_multi_turn(tmp_path / "mt.jsonl", sessions=C, rounds=ROUNDS, input_tokens=N,
                            output_tokens=M, block_tokens=B, seed=7)
    cap = Capacity.parse(f"{DRAM}blk")
    narrow, wide = replay(requests_of(path), [
        CacheConfig([TierSpec("dram", cap, "prefix-fair", window=C // 4)]),
        CacheConfig([TierSpec("dram", cap, "prefix-fair", window=C)])], block_tokens=B)
    assert narrow["cliff_round"] is not None and wide["cliff_round"] is None
    assert wide["token_hit_ratio"] > narrow["token_hit_ratio"]
