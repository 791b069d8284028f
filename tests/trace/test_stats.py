"""Trace statistics from the definitions: prefix hits, reuse distances, real traces."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtool.trace import Request, read_trace
from kvtool.trace.stats import MaxHitRatio, trace_stats


def req(keys: list[int], n: int, b: int = 4, rnd: int | None = None,
        session: str | int | None = None) -> Request:
    return Request(0.0, n, 1, keys, b, session, rnd)


def test_prefix_hit_stops_at_first_unseen_block_and_is_capped_by_input() -> None:
    reqs = [
        req([1, 2, 3], 12),        # cold
        req([1, 2, 9, 3], 16),     # hits 1, 2; stops at 9 although 3 was seen: 8 tokens
        req([1, 2, 9], 10),        # hits 3 blocks = 12 tokens, capped at input_length 10
        req([5, 1], 8),            # head unseen: 0 hits
    ]
    s = trace_stats(reqs)
    assert s["max_hit_tokens"] == 8 + 10
    assert s["max_token_hit_ratio"] == pytest.approx(18 / 46)
    assert s["max_block_hit_ratio"] == pytest.approx(5 / 12)
    assert (s["unique_blocks"], s["block_accesses"]) == (5, 12)


def test_blocks_of_a_request_are_stored_after_its_lookup() -> None:
    # A request never hits its own blocks, even a repeated key.
    s = trace_stats([req([7, 7], 8)])
    assert s["max_hit_tokens"] == 0


def test_per_round_rows_and_counts() -> None:
    reqs = [req([1], 4, rnd=1, session="a"), req([2], 4, rnd=1, session="b"),
            req([1, 3], 8, rnd=2, session="a")]
    s = trace_stats(reqs)
    assert (s["sessions"], s["rounds"], s["requests"]) == (2, 2, 3)
    assert s["per_round"] == [
        {"round": 1, "requests": 2, "input_tokens": 8, "max_hit_tokens": 0,
         "max_token_hit_ratio": 0.0, "new_blocks": 2},
        {"round": 2, "requests": 1, "input_tokens": 8, "max_hit_tokens": 4,
         "max_token_hit_ratio": 0.5, "new_blocks": 1},
    ]


def brute_reuse(accesses: list[int]) -> tuple[int, dict[int, int]]:
    """Reuse distances the slow way: distinct other keys between two uses."""
    last: dict[int, int] = {}
    cold = 0
    hist: dict[int, int] = {}
    for i, k in enumerate(accesses):
        if k in last:
            d = len(set(accesses[last[k] + 1:i]) - {k})
            hist[d.bit_length()] = hist.get(d.bit_length(), 0) + 1
        else:
            cold += 1
        last[k] = i
    return cold, hist


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 25), min_size=1, max_size=6), min_size=1, max_size=90))
def test_reuse_distance_histogram_matches_brute_force(keys: list[list[int]]) -> None:
    s = trace_stats([req(k, 4 * len(k)) for k in keys])
    cold, hist = brute_reuse([k for ks in keys for k in ks])
    r = s["reuse_distance"]
    assert r["cold"] == cold
    got = {i: b["count"] for i, b in enumerate(r["buckets"]) if b["count"]}
    assert got == hist
    for i, b in enumerate(r["buckets"]):
        assert (b["min"], b["max"]) == ((0, 0) if i == 0 else (2 ** (i - 1), 2**i - 1))


def test_reuse_distance_survives_fenwick_growth() -> None:
    rng = random.Random(4)
    keys = [[rng.randrange(3000) for _ in range(8)] for _ in range(700)]  # 5600 accesses
    s = trace_stats([req(k, 32) for k in keys])
    cold, hist = brute_reuse([k for ks in keys for k in ks])
    assert s["reuse_distance"]["cold"] == cold
    assert {i: b["count"] for i, b in enumerate(s["reuse_distance"]["buckets"])
            if b["count"]} == hist


def traces(key: st.SearchStrategy[int]) -> st.SearchStrategy[list[tuple[list[int], int]]]:
    """Up to 40 requests of up to 6 keys drawn from ``key``, with input lengths."""
    return st.lists(st.tuples(st.lists(key, max_size=6), st.integers(0, 30)), max_size=40)


def lean_equals_the_infinite_cache(reqs: list[tuple[list[int], int]], b: int) -> None:
    # replay's "% of max" runs MaxHitRatio beside the engine; it must be trace_stats' figure
    requests = [req(keys, n, b) for keys, n in reqs]
    lean = MaxHitRatio()
    for r in requests:
        lean.add(r.block_keys, r.input_length, r.block_tokens)
    s = trace_stats(requests, reuse=False)
    assert (lean.hit_tokens, lean.ratio) == (s["max_hit_tokens"], s["max_token_hit_ratio"])


@settings(max_examples=80, deadline=None)
@given(traces(st.integers(0, 12)), st.integers(1, 8))
def test_max_hit_ratio_alone_equals_the_infinite_cache(reqs: list[tuple[list[int], int]],
                                                      b: int) -> None:
    lean_equals_the_infinite_cache(reqs, b)  # small keys: the bitmap


@settings(max_examples=80, deadline=None)
@given(traces(st.one_of(st.integers(0, 12), st.integers(-3, 2**40))), st.integers(1, 8))
def test_max_hit_ratio_with_keys_no_bitmap_holds(reqs: list[tuple[list[int], int]],
                                                 b: int) -> None:
    lean_equals_the_infinite_cache(reqs, b)  # negative or sparse keys: a set, mid-trace


def test_options() -> None:
    s = trace_stats([req([1, 2], 8)], reuse=False, block_bytes=1000)
    assert s["reuse_distance"] is None and s["unique_bytes"] == 2000


def test_empty_input() -> None:
    s = trace_stats([])
    assert (s["requests"], s["max_token_hit_ratio"], s["unique_blocks"]) == (0, 0.0, 0)


# Recorded 2026-11-29 on ../shared/traces/mooncake (Mooncake's public traces, 512 tok/block).
MOONCAKE = {
    "conversation_trace.jsonl": dict(requests=12031, input_tokens=144_793_823,
                                     output_tokens=4_122_048, block_accesses=288_500,
                                     unique_blocks=182_790, max_hit_tokens=54_098_411,
                                     max_token_hit_ratio=0.3736237491291324, windows=59),
    "synthetic_trace.jsonl": dict(requests=3993, input_tokens=61_194_628,
                                  output_tokens=595_432, block_accesses=121_877,
                                  unique_blocks=43_924, max_hit_tokens=39_852_661,
                                  max_token_hit_ratio=0.6512444360312151, windows=18),
}


@pytest.mark.parametrize("name", sorted(MOONCAKE))
def test_mooncake_trace_stats(mooncake_traces: Path, name: str) -> None:
    want = dict(MOONCAKE[name])
    windows = want.pop("windows")
    s = trace_stats(read_trace(mooncake_traces / name, fmt="mooncake", block_tokens=512))
    for key, value in want.items():
        assert s[key] == pytest.approx(value, rel=0, abs=1e-15), key
    assert len(s["per_round"]) == windows
    assert sum(b["count"] for b in s["reuse_distance"]["buckets"]) == \
        s["block_accesses"] - s["unique_blocks"]



@st.composite
def minted_traces(draw: st.DrawFn) -> list[tuple[list[int], int]]:
    """Up to 40 requests whose keys are mostly minted in order (a fresh key is the number
    of keys before it, as Mooncake's ``hash_ids``), with seen keys, repeats and the odd
    stray key mixed in: the watermark must hold, or give way, at any request."""
    minted = 0
    out = []
    for _ in range(draw(st.integers(0, 40))):
        keys = []
        for kind in draw(st.lists(st.sampled_from("ffffsrx"), max_size=6)):
            if kind == "f" or (kind in "sr" and not minted):
                keys.append(minted)
                minted += 1
            elif kind == "s":
                keys.append(draw(st.integers(0, minted - 1)))
            elif kind == "r":
                keys.append(keys[-1] if keys else minted - 1)
            else:
                keys.append(draw(st.integers(-2, minted + 3)))
        out.append((keys, draw(st.integers(0, 30))))
    return out


@settings(max_examples=90, deadline=None)
@given(minted_traces(), st.integers(1, 8))
def test_max_hit_ratio_with_keys_minted_in_order_holds(reqs: list[tuple[list[int], int]],
                                                       b: int) -> None:
    lean_equals_the_infinite_cache(reqs, b)  # the watermark, then a bitmap or a set


def test_max_hit_ratio_keeps_the_cheapest_form_of_the_seen_keys() -> None:
    minted = MaxHitRatio()  # Mooncake's hash_ids: a watermark, nothing kept per key
    for i in range(0, 300_000, 30):
        minted.add(list(range(max(0, i - 60), i + 30)), 90 * 16, 16)
    assert (minted.watermark, minted.flags, minted.seen) == (300_000, None, set())
    assert minted.hit_tokens == 60 * 16 * (300_000 // 30 - 2) + 30 * 16
    dense = MaxHitRatio()  # small keys out of order: a bitmap
    for i in range(0, 300_000, 30):
        dense.add(list(range(i + 29, i - 1, -1)), 30 * 16, 16)
    assert dense.watermark is None and dense.flags is not None
    assert len(dense.flags) < 2**20 and not dense.seen
    for keys in ([5, 6, -1], [2**50]):
        m = MaxHitRatio()
        m.add([0, 1, 2], 48, 16)
        m.add([3], 16, 16)
        assert m.watermark == 4
        m.add(keys, 48, 16)
        m.add([1, 2, 3, *keys], 96, 16)
        assert m.watermark is None and m.flags is None and m.seen == {0, 1, 2, 3, *keys}
        assert m.hit_tokens == min(16 * (3 + len(keys)), 96)  # the last request hits all
