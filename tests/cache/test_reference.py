"""The engine against an independent single-tier LRU model, and against the theoretical
maximum, on the public Mooncake traces and on generated traces (exact agreement)."""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable
from pathlib import Path

import pytest

from kvtool.cache import CacheConfig, TierSpec, replay
from kvtool.trace import Request, read_trace
from kvtool.trace.gen import RandomPrompts, random_prompts
from kvtool.units import Capacity
from tests.helpers.cache import requests_of, write_multi_turn


def reference_lru(requests: Iterable[Request], capacity: float, block_tokens: int
                  ) -> tuple[int, int, dict[int, tuple[int, int]]]:
    """A minimal head-first LRU written independently of the engine: last-use stamps in a
    dict, victims from a lazy min-heap of (stamp, key). Returns (hit, input, per round)."""
    stamp: dict[int, int] = {}
    heap: list[tuple[int, int]] = []
    clock = hit = total = 0
    rounds: dict[int, tuple[int, int]] = {}
    for r in requests:
        k = 0
        while k < len(r.block_keys) and r.block_keys[k] in stamp:
            k += 1
        h = min(k * block_tokens, r.input_length)
        hit += h
        total += r.input_length
        a, b = rounds.get(r.report_round, (0, 0))
        rounds[r.report_round] = (a + h, b + r.input_length)
        for key in r.block_keys:
            clock += 1
            stamp[key] = clock
            heapq.heappush(heap, (clock, key))
        while len(stamp) > capacity:
            t, key = heapq.heappop(heap)
            if stamp.get(key) == t:
                del stamp[key]
    return hit, total, rounds


def theoretical_max(requests: Iterable[Request], block_tokens: int) -> float:
    """Infinite cache, from the definition: the leading blocks seen in any earlier request."""
    seen: set[int] = set()
    hit = total = 0
    for r in requests:
        k = 0
        while k < len(r.block_keys) and r.block_keys[k] in seen:
            k += 1
        hit += min(k * block_tokens, r.input_length)
        total += r.input_length
        seen.update(r.block_keys)
    return hit / total


def engine(requests: list[Request], capacity: str, block_tokens: int, policy: str = "lru"
           ) -> dict:
    cfg = CacheConfig([TierSpec("dram", Capacity.parse(capacity), policy)])
    [res] = replay(requests, [cfg], block_tokens=block_tokens)
    return res


def check_agreement(requests: list[Request], capacity_blocks: int, block_tokens: int) -> None:
    hit, total, rounds = reference_lru(requests, capacity_blocks, block_tokens)
    res = engine(requests, f"{capacity_blocks}blk", block_tokens)
    assert res["hit_tokens"]["total"] == hit
    assert res["input_tokens"] == total
    assert res["recompute_tokens"] == total - hit
    assert {r["round"]: (r["hit_tokens"]["total"], r["input_tokens"]) for r in res["rounds"]} \
        == rounds


@pytest.mark.slow
@pytest.mark.parametrize("name", ["conversation_trace.jsonl", "synthetic_trace.jsonl"])
def test_mooncake_traces_match_reference_lru(mooncake_traces: Path, name: str) -> None:
    requests = list(read_trace(mooncake_traces / name, fmt="mooncake", block_tokens=512))
    for blocks in (3_000_000 // 512, 1000):
        check_agreement(requests, blocks, 512)


@pytest.mark.slow
def test_mooncake_infinite_capacity_is_theoretical_max_and_3m_tokens_is_lower(
        mooncake_traces: Path) -> None:
    requests = list(read_trace(mooncake_traces / "conversation_trace.jsonl", fmt="mooncake",
                               block_tokens=512))
    best = theoretical_max(requests, 512)
    inf = engine(requests, "inf", 512)
    assert inf["token_hit_ratio"] == pytest.approx(best, abs=0, rel=1e-15)
    assert inf["evictions"]["dram"] == 0
    small = engine(requests, "3000000tok", 512)
    assert small["tiers"][0]["capacity_blocks"] == 5859
    assert small["token_hit_ratio"] < best
    assert math.isclose(best, 0.3736237491291324, rel_tol=1e-12)


@pytest.mark.parametrize("capacity", [40, 200, 1000])
def test_generated_multi_turn_matches_reference_lru(tmp_path: Path, capacity: int) -> None:
    path = write_multi_turn(tmp_path / "mt.jsonl", sessions=6, rounds=8, input_tokens=700,
                            output_tokens=300, system_prompt_tokens=512, block_tokens=256, seed=3)
    requests = requests_of(path)
    check_agreement(requests, capacity, 256)
    inf = engine(requests, "inf", 256)
    assert inf["token_hit_ratio"] == theoretical_max(requests, 256)


def test_generated_random_prompts_match_reference_lru(tmp_path: Path) -> None:
    import json

    spec = RandomPrompts(input_lengths=(100, 1000, 3000), num_prompts=4, iterations=3,
                         block_tokens=256, seed=5, form="tokens")
    path = tmp_path / "rp.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in random_prompts(spec)))
    requests = requests_of(path)
    for cap in (10, 30, 10_000):
        check_agreement(requests, cap, 256)
    assert engine(requests, "inf", 256)["token_hit_ratio"] == theoretical_max(requests, 256)


@pytest.mark.parametrize("policy", ["lru", "lru-tail-first", "radix", "prefix-fair", "oracle"])
def test_policies_never_beat_infinite_capacity(tmp_path: Path, policy: str) -> None:
    path = write_multi_turn(tmp_path / "mt.jsonl", sessions=5, rounds=6, input_tokens=600,
                            output_tokens=200, block_tokens=256, seed=1)
    requests = requests_of(path)
    best = theoretical_max(requests, 256)
    res = engine(requests, "30blk", 256, policy)
    assert 0 < res["token_hit_ratio"] <= best
    assert res["tiers"][0]["occupancy_blocks"] <= 30


@pytest.mark.slow
def test_prefix_fair_stays_close_to_lru_on_recency_driven_traces(mooncake_traces: Path) -> None:
    requests = list(read_trace(mooncake_traces / "synthetic_trace.jsonl", fmt="mooncake",
                               block_tokens=512))
    for cap in ("1000000tok", "3000000tok"):
        lru = engine(requests, cap, 512, "lru")["token_hit_ratio"]
        fair = engine(requests, cap, 512, "prefix-fair")["token_hit_ratio"]
        assert abs(fair - lru) <= 0.02 * lru, (cap, fair, lru)
