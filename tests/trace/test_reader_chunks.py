"""Pass 1 of a Mooncake trace. A trace whose lines are all good and in timestamp order
is streamed: pass 1 checks it a chunk at a time and keeps only the chunks' offsets, and
pass 2 decodes the chunks again (``_scan_sorted_mooncake``, ``_stream``). Any other
trace: pass 1 decodes it a chunk of lines at a time (``decode_lines``), leaves to the
line-by-line scan every chunk with a blank or bad line, and keeps the decoded lines while
their block ids fit; pass 2 decodes the others again, a run of lines at a time where
serve order follows the file. Either way the requests, their lines, the bad lines and the
errors are the same as the line-by-line scan's alone."""

from __future__ import annotations

import json
import random
from itertools import accumulate
from pathlib import Path
from typing import Any

import pytest

import kvtool.trace.formats.mooncake as mooncake_mod
import kvtool.trace.reader as reader_mod
from kvtool.errors import InputError
from kvtool.trace import Request, read_trace
from kvtool.trace.reader import TraceReader


def lines(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = []
    t = 0
    for _ in range(n):
        t += rng.choice([0, 0, 250, 40_000])
        ids = [rng.randrange(500) for _ in range(rng.randrange(0, 9))]
        out.append(json.dumps({"timestamp": t, "input_length": len(ids) * 512 - 3 * bool(ids),
                               "output_length": rng.randrange(9), "hash_ids": ids}))
    return out


TAKEN: list[int] = []
"""Lines the chunked scan took, per read (to show it ran, and where it stopped)."""


Read = tuple[list[Request], list[tuple[int, str]]]


def no_stream(m: pytest.MonkeyPatch) -> None:
    m.setattr(TraceReader, "_scan_sorted_mooncake", lambda self: False)


def read_both(path: Path, monkeypatch: pytest.MonkeyPatch, **kw: int) -> tuple[Read, Read]:
    """(requests, bad lines) with 200-byte chunks (not streamed), then with the
    line-by-line scan only."""
    got: list[Read] = []
    chunks = TraceReader._scan_mooncake_chunks
    for chunk in (200, None):
        with monkeypatch.context() as m:
            no_stream(m)
            if chunk is None:
                m.setattr(TraceReader, "_scan_mooncake_chunks",
                          lambda self, keep: (0, 0, keep))
            else:
                def spy(self: TraceReader, keep: int) -> tuple[int, int, int]:
                    out = chunks(self, keep)
                    TAKEN.append(out[1])
                    return out

                m.setattr(reader_mod, "CHUNK_BYTES", chunk)
                m.setattr(TraceReader, "_scan_mooncake_chunks", spy)
            r = read_trace(path, fmt="mooncake", **kw)
            got.append((list(r), r.bad_lines))
    return got[0], got[1]


def read_streamed(path: Path, monkeypatch: pytest.MonkeyPatch, chunk: int = 200,
                  **kw: int) -> tuple[Read, TraceReader]:
    """(requests, bad lines) as a reader reads them by default, with ``chunk``-byte
    stream chunks, and the reader."""
    with monkeypatch.context() as m:
        m.setattr(reader_mod, "STREAM_CHUNK_BYTES", chunk)
        r = read_trace(path, fmt="mooncake", **kw)
        return (list(r), r.bad_lines), r


@pytest.mark.parametrize("keep", [10**9, 120, 0])
@pytest.mark.parametrize("shuffled", [False, True], ids=["sorted", "shuffled"])
def test_chunks_read_what_the_line_scan_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              keep: int, shuffled: bool) -> None:
    monkeypatch.setattr(mooncake_mod.Parser, "keep_block_ids", keep)
    text = lines(400)
    if shuffled:  # serve order is not file order: pass 2 decodes line by line
        random.Random(4).shuffle(text)
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join(text) + "\n")
    chunked, plain = read_both(p, monkeypatch)
    assert chunked == plain
    assert TAKEN[-1] == 400  # every chunk, kept or not
    # decoded lines are kept while their block ids fit in `keep`
    monkeypatch.setattr(reader_mod, "CHUNK_BYTES", 200)
    no_stream(monkeypatch)
    entries = read_trace(p, fmt="mooncake")._entries
    kept = [e.parsed.block_keys for e in entries if e.parsed is not None]
    assert sum(map(len, kept)) <= keep
    if keep > 10**6:
        assert len(kept) == 400
    elif keep:
        assert 0 < len(kept) < 400
    assert [r.line for r in chunked[0]] == sorted(
        range(1, 401), key=lambda i: json.loads(text[i - 1])["timestamp"])


def test_pass_2_decodes_runs_of_lines_not_kept(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mooncake_mod.Parser, "keep_block_ids", 0)
    monkeypatch.setattr(reader_mod, "CHUNK_BYTES", 1000)
    no_stream(monkeypatch)
    p = tmp_path / "t.jsonl"
    p.write_bytes("\r\n".join(lines(300, seed=5)).encode())  # CRLF, no final newline
    runs: list[int] = []
    real = TraceReader._redecoded

    def spy(self: TraceReader, i: int) -> list[Any]:
        out = real(self, i)
        runs.append(len(out))
        return out

    monkeypatch.setattr(TraceReader, "_redecoded", spy)
    r = read_trace(p, fmt="mooncake")
    got = list(r)
    assert sum(runs) == 300 and max(runs) > 5  # whole runs, each within CHUNK_BYTES
    monkeypatch.setattr(TraceReader, "_scan_mooncake_chunks", lambda self, keep: (0, 0, keep))
    monkeypatch.setattr(TraceReader, "_redecoded", real)
    assert got == list(read_trace(p, fmt="mooncake"))


class _SpyDecoder:
    """A decoder that notes the type of every buffer pass 2 hands it."""

    def __init__(self, real: Any, seen: list[type]) -> None:
        self.real, self.seen = real, seen

    def decode_lines(self, data: Any) -> Any:
        self.seen.append(type(data))
        return self.real.decode_lines(data)


@pytest.mark.parametrize("streamed", [True, False], ids=["streamed", "runs-decoded-again"])
def test_pass_2_decodes_the_mapped_file_in_place(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  streamed: bool) -> None:
    """Pass 2 hands the decoder views of the mapped file, not copies of its chunks (a
    copy per chunk churns the heap: about 500 more page faults on the conversation
    trace, BENCHMARKS.md), and no view outlives its chunk: the reader closes mid-way."""
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join(lines(300, seed=8)) + "\n")
    monkeypatch.setattr(reader_mod, "STREAM_CHUNK_BYTES", 200)
    monkeypatch.setattr(reader_mod, "CHUNK_BYTES", 1000)
    if not streamed:
        monkeypatch.setattr(mooncake_mod.Parser, "keep_block_ids", 0)
        no_stream(monkeypatch)
    want = list(read_trace(p, fmt="mooncake"))
    r = read_trace(p, fmt="mooncake")
    assert bool(r._runs) == streamed
    seen: list[type] = []
    name = "RECORD_DECODER" if streamed else "LINE_DECODER"
    monkeypatch.setattr(reader_mod, name, _SpyDecoder(getattr(reader_mod, name), seen))
    it = iter(r)
    got = [next(it) for _ in range(150)]
    r.close()  # a view still held would make this raise BufferError
    assert got == want[:150]
    assert seen and set(seen) == {memoryview}


def test_blank_and_bad_lines_in_later_chunks(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    text = lines(300, seed=1)
    text[150] = ""                                           # blank
    text[151] = "   "                                        # whitespace only
    text[220] = '{"timestamp": 1, "input_length": 9}'        # no output_length
    text[260] = json.dumps({"timestamp": 2, "input_length": 512, "output_length": 1,
                            "hash_ids": [1, 2, 3]})          # more ids than blocks
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join(text))                            # no final newline
    chunked, plain = read_both(p, monkeypatch, skip_bad=2)
    assert chunked == plain and 0 < TAKEN[-1] < 150          # stopped at the blank line
    assert [line for line, _ in chunked[1]] == [221, 261]
    streamed, r = read_streamed(p, monkeypatch, skip_bad=2)
    assert streamed == plain and r._runs == []  # not streamed: it has bad lines
    errors = []
    for chunk in (200, 1 << 20):
        monkeypatch.setattr(reader_mod, "CHUNK_BYTES", chunk)
        monkeypatch.setattr(reader_mod, "STREAM_CHUNK_BYTES", chunk)
        with pytest.raises(InputError) as err:
            read_trace(p, fmt="mooncake", skip_bad=1)
        errors.append(str(err.value))
    assert errors[0] == errors[1] and ":261" in errors[0] and "hash_ids" in errors[0]


def test_crlf_lines_and_a_file_of_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p = tmp_path / "t.jsonl"
    p.write_bytes("\r\n".join(lines(50, seed=2)).encode() + b"\r\n")
    chunked, plain = read_both(p, monkeypatch)
    assert chunked == plain and len(chunked[0]) == 50
    streamed, r = read_streamed(p, monkeypatch)
    assert streamed == plain and len(r._runs) > 1
    p.write_text(lines(1, seed=3)[0])
    chunked, plain = read_both(p, monkeypatch)
    assert chunked == plain and len(chunked[0]) == 1
    streamed, r = read_streamed(p, monkeypatch)
    assert streamed == plain and len(r._runs) == 1


@pytest.mark.parametrize("chunk", [1, 200, 1 << 16])
def test_a_sorted_trace_is_streamed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                    chunk: int) -> None:
    """Good lines in timestamp order (ties included): pass 1 keeps only the chunks, and
    every pass reads what the line scan reads; the requests' windows (``period``) too."""
    text = lines(400, seed=6)
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join(text) + "\n")
    (got, bad), r = read_streamed(p, monkeypatch, chunk=chunk)
    with monkeypatch.context() as m:
        no_stream(m)
        m.setattr(TraceReader, "_scan_mooncake_chunks", lambda self, keep: (0, 0, keep))
        plain = read_trace(p, fmt="mooncake")
    assert got == list(plain) and bad == [] and len(r) == len(plain) == 400
    assert r._entries == [] and r._runs and sum(n for *_, n in r._runs) == 400
    assert [first for _, _, first, _ in r._runs] == list(
        accumulate((n for *_, n in r._runs[:-1]), initial=1))
    assert (r.timed, r.has_rounds) == (plain.timed, plain.has_rounds) == (True, False)
    assert list(r) == got  # a second pass decodes the same
    assert {q.period for q in got} == {q.period for q in plain} and len({q.period for q in got}) > 1


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_a_timestamp_going_back_is_not_streamed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                where: str) -> None:
    text = lines(300, seed=7)
    i = {"first": 1, "middle": 150, "last": 299}[where]
    rec = json.loads(text[i])
    rec["timestamp"] = json.loads(text[i - 1])["timestamp"] - 1
    text[i] = json.dumps(rec)
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join(text) + "\n")
    (got, _bad), r = read_streamed(p, monkeypatch)
    assert r._runs == [] and len(r._entries) == 300
    _chunked, plain = read_both(p, monkeypatch)
    assert got == plain[0]
    assert [q.line for q in got].index(i + 1) < [q.line for q in got].index(i)  # served first


BAD_IDS = {"item": lambda r: r["hash_ids"].__setitem__(0, "x"),
           "float": lambda r: r["hash_ids"].__setitem__(-1, 1.5),
           "count": lambda r: r.__setitem__("input_length", 1),
           "null": lambda r: r.__setitem__("hash_ids", None),
           "not a list": lambda r: r.__setitem__("hash_ids", {"a": 1})}


@pytest.mark.parametrize("chunk", [1, 200, 1 << 16])
@pytest.mark.parametrize("bad", list(BAD_IDS))
def test_late_id_checks_leave_the_ids_to_pass_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                chunk: int, bad: str) -> None:
    """With ``late_id_checks``, pass 1 of a sorted trace does not check the block ids: a
    bad one raises the error the default reader raises at construction (same words, line
    and field) when iteration reaches its chunk, after every request before that chunk.
    A good trace reads the same either way; ``skip_bad`` turns the late checks off."""
    text = lines(300, seed=8)
    i = 180  # the bad line (1-based); lines(…) gives it ids, so it has something to spoil
    rec = json.loads(text[i - 1])
    rec["hash_ids"] = rec["hash_ids"] or [7, 8]
    rec["input_length"] = max(rec["input_length"], 2 * 512)
    BAD_IDS[bad](rec)
    text[i - 1] = json.dumps(rec)
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join(text) + "\n")
    with monkeypatch.context() as m:
        m.setattr(reader_mod, "STREAM_CHUNK_BYTES", chunk)
        with pytest.raises(InputError) as eager:
            read_trace(p, fmt="mooncake")
        r = read_trace(p, fmt="mooncake", late_id_checks=True)
        assert r._runs and len(r) == 300  # streamed; pass 1 took the bad line
        got: list[Request] = []
        with pytest.raises(InputError) as late:
            for q in r:
                got.append(q)
        skipping = read_trace(p, fmt="mooncake", late_id_checks=True, skip_bad=1)
    assert (str(late.value), late.value.line, late.value.field) == (
        str(eager.value), eager.value.line, eager.value.field)
    assert eager.value.line == i and str(p) in str(eager.value)
    assert [q.line for q in got] == list(range(1, len(got) + 1)) and len(got) < i
    if chunk == 1:  # a chunk a line: every request before the bad one was served
        assert len(got) == i - 1
    assert [b for b, _ in skipping.bad_lines] == [i] and len(skipping) == 299
    assert [q.line for q in skipping] == [n for n in range(1, 301) if n != i]
    text[i - 1] = text[i - 2]  # good again (a tie with the line before)
    p.write_text("\n".join(text) + "\n")
    with monkeypatch.context() as m:
        m.setattr(reader_mod, "STREAM_CHUNK_BYTES", chunk)
        assert list(read_trace(p, fmt="mooncake", late_id_checks=True)) == list(
            read_trace(p, fmt="mooncake"))
