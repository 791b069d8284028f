"""Conversion between kvtool and Mooncake JSONL keeps every block equality."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtool.errors import UsageError
from kvtool.trace import read_trace
from kvtool.trace.convert import convert_trace
from kvtool.trace.stats import trace_stats
from tests.conftest import FIXTURES

TOKENS = FIXTURES / "traces" / "multiturn-4x6.tokens.jsonl"


def same_replay(a: dict[str, object], b: dict[str, object]) -> None:
    for key in ("requests", "input_tokens", "output_tokens", "block_accesses", "unique_blocks",
                "max_hit_tokens", "reuse_distance"):
        assert a[key] == b[key], key


def test_tokens_to_kvtool_hash_ids(tmp_path: Path) -> None:
    res = convert_trace(read_trace(TOKENS), tmp_path / "ids.jsonl", to="kvtool")
    assert (res.requests, res.timestamps_added, res.read_back_block_tokens) == (24, False, None)
    first = json.loads((tmp_path / "ids.jsonl").read_text().splitlines()[0])
    assert first == {"session": 1, "round": 1, "input_length": 48, "output_length": 8,
                     "block_tokens": 16, "hash_ids": [0, 1, 2]}
    back = read_trace(tmp_path / "ids.jsonl")
    assert back.block_tokens == 16
    same_replay(trace_stats(read_trace(TOKENS)), trace_stats(back))
    assert [(r.session, r.round) for r in back] == [(r.session, r.round) for r in read_trace(TOKENS)]


def test_untimed_kvtool_to_mooncake_gets_timestamps(tmp_path: Path) -> None:
    res = convert_trace(read_trace(TOKENS), tmp_path / "mc.jsonl", to="mooncake",
                        interval_ms=10)
    assert res.timestamps_added and res.read_back_block_tokens == 16
    lines = [json.loads(x) for x in (tmp_path / "mc.jsonl").read_text().splitlines()]
    assert set(lines[0]) == {"timestamp", "input_length", "output_length", "hash_ids"}
    assert [x["timestamp"] for x in lines[:3]] == [0, 10, 20]
    back = read_trace(tmp_path / "mc.jsonl", block_tokens=16)
    assert back.format == "mooncake"
    same_replay(trace_stats(read_trace(TOKENS)), trace_stats(back))


def test_mooncake_round_trip(tmp_path: Path, mooncake_traces: Path) -> None:
    src = read_trace(mooncake_traces / "synthetic_trace.jsonl")
    convert_trace(src, tmp_path / "kv.jsonl", to="kvtool")
    kv = read_trace(tmp_path / "kv.jsonl")
    assert (kv.format, kv.block_tokens, kv.timed) == ("kvtool", 512, True)
    convert_trace(kv, tmp_path / "mc.jsonl", to="mooncake")
    mc = read_trace(tmp_path / "mc.jsonl")
    base = trace_stats(src)
    same_replay(base, trace_stats(kv))
    same_replay(base, trace_stats(mc))
    assert [r.timestamp for r in mc] == [r.timestamp for r in src]


def test_bad_target_format(tmp_path: Path) -> None:
    with pytest.raises(UsageError) as err:
        convert_trace(read_trace(TOKENS), tmp_path / "x", to="csv")
    assert err.value.field == "to"
    assert not (tmp_path / "x").exists()
