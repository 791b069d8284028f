"""Workload generators: determinism, shapes, and stats that match the closed forms."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtool.errors import UsageError
from kvtool.trace import read_trace
from kvtool.trace.convert import convert_trace
from kvtool.trace.gen import MultiTurn, RandomPrompts, multi_turn, random_prompts
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
        write_records(multi_turn(MultiTurn(c, r, n, m, s, b, seed=7, form=form)),  # type: ignore[arg-type]
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
    (lambda: MultiTurn(1, 1, 1, 1, form="csv"), "format"),
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
])
def test_bad_parameters_name_the_option(make: object, field: str) -> None:
    with pytest.raises(UsageError) as err:
        make()  # type: ignore[operator]
    assert err.value.field == field
