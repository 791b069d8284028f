"""The streaming trace reader: formats, auto-detection, serve order, bad lines."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvtool.errors import InputError
from kvtool.trace import Request, chain_hashes, read_trace
from tests.conftest import FIXTURES


def write(tmp_path: Path, lines: list[Any], name: str = "t.jsonl") -> Path:
    """Write dicts as JSON lines and strings verbatim."""
    path = tmp_path / name
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def mc(ts: float, n: int, ids: list[int], out: int = 1) -> dict[str, Any]:
    return {"timestamp": ts, "input_length": n, "output_length": out, "hash_ids": ids}


# -- formats -------------------------------------------------------------------------------
def test_mooncake_is_detected_and_uses_512_token_blocks(tmp_path: Path) -> None:
    path = write(tmp_path, [mc(0, 1000, [7, 8]), mc(5, 600, [7, 9])])
    reader = read_trace(path)
    assert (reader.format, reader.block_tokens, reader.timed, len(reader)) == ("mooncake", 512,
                                                                              True, 2)
    reqs = list(reader)
    assert reqs[0] == Request(0.0, 1000, 1, [7, 8], 512, None, None, 1, 1)
    assert reqs[1].block_keys == [7, 9] and reqs[1].line == 2


def test_kvtool_keys_select_kvtool_format_with_256_token_blocks(tmp_path: Path) -> None:
    path = write(tmp_path, [{"session": "a", "input_length": 600, "output_length": 3,
                             "hash_ids": [1, 2, 3]}])
    reader = read_trace(path)
    assert (reader.format, reader.block_tokens, reader.timed) == ("kvtool", 256, False)
    (req,) = reader
    assert (req.session, req.round, req.report_round, req.timestamp) == ("a", 1, 1, 0.0)


def test_forced_format_and_block_tokens(tmp_path: Path) -> None:
    path = write(tmp_path, [mc(0, 1000, [1, 2, 3, 4])])
    assert read_trace(path, fmt="kvtool").block_tokens == 256
    assert read_trace(path, block_tokens=250).block_tokens == 250
    with pytest.raises(InputError) as err:
        read_trace(path)  # 4 ids need at least 1537 tokens at 512/block
    assert (err.value.line, err.value.field) == (1, "hash_ids")


def test_block_tokens_from_first_line(tmp_path: Path) -> None:
    path = write(tmp_path, [{"block_tokens": 64, "input_length": 128, "output_length": 0,
                             "hash_ids": [1, 2]}])
    assert read_trace(path).block_tokens == 64


def test_tokens_are_hashed_into_full_block_keys(tmp_path: Path) -> None:
    tokens = list(range(100, 140))
    path = write(tmp_path, [{"tokens": tokens, "output_length": 2, "block_tokens": 16}])
    (req,) = read_trace(path)
    assert req.input_length == 40
    assert req.block_keys == chain_hashes(tokens, 16) and len(req.block_keys) == 2
    # An explicit block size re-hashes a tokens trace.
    (req8,) = read_trace(path, block_tokens=8)
    assert req8.block_keys == chain_hashes(tokens, 8) and req8.block_tokens == 8


def test_fixture_traces_read(tmp_path: Path) -> None:
    tok = read_trace(FIXTURES / "traces" / "multiturn-4x6.tokens.jsonl")
    ids = read_trace(FIXTURES / "traces" / "multiturn-8x12.jsonl")
    assert (len(tok), tok.block_tokens, tok.format) == (24, 16, "kvtool")
    assert (len(ids), ids.block_tokens) == (96, 256)
    rounds = [r.report_round for r in ids]
    assert rounds == sorted(rounds) and rounds[-1] == 12


def test_reader_iterates_again(tmp_path: Path) -> None:
    path = write(tmp_path, [mc(0, 1000, [1, 2]), mc(1, 1000, [1, 3])])
    reader = read_trace(path)
    first = list(reader)
    assert [r.block_keys for r in first] == [[1, 2], [1, 3]]
    assert list(reader) == first


def test_stdin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import io
    import sys

    data = json.dumps(mc(0, 10, [1])).encode() + b"\n"
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))
    (req,) = read_trace("-")
    assert req.block_keys == [1]


# -- serve order ---------------------------------------------------------------------------
def test_timed_trace_is_served_in_timestamp_order_file_order_on_ties(tmp_path: Path) -> None:
    path = write(tmp_path, [mc(30, 10, [1]), mc(10, 10, [2]), mc(30, 10, [3]), mc(10, 10, [4]),
                            mc(20, 10, [5])])
    assert [r.line for r in read_trace(path)] == [2, 4, 5, 1, 3]


def test_untimed_trace_is_served_round_by_round(tmp_path: Path) -> None:
    def rec(session: str, **kw: Any) -> dict[str, Any]:
        return {"session": session, "input_length": 10, "output_length": 1, "hash_ids": [1],
                **kw}

    # A's three rounds, then B's two; rounds inferred from file order within a session.
    path = write(tmp_path, [rec("A"), rec("A"), rec("A"), rec("B"), rec("B")])
    served = [(r.session, r.round, r.line) for r in read_trace(path)]
    assert served == [("A", 1, 1), ("B", 1, 4), ("A", 2, 2), ("B", 2, 5), ("A", 3, 3)]
    # Explicit rounds win over file order.
    path = write(tmp_path, [rec("A", round=2), rec("A", round=1), rec("B", round=1)], "r.jsonl")
    assert [(r.session, r.round) for r in read_trace(path)] == [("A", 1), ("B", 1), ("A", 2)]


def test_rounds_in_a_timed_trace_follow_timestamps(tmp_path: Path) -> None:
    lines = [{"timestamp": ts, "session": s, "input_length": 10, "output_length": 1,
              "hash_ids": [1]} for ts, s in [(50, 1), (10, 1), (20, 2), (30, 1)]]
    served = [(r.timestamp, r.session, r.round) for r in read_trace(write(tmp_path, lines))]
    assert served == [(10, 1, 1), (20, 2, 1), (30, 1, 2), (50, 1, 3)]


def test_mooncake_requests_get_one_minute_periods(tmp_path: Path) -> None:
    path = write(tmp_path, [mc(1000, 10, [1]), mc(60_999, 10, [1]), mc(61_000, 10, [1]),
                            mc(200_000, 10, [1])])
    reqs = list(read_trace(path))
    assert [r.round for r in reqs] == [None] * 4
    assert [r.report_round for r in reqs] == [1, 1, 2, 4]
    assert [r.report_round for r in read_trace(path, window_ms=1000)] == [1, 60, 61, 200]


# -- bad lines -----------------------------------------------------------------------------
BAD_CASES: list[tuple[str, str, str | None, str]] = [
    # (name, line, field, part of the message)
    ("truncated", '{"timestamp": 0, "input_length": 10, "output_len', None, "truncated"),
    ("garbage", "not json", None, "malformed JSON"),
    ("string for number", '{"timestamp": 0, "input_length": "abc", "output_length": 1, '
     '"hash_ids": [1]}', "input_length", 'expected an integer, got "abc"'),
    ("negative input", '{"timestamp": 0, "input_length": -5, "output_length": 1, "hash_ids": []}',
     "input_length", ">= 0, got -5"),
    ("negative output", '{"timestamp": 0, "input_length": 5, "output_length": -1, "hash_ids": []}',
     "output_length", ">= 0"),
    ("float for int", '{"timestamp": 0, "input_length": 5.5, "output_length": 1, "hash_ids": []}',
     "input_length", "got 5.5"),
    ("bool for int", '{"timestamp": 0, "input_length": true, "output_length": 1, "hash_ids": []}',
     "input_length", "expected an integer"),
    ("missing output", '{"timestamp": 0, "input_length": 5, "hash_ids": []}', "output_length",
     "missing"),
    ("missing input", '{"timestamp": 0, "output_length": 5, "hash_ids": []}', "input_length",
     "missing"),
    ("missing hash_ids", '{"timestamp": 0, "input_length": 5, "output_length": 5}', "hash_ids",
     "missing"),
    ("hash_ids too long", '{"timestamp": 0, "input_length": 513, "output_length": 1, '
     '"hash_ids": [1, 2, 3]}', "hash_ids", "allows at most 2"),
    ("bad hash id", '{"timestamp": 0, "input_length": 513, "output_length": 1, '
     '"hash_ids": [1, "x"]}', "hash_ids", "item 1"),
    ("string timestamp", '{"timestamp": "noon", "input_length": 5, "output_length": 1, '
     '"hash_ids": []}', "timestamp", "expected a number"),
    ("not an object", "[1, 2, 3]", None, "JSON object"),
    ("missing timestamp", '{"input_length": 5, "output_length": 1, "hash_ids": []}',
     "timestamp", "missing"),
]


@pytest.mark.parametrize(("name", "line", "field", "text"), BAD_CASES,
                         ids=[c[0] for c in BAD_CASES])
def test_bad_mooncake_line_names_file_line_and_field(tmp_path: Path, name: str, line: str,
                                                     field: str | None, text: str) -> None:
    path = write(tmp_path, [mc(0, 1000, [1, 2]), "", line, mc(9, 1000, [1, 2])])
    with pytest.raises(InputError) as err:
        list(read_trace(path))
    assert (err.value.file, err.value.line, err.value.field) == (str(path), 3, field)
    assert text in err.value.message
    assert str(err.value).startswith(f"{path}:3: ")


KV_BAD: list[tuple[str, str, str | None, str]] = [
    ("tokens and hash_ids", '{"session": 1, "tokens": [1], "hash_ids": [1], "output_length": 1}',
     "tokens", "not both"),
    ("token out of range", '{"session": 1, "tokens": [1, 4294967296], "output_length": 1}',
     "tokens", "item 1"),
    ("negative token", '{"session": 1, "tokens": [-1], "output_length": 1}', "tokens", ">= 0"),
    ("length mismatch", '{"session": 1, "tokens": [1, 2], "input_length": 3, '
     '"output_length": 1}', "input_length", "the line has 2 tokens"),
    ("round zero", '{"session": 1, "round": 0, "input_length": 1, "output_length": 1, '
     '"hash_ids": []}', "round", ">= 1"),
    ("session list", '{"session": [1], "input_length": 1, "output_length": 1, "hash_ids": []}',
     "session", "expected an integer or a string"),
    ("other block size", '{"session": 1, "block_tokens": 32, "input_length": 64, '
     '"output_length": 1, "hash_ids": [1]}', "block_tokens", "one block size per trace"),
    ("no keys", '{"session": 1, "input_length": 64, "output_length": 1}', "hash_ids",
     "needs hash_ids or tokens"),
    ("timestamp on one line", '{"session": 1, "timestamp": 5, "input_length": 1, '
     '"output_length": 1, "hash_ids": []}', "timestamp", "all or none"),
]


@pytest.mark.parametrize(("name", "line", "field", "text"), KV_BAD, ids=[c[0] for c in KV_BAD])
def test_bad_kvtool_line_names_file_line_and_field(tmp_path: Path, name: str, line: str,
                                                   field: str | None, text: str) -> None:
    good = {"session": 1, "block_tokens": 16, "input_length": 16, "output_length": 1,
            "hash_ids": [1]}
    path = write(tmp_path, [good, line])
    with pytest.raises(InputError) as err:
        read_trace(path)
    assert (err.value.line, err.value.field) == (2, field)
    assert text in err.value.message


def test_skip_bad_skips_records_and_then_fails(tmp_path: Path) -> None:
    lines = [mc(0, 1000, [1, 2]), '{"timestamp": 1', mc(2, -1, []), mc(3, 1000, [1, 3]),
             "[]"]
    path = write(tmp_path, lines)
    reader = read_trace(path, skip_bad=3)
    assert [r.line for r in reader] == [1, 4]
    assert [n for n, _ in reader.bad_lines] == [2, 3, 5]
    assert "field 'input_length'" in reader.bad_lines[1][1]
    with pytest.raises(InputError) as err:
        read_trace(path, skip_bad=2)
    assert err.value.line == 5 and "more than skip_bad 2" in err.value.message
    with pytest.raises(InputError) as err:
        read_trace(path)
    assert err.value.line == 2


def test_files_that_are_not_traces(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="no such file"):
        read_trace(tmp_path / "missing.jsonl")
    with pytest.raises(InputError, match="directory"):
        read_trace(tmp_path)
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(InputError, match="no requests"):
        read_trace(tmp_path / "empty.jsonl")
    path = write(tmp_path, ["nope"], "bad.jsonl")
    with pytest.raises(InputError, match="no valid requests"):
        read_trace(path, skip_bad=1)


@pytest.mark.parametrize(("kwargs", "field"), [({"fmt": "csv"}, "format"),
                                               ({"block_tokens": 0}, "block_tokens"),
                                               ({"skip_bad": -1}, "skip_bad"),
                                               ({"window_ms": 0}, "window_ms")])
def test_bad_reader_options(tmp_path: Path, kwargs: dict[str, Any], field: str) -> None:
    path = write(tmp_path, [mc(0, 10, [1])])
    with pytest.raises(InputError) as err:
        read_trace(path, **kwargs)
    assert err.value.field == field


def test_mooncake_traces_read_whole(mooncake_traces: Path) -> None:
    conv = read_trace(mooncake_traces / "conversation_trace.jsonl")
    assert (conv.format, conv.block_tokens, len(conv)) == ("mooncake", 512, 12031)
    last = None
    for req in conv:
        assert len(req.block_keys) <= -(-req.input_length // 512)
        last = req
    assert last is not None and last.report_round == 59
