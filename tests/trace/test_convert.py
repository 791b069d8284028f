"""Conversion between kvtool and Mooncake JSONL keeps every block equality."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtool.errors import UsageError
from kvtool.trace import TraceReader, read_trace
from kvtool.trace.convert import convert_trace
from kvtool.trace.schema import WRITABLE
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


BAILIAN = FIXTURES / "traces" / "bailian-sample.jsonl"
AZURE_HEAD = FIXTURES / "traces" / "azure-conv-head.csv"
MULTI = FIXTURES / "traces" / "multiturn-8x12.jsonl"


Shape = tuple[float, int, int, int, int | None, list[int]]


def structure(reader: TraceReader) -> list[Shape]:
    """What a replay sees, sessions as the index of their first request (labels may change)."""
    first: dict[object, int] = {}
    out: list[Shape] = []
    for i, r in enumerate(reader):
        sid = -1 if r.session is None else first.setdefault(r.session, i)
        out.append((r.timestamp, r.input_length, r.output_length, sid, r.round, r.block_keys))
    return out


def test_bailian_round_trip_keeps_sessions_rounds_times_and_blocks(tmp_path: Path) -> None:
    src = read_trace(BAILIAN)
    res = convert_trace(src, tmp_path / "kv.jsonl", to="kvtool")
    assert (res.requests, res.dropped, res.read_back_block_tokens) == (10, (), None)
    kv = read_trace(tmp_path / "kv.jsonl")
    assert (kv.format, kv.block_tokens, kv.timed) == ("kvtool", 16, True)
    res = convert_trace(kv, tmp_path / "bl.jsonl", to="bailian")
    assert (res.dropped, res.read_back_block_tokens, res.timestamps_added) == ((), None, False)
    back = read_trace(tmp_path / "bl.jsonl")
    assert back.format == "bailian"
    assert structure(back) == structure(kv)
    # Renumbered ids keep every equality: the same as the source's, key for key.
    assert [len(set(r.block_keys)) for r in back] == [len(set(r.block_keys)) for r in src]
    same_replay(trace_stats(src), trace_stats(back))
    first = json.loads((tmp_path / "bl.jsonl").read_text().splitlines()[2])
    assert first == {"chat_id": 2, "parent_chat_id": 0, "timestamp": 2.75, "input_length": 154,
                     "output_length": 25, "type": "text", "turn": 2,
                     "hash_ids": [0, 1, 2, 3, 4, 5, 14, 15, 16, 17]}


def test_untimed_multi_turn_to_bailian(tmp_path: Path) -> None:
    res = convert_trace(read_trace(MULTI), tmp_path / "bl.jsonl", to="bailian", interval_ms=500)
    assert res.timestamps_added and res.read_back_block_tokens == 256
    back = read_trace(tmp_path / "bl.jsonl", block_tokens=256)
    src = read_trace(MULTI)
    assert [(r.timestamp, r.round) for r in back] == [(i * 500.0, r.round)
                                                      for i, r in enumerate(src)]
    assert [s for *_, s, _r, _k in structure(back)] == [s for *_, s, _r, _k in structure(src)]
    same_replay(trace_stats(src), trace_stats(back))


def test_azure_round_trip_and_what_it_drops(tmp_path: Path) -> None:
    src = read_trace(AZURE_HEAD)
    res = convert_trace(src, tmp_path / "a.csv", to="azure")
    assert (res.requests, res.dropped, res.timestamps_added) == (40, (), False)
    text = (tmp_path / "a.csv").read_text().splitlines()
    assert text[:2] == ["TIMESTAMP,ContextTokens,GeneratedTokens",
                        "1970-01-01 00:00:00.0000000,374,44"]
    assert text[2] == "1970-01-01 00:00:04.3145790,396,109"
    assert structure(read_trace(tmp_path / "a.csv")) == structure(src)
    res = convert_trace(read_trace(MULTI), tmp_path / "m.csv", to="azure", interval_ms=250)
    assert res.dropped == ("hash_ids", "session", "round") and res.timestamps_added
    back = list(read_trace(tmp_path / "m.csv", block_tokens=256))
    assert [(r.timestamp, r.input_length) for r in back] == [
        (i * 250.0, r.input_length) for i, r in enumerate(read_trace(MULTI))]
    assert len({k for r in back for k in r.block_keys}) == sum(len(r.block_keys) for r in back)


def test_every_format_converts_to_every_format(tmp_path: Path) -> None:
    sources = {"kvtool": MULTI, "bailian": BAILIAN, "azure": AZURE_HEAD}
    for name, path in sources.items():
        for to in WRITABLE:  # the registry's (kvtool/trace/formats/__init__.py)
            out = tmp_path / f"{name}-to-{to}"
            src = read_trace(path)
            res = convert_trace(src, out, to=to)
            back = read_trace(out, fmt=to, block_tokens=src.block_tokens)
            assert (back.format, len(back), res.requests) == (to, len(src), len(src)), (name, to)
            assert [r.input_length for r in back] == [r.input_length for r in src]
