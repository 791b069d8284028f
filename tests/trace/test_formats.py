"""The Azure CSV and Qwen-Bailian JSONL readers, and timestamps kept as the trace gives them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvtool.errors import InputError
from kvtool.trace import read_trace
from kvtool.trace.stats import trace_stats
from tests.conftest import FIXTURES, SHARED

AZURE_HEAD = FIXTURES / "traces" / "azure-conv-head.csv"
BAILIAN = FIXTURES / "traces" / "bailian-sample.jsonl"
HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens"


def csv_file(tmp_path: Path, rows: list[str], header: str = HEADER, end: str = "\n") -> Path:
    path = tmp_path / "azure.csv"
    path.write_bytes(end.join([header, *rows]).encode() + end.encode())
    return path


def jsonl(tmp_path: Path, lines: list[Any]) -> Path:
    path = tmp_path / "t.jsonl"
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def bl(chat: Any, parent: Any, ts: float, n: int, ids: list[int], turn: int | None = None,
       out: int = 5) -> dict[str, Any]:
    rec: dict[str, Any] = {"chat_id": chat, "parent_chat_id": parent, "timestamp": ts,
                           "input_length": n, "output_length": out, "type": "text",
                           "hash_ids": ids}
    if turn is not None:
        rec["turn"] = turn
    return rec


# -- Azure -----------------------------------------------------------------------------------
def test_azure_rows_become_timed_requests_with_fresh_keys(tmp_path: Path) -> None:
    path = csv_file(tmp_path, ["2023-11-16 18:15:46.6805900,374,44",
                               "2023-11-16 18:15:50.9951690,513,109",
                               "2023-11-16 18:15:50.9951690,0,3",
                               "2023-11-16 18:16:46.6805901,256,1"], end="\r\n")
    reader = read_trace(path)
    assert (reader.format, reader.timed, reader.block_tokens, reader.has_rounds) == (
        "azure", True, 256, False)
    reqs = list(reader)
    assert [r.timestamp for r in reqs] == [0.0, 4314.579, 4314.579, 60000.0001]
    assert [(r.input_length, r.output_length) for r in reqs] == [(374, 44), (513, 109), (0, 3),
                                                                 (256, 1)]
    # ceil(input / 256) fresh keys each, numbered in serve order: nothing is ever shared.
    assert [r.block_keys for r in reqs] == [[0, 1], [2, 3, 4], [], [5]]
    assert [(r.session, r.round, r.line) for r in reqs] == [(None, None, n) for n in (2, 3, 4, 5)]
    assert [r.report_round for r in reqs] == [1, 1, 1, 2]  # one-minute windows
    assert [r.block_keys for r in reader] == [[0, 1], [2, 3, 4], [], [5]]  # again, same keys
    assert trace_stats(reader)["max_token_hit_ratio"] == 0.0


def test_azure_columns_by_name_offsets_and_unsorted_rows(tmp_path: Path) -> None:
    path = csv_file(tmp_path, ["x,10,2023-11-16T10:00:01.5+01:00,7",
                               '"y, quoted",20,2023-11-16 09:00:00Z,8'],
                    header="\ufeffname,GeneratedTokens,TIMESTAMP,ContextTokens")
    reqs = list(read_trace(path, block_tokens=4))
    # 10:00:01.5+01:00 is 09:00:01.5 UTC: 1.5 s after the earliest row, which is served first.
    assert [(r.timestamp, r.input_length, r.output_length, r.line) for r in reqs] == [
        (0.0, 8, 20, 3), (1500.0, 7, 10, 2)]
    assert [r.block_keys for r in reqs] == [[0, 1], [2, 3]]


@pytest.mark.parametrize(("row", "field", "message"), [
    ("2023-11-16 18:15:46,abc,4", "ContextTokens", 'expected an integer, got "abc"'),
    ("2023-11-16 18:15:46,5,-4", "GeneratedTokens", "expected an integer >= 0, got -4"),
    ("16/11/2023 18:15,5,4", "TIMESTAMP",
     'expected a time like 2023-11-16 18:15:46.6805900, got "16/11/2023 18:15"'),
    ("2023-02-30 18:15:46,5,4", "TIMESTAMP", 'day is out of range for month, got '
                                             '"2023-02-30 18:15:46"'),
    ("2023-11-16 18:15:46,5", None, "expected 3 columns like the header, got 2"),
])
def test_azure_bad_rows_name_line_and_column(tmp_path: Path, row: str, field: str | None,
                                             message: str) -> None:
    path = csv_file(tmp_path, ["2023-11-16 18:15:45,1,1", row])
    with pytest.raises(InputError) as err:
        read_trace(path)
    assert (err.value.file, err.value.line, err.value.field) == (str(path), 3, field)
    assert err.value.message == message
    reader = read_trace(path, skip_bad=1)
    assert len(reader) == 1 and reader.bad_lines[0][0] == 3


def test_azure_forced_on_a_file_without_its_header(tmp_path: Path) -> None:
    path = jsonl(tmp_path, [{"timestamp": 0, "input_length": 1, "output_length": 1,
                             "hash_ids": [1]}])
    with pytest.raises(InputError) as err:
        read_trace(path, fmt="azure")
    assert (err.value.line, err.value.message) == (
        1, "expected the Azure CSV header naming TIMESTAMP, ContextTokens, GeneratedTokens")
    assert read_trace(path).format == "mooncake"


def test_azure_fixture_is_the_head_of_the_shared_trace() -> None:
    reader = read_trace(AZURE_HEAD)
    reqs = list(reader)
    assert (reader.format, len(reqs)) == ("azure", 40)
    assert (reqs[0].input_length, reqs[0].output_length) == (374, 44)
    assert reqs[1].timestamp == pytest.approx(4314.579, abs=1e-9)
    shared = SHARED / "traces" / "azure" / "AzureLLMInferenceTrace_conv.csv"
    if shared.exists():
        full = list(read_trace(shared))
        assert [(r.timestamp, r.input_length, r.output_length) for r in full[:40]] == [
            (r.timestamp, r.input_length, r.output_length) for r in reqs]


def test_shared_azure_traces() -> None:
    base = SHARED / "traces" / "azure"
    if not (base / "AzureLLMInferenceTrace_conv.csv").exists():
        pytest.skip(f"Azure traces not present at {base} (../shared is reference material)")
    conv = read_trace(base / "AzureLLMInferenceTrace_conv.csv")
    stats = trace_stats(conv, reuse=False)
    assert (stats["requests"], stats["duration_ms"], stats["input_tokens"],
            stats["output_tokens"]) == (19_366, pytest.approx(3_501_721.937, abs=1e-6),
                                        22_361_870, 4_088_665)
    assert stats["unique_blocks"] == stats["block_accesses"]
    assert stats["max_token_hit_ratio"] == 0.0
    assert len(read_trace(base / "AzureLLMInferenceTrace_code.csv")) == 8_819


# -- Qwen-Bailian ----------------------------------------------------------------------------
def test_bailian_fixture_sessions_rounds_and_times() -> None:
    reader = read_trace(BAILIAN)
    assert (reader.format, reader.block_tokens, reader.timed, reader.has_rounds) == (
        "bailian", 16, True, True)
    reqs = list(reader)
    by_line = {r.line: r for r in reqs}
    # chat_id = line - 1 in the fixture; sessions are the roots of the parent chains.
    assert {line: r.session for line, r in by_line.items()} == {
        1: 0, 2: 1, 3: 0, 4: 3, 5: 0, 6: 57, 7: 1, 8: 57, 9: 8, 10: 0}
    assert [r.round for r in reqs] == [1, 1, 2, 1, 3, 4, 2, 5, 1, 4]
    assert [r.timestamp for r in reqs] == [0.0, 412.0, 2750.0, 3100.0, 5004.0, 5500.0, 7250.0,
                                           9000.0, 9000.0, 11125.0]
    assert by_line[1].block_keys == [1, 2, 3, 4, 1000, 1001, 1002]
    assert by_line[1].hit_tokens(7) == 104  # the last 16-token block is partial
    stats = trace_stats(reader)
    assert (stats["sessions"], stats["requests"]) == (5, 10)


def test_bailian_rounds_inferred_without_turn_and_a_parent_outside_the_trace(
        tmp_path: Path) -> None:
    path = jsonl(tmp_path, [bl(10, 7, 1.0, 32, [1, 2]), bl(11, -1, 1.5, 16, [5]),
                            bl(12, 10, 2.25, 48, [1, 2, 3]), bl(13, 12, 3.0, 64, [1, 2, 3, 4])])
    reqs = list(read_trace(path))
    assert [(r.session, r.round, r.timestamp) for r in reqs] == [
        (7, 1, 1000.0), (11, 1, 1500.0), (7, 2, 2250.0), (7, 3, 3000.0)]


def test_bailian_is_detected_by_its_keys_and_string_ids_work(tmp_path: Path) -> None:
    path = jsonl(tmp_path, [{"chat_id": "a", "timestamp": 0, "input_length": 20,
                             "output_length": 1, "hash_ids": [1, 2]},
                            bl("b", "a", 0.5, 40, [1, 2, 3], turn=2)])
    reqs = list(read_trace(path))
    assert [(r.session, r.round) for r in reqs] == [("a", 1), ("a", 2)]


@pytest.mark.parametrize(("lines", "line", "field", "message"), [
    ([bl(1, -1, 0, 16, [1]), bl(1, -1, 1, 16, [2])], 2, "chat_id",
     "1 is also the chat_id of line 1"),
    ([bl(1, 1, 0, 16, [1])], 1, "parent_chat_id", "a request cannot be its own parent"),
    ([bl(1, -1, 0, 16, [1]), {**bl(2, 1, 1, 16, [1]), "timestamp": None}], 2, "timestamp",
     "missing (required in Qwen-Bailian traces)"),
    ([bl(1, -1, 0, 16, [1, 2, 3])], 1, "hash_ids",
     "3 block ids, but input_length 16 allows at most 1 at 16 tokens per block"),
    ([bl(1, -1, 0, 16, [1], turn=0)], 1, "turn", "expected an integer >= 1, got 0"),
    ([{**bl(1, -1, 0, 16, [1]), "type": 3}], 1, "type", "expected a string, got 3"),
    ([bl(1, 2, 0, 16, [1]), bl(2, 1, 1, 16, [1])], 1, "parent_chat_id",
     "the parent_chat_id chain from chat_id 1 loops back to 1"),
])
def test_bailian_bad_lines(tmp_path: Path, lines: list[Any], line: int, field: str,
                           message: str) -> None:
    path = jsonl(tmp_path, lines)
    with pytest.raises(InputError) as err:
        read_trace(path)
    assert (err.value.line, err.value.field, err.value.message) == (line, field, message)


# -- timestamps --------------------------------------------------------------------------------
def test_mooncake_timestamps_are_kept_and_the_trace_is_timed(tmp_path: Path) -> None:
    lines = [{"timestamp": t, "input_length": 600, "output_length": 1, "hash_ids": [i, i + 1]}
             for i, t in enumerate([0, 1500, 1500, 3000.25, 61_000])]
    reader = read_trace(jsonl(tmp_path, lines))
    assert (reader.format, reader.timed) == ("mooncake", True)
    assert [r.timestamp for r in reader] == [0, 1500, 1500, 3000.25, 61_000]


def test_shared_mooncake_trace_keeps_its_timestamps(mooncake_traces: Path) -> None:
    path = mooncake_traces / "conversation_trace.jsonl"
    reader = read_trace(path, block_tokens=512)
    assert reader.timed
    with open(path) as f:
        in_file = sorted(float(json.loads(line)["timestamp"]) for line in f)
    assert [r.timestamp for r in reader] == in_file


def test_untimed_trace_says_so() -> None:
    reader = read_trace(FIXTURES / "traces" / "multiturn-8x12.jsonl")
    assert not reader.timed
    assert {r.timestamp for r in reader} == {0.0}
