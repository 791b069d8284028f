"""Workload generators: determinism, shapes, and stats that match the closed forms."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtool.errors import UsageError
from kvtool.trace import read_trace
from kvtool.trace.convert import convert_trace
from kvtool.trace.gen import (
    MultiTurn,
    PrefixRepetition,
    RandomPrompts,
    arrival_times_ms,
    multi_turn,
    prefix_repetition,
    random_prompts,
    rate_arrivals_ms,
)
from kvtool.trace.stats import trace_stats
from kvtool.trace.writer import write_records


def multi_turn_max_ratio(c: int, r: int, n: int, m: int, s: int, b: int) -> float:
    """Closed form of the infinite-cache token hit ratio of a C×R multi-turn trace.

    Round 1: sessions 2..C hit the system prompt's full blocks. Round k ≥ 2: a session
    hits the full blocks of its previous request, ⌊L_{k−1}/B⌋·B tokens, where
    L_k = S + k·N + (k−1)·M (the answer is stored when the next round re-sends it).
    """
    def length(k: int) -> int:
        return s + k * n + (k - 1) * m

    hits = (c - 1) * min((s // b) * b, length(1))
    hits += sum(c * (length(k - 1) // b) * b for k in range(2, r + 1))
    return hits / sum(c * length(k) for k in range(1, r + 1))


def test_multi_turn_shape() -> None:
    spec = MultiTurn(3, 4, 20, 10, system_prompt_tokens=7, block_tokens=8, seed=5)
    recs = list(multi_turn(spec))
    assert [(r["round"], r["session"]) for r in recs] == [
        (k, s) for k in range(1, 5) for s in range(1, 4)]
    for rec in recs:
        assert rec["input_length"] == 7 + rec["round"] * 20 + (rec["round"] - 1) * 10
        assert len(rec["tokens"]) == rec["input_length"]
        assert rec["output_length"] == 10 and rec["block_tokens"] == 8
        assert "timestamp" not in rec
    by = {(r["session"], r["round"]): r["tokens"] for r in recs}
    # Every session starts with the same system prompt, then diverges.
    assert by[(1, 1)][:7] == by[(2, 1)][:7] == by[(3, 1)][:7]
    assert by[(1, 1)][7:] != by[(2, 1)][7:]
    # Round k+1 re-sends round k's input plus a 10-token answer, then 20 new tokens.
    assert by[(2, 3)][: len(by[(2, 2)])] == by[(2, 2)]
    assert len(by[(2, 3)]) == len(by[(2, 2)]) + 30


def test_generators_are_deterministic_for_a_seed() -> None:
    a = list(multi_turn(MultiTurn(2, 3, 50, 5, seed=1)))
    assert a == list(multi_turn(MultiTurn(2, 3, 50, 5, seed=1)))
    assert a != list(multi_turn(MultiTurn(2, 3, 50, 5, seed=2)))
    r = RandomPrompts((10, 30), 2, 2, seed=3)
    assert list(random_prompts(r)) == list(random_prompts(r))


def test_timestamps_when_asked() -> None:
    recs = list(multi_turn(MultiTurn(2, 2, 5, 5, interval_ms=250.0)))
    assert [r["timestamp"] for r in recs] == [0.0, 250.0, 500.0, 750.0]


@settings(max_examples=25, deadline=None)
@given(c=st.integers(1, 4), r=st.integers(1, 5), n=st.integers(0, 70), m=st.integers(0, 40),
       s=st.integers(0, 60), b=st.integers(1, 32))
def test_multi_turn_stats_match_closed_form(tmp_path_factory: pytest.TempPathFactory, c: int,
                                            r: int, n: int, m: int, s: int, b: int) -> None:
    if s + n == 0:
        return  # round-1 requests would be empty
    tmp = tmp_path_factory.mktemp("gen")
    for form in ("tokens", "hash_ids"):
        path = tmp / f"{form}.jsonl"
        write_records(multi_turn(MultiTurn(c, r, n, m, s, b, seed=7, form=form)),
                      path)
        stats = trace_stats(read_trace(path))
        assert stats["max_token_hit_ratio"] == pytest.approx(
            multi_turn_max_ratio(c, r, n, m, s, b), abs=1e-12)
        assert (stats["requests"], stats["sessions"], stats["rounds"]) == (c * r, c, r)


def test_hash_ids_form_is_what_convert_makes_of_the_tokens_form(tmp_path: Path) -> None:
    spec = MultiTurn(4, 5, 100, 30, system_prompt_tokens=70, block_tokens=16, seed=3)
    write_records(multi_turn(spec), tmp_path / "tokens.jsonl")
    write_records(multi_turn(MultiTurn(4, 5, 100, 30, 70, 16, seed=3, form="hash_ids")),
                  tmp_path / "ids.jsonl")
    convert_trace(read_trace(tmp_path / "tokens.jsonl"), tmp_path / "conv.jsonl", to="kvtool")
    assert (tmp_path / "conv.jsonl").read_bytes() == (tmp_path / "ids.jsonl").read_bytes()
    rspec = dict(input_lengths=(40, 100), num_prompts=3, iterations=3, system_prompt_tokens=20,
                 block_tokens=16, seed=9)
    write_records(random_prompts(RandomPrompts(**rspec)), tmp_path / "rt.jsonl")  # type: ignore[arg-type]
    write_records(random_prompts(RandomPrompts(**rspec, form="hash_ids")),  # type: ignore[arg-type]
                  tmp_path / "ri.jsonl")
    convert_trace(read_trace(tmp_path / "rt.jsonl"), tmp_path / "rc.jsonl", to="kvtool")
    assert (tmp_path / "rc.jsonl").read_bytes() == (tmp_path / "ri.jsonl").read_bytes()


def test_random_prompts_are_fully_reusable_from_iteration_two(tmp_path: Path) -> None:
    lengths, prompts, b = (100, 1000, 10000), 4, 256
    spec = RandomPrompts(lengths, prompts, 3, block_tokens=b, seed=42, form="hash_ids")
    write_records(random_prompts(spec), tmp_path / "r.jsonl")
    stats = trace_stats(read_trace(tmp_path / "r.jsonl"))
    assert (stats["requests"], stats["sessions"], stats["rounds"]) == (36, 12, 3)
    per = {row["round"]: row for row in stats["per_round"]}
    assert per[1]["max_hit_tokens"] == 0
    reusable = prompts * sum((n // b) * b for n in lengths)
    assert per[2]["max_hit_tokens"] == per[3]["max_hit_tokens"] == reusable
    assert stats["output_tokens"] == 36 * 128


def test_random_prompts_share_the_system_prompt(tmp_path: Path) -> None:
    spec = RandomPrompts((64,), 3, 1, system_prompt_tokens=40, block_tokens=16, seed=1)
    recs = list(random_prompts(spec))
    assert recs[0]["tokens"][:40] == recs[2]["tokens"][:40]
    write_records(recs, tmp_path / "r.jsonl")
    # Prompts 2 and 3 hit the two full blocks of the shared 40-token prefix.
    assert trace_stats(read_trace(tmp_path / "r.jsonl"))["max_hit_tokens"] == 2 * 32


@pytest.mark.parametrize(("make", "field"), [
    (lambda: MultiTurn(0, 1, 1, 1), "sessions"),
    (lambda: MultiTurn(1, 0, 1, 1), "rounds"),
    (lambda: MultiTurn(1, 1, -1, 1), "input_tokens"),
    (lambda: MultiTurn(1, 1, 1, -1), "output_tokens"),
    (lambda: MultiTurn(1, 1, 1, 1, block_tokens=0), "block_tokens"),
    (lambda: MultiTurn(1, 1, 1, 1, form="csv"), "format"),  # type: ignore[arg-type]
    (lambda: MultiTurn(1, 1, 1, 1, interval_ms=-1), "interval_ms"),
    (lambda: MultiTurn(1, 1, 1, 1, interval_ms=float("nan")), "interval_ms"),
    (lambda: MultiTurn(1, 1, 1, 1, interval_ms=float("inf")), "interval_ms"),
    (lambda: MultiTurn(1, 1, 1, 1, seed=-1), "seed"),
    (lambda: MultiTurn(1, 2, 10**20, 1), "input_tokens"),
    (lambda: RandomPrompts((5,), 1, 1, seed=-1), "seed"),
    (lambda: RandomPrompts((10**20,), 1, 1), "random_input_len"),
    (lambda: RandomPrompts((), 1, 1), "random_input_len"),
    (lambda: RandomPrompts((0,), 1, 1), "random_input_len"),
    (lambda: RandomPrompts((5,), 0, 1), "num_prompts"),
    (lambda: RandomPrompts((5,), 1, 0), "iterations"),
    (lambda: RandomPrompts((5,), 1, 1, request_rate=0.0), "request_rate"),
    (lambda: RandomPrompts((5,), 1, 1, request_rate=float("nan")), "request_rate"),
    (lambda: RandomPrompts((5,), 1, 1, request_rate=2, interval_ms=1), "request_rate"),
    (lambda: RandomPrompts((5,), 1, 1, request_rate=2, burstiness=0), "burstiness"),
    (lambda: RandomPrompts((5,), 1, 1, burstiness=2), "burstiness"),
    (lambda: RandomPrompts((5,), 1, 1, range_ratio=1.0), "random_range_ratio"),
    (lambda: RandomPrompts((5,), 1, 1, range_ratio=-0.1), "random_range_ratio"),
    (lambda: RandomPrompts((1,), 1, 1, range_ratio=0.5), "random_range_ratio"),
    (lambda: PrefixRepetition(9, num_prefixes=10), "num_prompts"),
    (lambda: PrefixRepetition(10, num_prefixes=0), "prefix_repetition_num_prefixes"),
    (lambda: PrefixRepetition(10, prefix_tokens=-1), "prefix_repetition_prefix_len"),
    (lambda: PrefixRepetition(10, suffix_tokens=-1), "prefix_repetition_suffix_len"),
    (lambda: PrefixRepetition(10, prefix_tokens=0, suffix_tokens=0),
     "prefix_repetition_prefix_len"),
    (lambda: PrefixRepetition(10, request_rate=-1.0), "request_rate"),
])
def test_bad_parameters_name_the_option(make: object, field: str) -> None:
    with pytest.raises(UsageError) as err:
        make()  # type: ignore[operator]
    assert err.value.field == field


# -- arrivals ----------------------------------------------------------------------------------
def test_fixed_length_requests_at_a_poisson_rate(tmp_path: Path) -> None:
    """200 × 1,024 in / 128 out at 2 req/s, as vllm bench's random dataset sends them."""
    spec = RandomPrompts((1024,), 200, 1, output_tokens=128, request_rate=2.0, seed=0,
                         form="hash_ids")
    recs = list(random_prompts(spec))
    times = [r["timestamp"] for r in recs]
    assert len(recs) == 200 and times == sorted(times) and times[0] > 0
    assert times[-1] == 100_000.0  # vLLM scales the sum so the last is at N / rate
    assert {(r["input_length"], r["output_length"]) for r in recs} == {(1024, 128)}
    write_records(recs, tmp_path / "p.jsonl")
    reader = read_trace(tmp_path / "p.jsonl")
    assert reader.timed and [r.timestamp for r in reader] == times
    stats = trace_stats(reader)
    assert stats["max_hit_tokens"] == 0  # distinct prompts, no shared prefix
    assert stats["unique_blocks"] == 200 * 4
    # Arrival times use their own random stream: the prompts are those of the untimed trace.
    untimed = list(random_prompts(dataclasses.replace(spec, request_rate=None)))
    assert [{k: v for k, v in r.items() if k != "timestamp"} for r in recs] == untimed


def test_poisson_and_bursty_gaps_have_the_gamma_spread() -> None:
    """Gaps are gamma(shape β, mean 1/R): coefficient of variation 1/√β (1: Poisson)."""
    def cv(burstiness: float) -> float:
        spec = RandomPrompts((8,), 4000, 1, request_rate=5.0, burstiness=burstiness, seed=3)
        times = arrival_times_ms(4000, spec)
        assert times is not None
        gaps = np.diff([0.0, *times])
        assert gaps.mean() == pytest.approx(200.0, rel=1e-6)  # 1/R in ms, after scaling
        return float(gaps.std() / gaps.mean())
    assert cv(1.0) == pytest.approx(1.0, abs=0.06)
    assert cv(0.25) == pytest.approx(2.0, abs=0.15)
    assert cv(16.0) == pytest.approx(0.25, abs=0.02)


def test_all_at_once_constant_gaps_and_seeds() -> None:
    spec = MultiTurn(3, 2, 10, 5, request_rate=float("inf"))
    assert [r["timestamp"] for r in multi_turn(spec)] == [0.0] * 6
    steady = MultiTurn(2, 2, 10, 5, request_rate=4.0, burstiness=float("inf"))
    assert [r["timestamp"] for r in multi_turn(steady)] == [250.0, 500.0, 750.0, 1000.0]
    a = arrival_times_ms(50, RandomPrompts((8,), 1, 1, request_rate=1.0, seed=1))
    b = arrival_times_ms(50, RandomPrompts((8,), 1, 1, request_rate=1.0, seed=2))
    assert a == arrival_times_ms(50, RandomPrompts((8,), 1, 1, request_rate=1.0, seed=1))
    assert a != b
    assert rate_arrivals_ms(50, 1.0, seed=1) == a
    assert rate_arrivals_ms(4, 2.0, burstiness=float("inf")) == [500.0, 1000.0, 1500.0, 2000.0]
    with pytest.raises(UsageError):
        rate_arrivals_ms(4, -1.0)
    assert arrival_times_ms(3, RandomPrompts((8,), 1, 1)) is None
    assert arrival_times_ms(3, RandomPrompts((8,), 1, 1, interval_ms=2.5)) == [0.0, 2.5, 5.0]


# -- prefix repetition -------------------------------------------------------------------------
def test_prefix_repetition_shape_and_shuffle() -> None:
    spec = PrefixRepetition(23, prefix_tokens=40, suffix_tokens=24, num_prefixes=4,
                            output_tokens=7, block_tokens=16, seed=5)
    recs = list(prefix_repetition(spec))
    assert len(recs) == spec.requests == 20  # ⌊23 / 4⌋ = 5 per prefix, as vLLM
    assert {(r["input_length"], r["output_length"], len(r["tokens"])) for r in recs} == {
        (64, 7, 64)}
    assert all("session" not in r and "round" not in r for r in recs)
    prefixes = [tuple(r["tokens"][:40]) for r in recs]
    assert sorted(prefixes.count(p) for p in set(prefixes)) == [5, 5, 5, 5]
    assert len({tuple(r["tokens"][40:]) for r in recs}) == 20  # every suffix is fresh
    grouped = [tuple(r["tokens"][:40]) for r in
               prefix_repetition(dataclasses.replace(spec, shuffle=False))]
    assert grouped != prefixes  # vLLM shuffles by default ...
    assert sorted(grouped) == sorted(prefixes)
    assert all(grouped[i] == grouped[i - i % 5] for i in range(20))  # ... unless told not to


@pytest.mark.parametrize(("n", "k", "p", "s", "b"), [(23, 4, 40, 24, 16), (10, 10, 256, 256, 256),
                                                      (30, 3, 100, 0, 16), (12, 2, 0, 50, 8)])
def test_prefix_repetition_hits_and_forms(tmp_path: Path, n: int, k: int, p: int, s: int,
                                          b: int) -> None:
    spec = PrefixRepetition(n, p, s, k, block_tokens=b, seed=2)
    write_records(prefix_repetition(spec), tmp_path / "t.jsonl")
    write_records(prefix_repetition(dataclasses.replace(spec, form="hash_ids")),
                  tmp_path / "i.jsonl")
    convert_trace(read_trace(tmp_path / "t.jsonl"), tmp_path / "c.jsonl", to="kvtool")
    assert (tmp_path / "c.jsonl").read_bytes() == (tmp_path / "i.jsonl").read_bytes()
    stats = trace_stats(read_trace(tmp_path / "i.jsonl"), reuse=False)
    requests = n // k * k
    # Every request after the first of its prefix hits the prefix's full blocks.
    assert stats["max_hit_tokens"] == (requests - k) * (p // b) * b
    assert stats["requests"] == requests


def test_random_range_ratio_draws_lengths_like_vllm(tmp_path: Path) -> None:
    spec = RandomPrompts((100, 1000), 300, 2, output_tokens=10, range_ratio=0.25, seed=4,
                         form="hash_ids", block_tokens=16)
    recs = list(random_prompts(spec))
    first = recs[:600]
    short = [r["input_length"] for r in first[:300]]
    long_ = [r["input_length"] for r in first[300:]]
    outs = [r["output_length"] for r in first]
    assert (min(short), max(short)) == (75, 125)  # 51 values, 300 draws: both ends met
    assert 750 <= min(long_) < 770 and 1230 < max(long_) <= 1250
    assert (min(outs), max(outs)) == (7, 13)  # ⌊7.5⌋ .. ⌈12.5⌉
    assert abs(np.mean(long_) - 1000) < 15
    # A prompt keeps its lengths, and its blocks, in the next iteration.
    assert [(r["input_length"], r["output_length"], r["hash_ids"]) for r in recs[600:]] == [
        (r["input_length"], r["output_length"], r["hash_ids"]) for r in first]
    tokens = list(random_prompts(dataclasses.replace(spec, form="tokens")))
    assert [len(r["tokens"]) for r in tokens] == [r["input_length"] for r in recs]
    # 0 keeps the lengths fixed and draws nothing: the trace of a spec without a ratio.
    fixed = dataclasses.replace(spec, range_ratio=0.0)
    assert {r["input_length"] for r in random_prompts(fixed)} == {100, 1000}
    assert list(random_prompts(fixed)) == list(random_prompts(RandomPrompts(
        (100, 1000), 300, 2, output_tokens=10, seed=4, form="hash_ids", block_tokens=16)))


@pytest.mark.parametrize("form", ["tokens", "hash_ids"])
def test_reuse_share_resends_the_same_share_of_prompts(form: str) -> None:
    """``reuse_share`` 0.4 of 10 prompts: iterations 2 and 3 re-send the same 4 prompts as
    they were; the other 6 are new each iteration, of the same lengths, after the shared
    system prompt."""
    spec = RandomPrompts((64,), 10, 3, seed=5, reuse_share=0.4, system_prompt_tokens=32,
                         block_tokens=16, form=form)
    recs = list(random_prompts(spec))
    body = [tuple(r[form]) for r in recs]
    first, second, third = body[:10], body[10:20], body[20:]
    again = [j for j in range(10) if second[j] == first[j]]
    assert len(again) == 4 and again == [j for j in range(10) if third[j] == first[j]]
    fresh = [j for j in range(10) if j not in again]
    assert len({second[j] for j in fresh} | {third[j] for j in fresh} | set(first)) == 22
    assert [r["input_length"] for r in recs] == [96] * 30
    shared = 32 if form == "tokens" else 2  # the system prompt: 32 tokens, 2 blocks
    assert all(b[:shared] == first[0][:shared] for b in body)
    everything = RandomPrompts((64,), 10, 3, seed=5, system_prompt_tokens=32, block_tokens=16,
                               form=form)
    assert [tuple(r[form]) for r in random_prompts(everything)][10:20] == first
