"""Streaming trace reader: kvtool, Mooncake, Qwen-Bailian JSONL, Azure CSV → :class:`Request`.

Requests come in serve order.

Serve order (docs/definitions.md, "Order"): timestamp order, file order on ties; a trace without
timestamps is served round by round (every session's round 1, then round 2, …), file
order within a round.

The reader makes two passes over a memory-mapped file, so its memory is proportional to
the number of lines, never to the number of blocks:

1. at construction, every line is decoded and validated in file order (block keys are
   not kept, but for Mooncake traces' first :data:`KEEP_BLOCK_IDS`), which fixes the
   serve order and infers rounds; Mooncake lines are decoded a chunk at a time while the
   chunks are clean, and the cyclic collector is paused meanwhile;
2. on iteration, each good line is decoded again, in serve order, and its keys built.

A Mooncake trace whose lines are all good and in timestamp order (the published ones)
is streamed: its serve order is file order, so pass 1 keeps nothing per line, only each
chunk's offsets, and pass 2 decodes the chunks again in order; its memory is then
proportional to the number of chunks.

So every bad line is found before the first request is served, except with
``late_id_checks``: a streamed trace's pass 1 then checks the block ids only for being
there, and pass 2 checks the rest of them as it reads them (for a caller that writes
nothing while it iterates: ``kvtool replay --simulate``). Formats (docs/trace.md):

* **kvtool** and **mooncake** JSONL, timestamps in ms;
* **bailian** (Qwen-Bailian) JSONL: ``timestamp`` in seconds (× 1000 here); a request's
  session is the root of its ``chat_id`` ← ``parent_chat_id`` chain, its round its ``turn``;
* **azure** CSV (``TIMESTAMP,ContextTokens,GeneratedTokens``): arrivals and lengths only.
  Timestamps become ms after the earliest row. The trace has no prefix structure, so each
  request gets fresh keys, ``ceil(input_length / block_tokens)`` of them, numbered 0, 1,
  2, … in serve order: nothing is ever shared, every lookup misses.
 A bad line raises
:class:`~kvtool.errors.InputError` naming file, line and field. With ``skip_bad=N`` the
first N bad lines (in file order) are skipped and listed in
:attr:`TraceReader.bad_lines`; the next one raises.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import sys
from collections.abc import Iterator
from itertools import accumulate
from pathlib import Path
from typing import Any, cast

import msgspec

from kvtool.errors import InputError, param
from kvtool.gcpause import cyclic_gc_paused
from kvtool.trace.formats import FALLBACK, TRACE_FORMATS, format_module
from kvtool.trace.formats.lines import BadLine, LineParser, Parsed
from kvtool.trace.formats.mooncake import (
    HEAD_DECODER,
    LINE_DECODER,
    RECORD_DECODER,
    parsed_mooncake,
)
from kvtool.trace.schema import DEFAULT_BLOCK_TOKENS, DEFAULT_WINDOW_MS, FORMATS, Request, TraceFormat


class _Entry(msgspec.Struct, gc=False):
    """One good line after pass 1 (a msgspec Struct: built once per line, in C; gc=False:
    it holds numbers, strings and a :class:`Parsed`, never a reference cycle)."""

    line: int
    start: int
    end: int
    timestamp: float
    session: str | int | None
    round: int | None
    parsed: Parsed | None = None
    """Pass 1's decoded line, kept (Mooncake traces, within
    :data:`~kvtool.trace.formats.mooncake.KEEP_BLOCK_IDS`) so that pass 2 does not decode
    it again."""


CHUNK_BYTES = 1 << 20
"""Pass 1 decodes Mooncake traces in chunks of about this many bytes (whole lines), and
pass 2 the lines it did not keep."""

STREAM_CHUNK_BYTES = 1 << 16
"""A Mooncake trace in timestamp order is decoded in chunks of about this many bytes
(:meth:`TraceReader._scan_sorted_mooncake`), in both passes. Small on purpose: a chunk's
decoded lines then reuse the memory the last chunk's freed, where larger chunks make
the allocator map fresh pages, and each page's first touch is a page fault (about 3 µs
here: BENCHMARKS.md, "Issue 23 speed, fifth pass")."""


class TraceReader:
    """An iterable over a trace's requests in serve order; iterate it as often as needed.

    Attributes known after construction (pass 1): :attr:`format`, :attr:`block_tokens`,
    :attr:`timed`, :attr:`has_rounds` and ``len(reader)`` (requests that passed pass 1).
    :attr:`bad_lines` grows as bad lines are met (``(line, message)`` pairs).

    ``late_id_checks=True`` lets a streamed Mooncake trace (lines in timestamp order)
    leave its block ids' checks to pass 2, which decodes them anyway: pass 1 then takes a
    third to a half of the time (BENCHMARKS.md, "Issue 23 speed, eighth pass"), and a bad
    id raises the same :class:`~kvtool.errors.InputError` when iteration reaches its line,
    after the requests before it. It is for callers that write nothing while they iterate.
    It does nothing with ``skip_bad`` (a skipped line must be known before ``len()``).

    ``timed`` is True when the trace has timestamps (Mooncake, Qwen-Bailian and Azure
    traces always; kvtool traces when their lines do): a replay may then run the requests
    at their ``timestamp``, which the reader keeps as the file gives it (in ms).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        fmt: str = "auto",
        block_tokens: int | None = None,
        skip_bad: int = 0,
        window_ms: float = DEFAULT_WINDOW_MS,
        late_id_checks: bool = False,
    ) -> None:
        if fmt not in FORMATS:
            raise InputError(f"unknown trace format {fmt!r} (use {', '.join(FORMATS)})",
                             field="format")
        if block_tokens is not None and block_tokens <= 0:
            raise InputError(f"must be a positive number of tokens, got {block_tokens}",
                             field="block_tokens")
        if skip_bad < 0:
            raise InputError(f"must not be negative, got {skip_bad}", field="skip_bad")
        if not window_ms > 0:
            raise InputError(f"must be positive, got {window_ms}", field="window_ms")
        self.path = str(path)
        self.skip_bad = skip_bad
        self.window_ms = float(window_ms)
        self._late_ids = late_id_checks and skip_bad == 0
        self.bad_lines: list[tuple[int, str]] = []
        self._bad_seen: set[int] = set()
        self._buf = self._open(self.path)
        detected, first_block_tokens = self._detect()
        self.format: TraceFormat = detected if fmt == "auto" else fmt
        if self.format != "kvtool":
            first_block_tokens = None
        self.block_tokens: int = (block_tokens or first_block_tokens
                                  or DEFAULT_BLOCK_TOKENS[self.format])
        self._block_tokens_source = (
            f"--block-tokens {block_tokens}" if block_tokens is not None
            else f"{first_block_tokens} on its first line" if first_block_tokens is not None
            else f"the {self.format} default of {self.block_tokens}")
        self._entries: list[_Entry] = []
        parser_class: type[LineParser] = format_module(self.format).Parser
        self._lineparser = parser_class(self.path, self.block_tokens,
                                        explicit_block_tokens=block_tokens,
                                        block_tokens_source=self._block_tokens_source)
        self._parse = self._lineparser.parse
        self.timed = False
        self.has_rounds = False
        self._t0 = 0.0
        self._runs: list[tuple[int, int, int, int]] = []
        """A streamed Mooncake trace (:meth:`_scan_sorted_mooncake`): ``(start, end,
        first line, lines)`` of each chunk, in file order, which is serve order;
        ``_entries`` is then empty."""
        self._scan()

    # -- input ---------------------------------------------------------------------------
    @staticmethod
    def _open(path: str) -> bytes | mmap.mmap:
        if path == "-":
            return sys.stdin.buffer.read()
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size == 0:
                    return b""
                return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except FileNotFoundError:
            raise InputError("no such file", file=path) from None
        except IsADirectoryError:
            raise InputError("is a directory, not a trace file", file=path) from None
        except PermissionError:
            raise InputError("permission denied", file=path) from None
        except (OSError, ValueError) as err:
            raise InputError(f"cannot read: {err}", file=path) from None

    def _lines(self, pos: int = 0, line_no: int = 0) -> Iterator[tuple[int, int, int, bytes]]:
        """``(line_no, start, end, text)`` of every non-blank line (without the newline),
        from offset ``pos``, the start of line ``line_no + 1``."""
        buf = self._buf
        size = len(buf)
        find = buf.find
        while pos < size:
            line_no += 1
            nl = find(b"\n", pos)
            end = size if nl < 0 else nl
            raw = buf[pos:end]
            if raw and not raw.isspace():
                yield line_no, pos, end, raw
            pos = end + 1

    def _detect(self) -> tuple[TraceFormat, int | None]:
        """Format and ``block_tokens`` of the first parseable record.

        A format known by its header (azure: a CSV header naming the Azure columns) when
        the first non-blank line is that header; otherwise, from the first line that is a
        JSON object, the first registered format one of whose keys it has (kvtool: a
        kvtool-only key, ``session``, ``round``, ``block_tokens``, ``tokens``; bailian:
        ``chat_id``, ``parent_chat_id`` or ``turn``), else mooncake
        (:data:`kvtool.trace.formats.TRACE_FORMATS`).
        """
        first_line = True
        for _line, _start, _end, raw in self._lines():
            if first_line:
                for name, f in TRACE_FORMATS.items():
                    if f.header and format_module(name).is_header(raw):
                        return name, None
            first_line = False
            try:
                first = json.loads(raw)
            except ValueError:
                continue
            if isinstance(first, dict):
                bt = first.get("block_tokens")
                bt = bt if isinstance(bt, int) and not isinstance(bt, bool) and bt > 0 else None
                for name, f in TRACE_FORMATS.items():
                    if f.keys & first.keys():
                        return name, bt if name == "kvtool" else None
                return FALLBACK, None
        return "kvtool", None

    # -- errors ----------------------------------------------------------------------------
    def _bad(self, line: int, bad: BadLine) -> None:
        """Record a bad line, or raise when the ``skip_bad`` allowance is used up."""
        if line in self._bad_seen:
            return
        if len(self.bad_lines) >= self.skip_bad:
            hint = "" if self.skip_bad == 0 else f" (more than {param('skip_bad')} {self.skip_bad} bad lines)"
            raise InputError(bad.message + hint, file=self.path, line=line, field=bad.field)
        self._bad_seen.add(line)
        self.bad_lines.append((line, f"field '{bad.field}': {bad.message}" if bad.field
                               else bad.message))

    # -- pass 1 ----------------------------------------------------------------------------
    def _scan(self) -> None:
        # The cyclic collector is paused while pass 1 decodes: it builds only acyclic
        # records (numbers, strings, lists of ints), and on a long trace the collector's
        # passes over the kept lists cost as much as a third of the decoding
        # (BENCHMARKS.md, "Replay speed").
        with cyclic_gc_paused():
            self._scan_lines()

    def _clean_chunks(self, decoder: msgspec.json.Decoder[Any], chunk_bytes: int
                      ) -> Iterator[tuple[int, int, bytes, int, list[Any]]]:
        """The file's leading chunks of whole lines, about ``chunk_bytes`` each, decoded
        with one ``decode_lines`` call a chunk: ``(start, end, chunk, lines, records)``, up
        to the first chunk that does not decode or holds a blank line (``decode_lines``
        skips those, so line numbers would no longer follow from the order)."""
        buf = self._buf
        size = len(buf)
        pos = 0
        while pos < size:
            nl = buf.find(b"\n", pos + chunk_bytes)
            end = size if nl < 0 else nl + 1
            chunk = buf[pos:end]
            lines = chunk.count(b"\n") + (not chunk.endswith(b"\n"))
            try:
                recs = decoder.decode_lines(chunk)
            except msgspec.MsgspecError:
                return
            if len(recs) != lines:
                return
            yield pos, end, chunk, lines, recs
            pos = end

    def _scan_sorted_mooncake(self) -> bool:
        """Pass 1 of a Mooncake trace whose lines are all good, none blank, and in
        timestamp order, as the published traces are; True when the trace is one.

        Its serve order is then file order, so pass 1 keeps nothing per line: it checks
        every line, a chunk of about :data:`STREAM_CHUNK_BYTES` at a time (one
        ``decode_lines`` call each), and keeps each chunk's offsets and first line in
        :attr:`_runs`; pass 2 (:meth:`_stream`) decodes the chunks again. Decoding twice
        costs less than keeping the block ids: a kept id holds about 40 B, and the pages
        they fill fault in (BENCHMARKS.md, "Issue 23 speed, fifth pass"). At the first
        chunk that is not clean, or the first timestamp that goes back, it returns False
        having kept nothing, and pass 1 starts again the general way. With late id checks
        the ids are only checked to be there (:class:`_MooncakeHead`), and
        :meth:`_stream` checks the rest.
        """
        bt = self.block_tokens
        late = self._late_ids
        runs: list[tuple[int, int, int, int]] = []
        pos = line_no = 0
        last = -math.inf
        for start, end, _chunk, lines, recs in self._clean_chunks(
                HEAD_DECODER if late else RECORD_DECODER, STREAM_CHUNK_BYTES):
            for rec in recs:
                ts = rec.timestamp
                if ts < last or (not late and len(rec.hash_ids) > -(-rec.input_length // bt)):
                    return False
                last = ts
            if not runs:
                self._t0 = recs[0].timestamp
            runs.append((start, end, line_no + 1, lines))
            pos = end
            line_no += lines
        if not runs or pos < len(self._buf):  # empty, or a chunk that is not clean
            return False
        self._runs = runs
        self.timed = True
        return True

    def _scan_mooncake_chunks(self, keep: int) -> tuple[int, int, int]:
        """Pass 1 over the leading chunks of a Mooncake trace, one decoder call per chunk
        of about :data:`CHUNK_BYTES` (msgspec's ``decode_lines``), instead of one per line.

        A chunk is taken only when every line in it is a good Mooncake line and none is
        blank (so line numbers follow from the order). Its decoded lines are kept while
        their block ids fit in ``keep``; past that, a chunk's entries keep only their
        lines' offsets, and pass 2 decodes them again (:meth:`_redecoded`), a run at a
        time. The first chunk that is not taken is left, with the rest, to the
        line-by-line scan, which finds and words the errors exactly as before. Returns the
        offset and the number of lines taken, and what is left of ``keep``.
        """
        bt = self.block_tokens
        entries = self._entries
        pos = line_no = 0
        for start, end, chunk, lines, recs in self._clean_chunks(LINE_DECODER, CHUNK_BYTES):
            ids = 0
            for rec in recs:
                hash_ids = rec.hash_ids
                if (rec.timestamp is None or rec.input_length is None
                        or rec.output_length is None or hash_ids is None
                        or len(hash_ids) > -(-rec.input_length // bt)):
                    ids = -1
                    break
                ids += len(hash_ids)
            if ids < 0:
                break
            checked = cast(list[Any], recs)  # every field present: checked just above
            first = line_no + 1
            if ids <= keep:
                keep -= ids
                entries += [_Entry(line, 0, 0, rec.timestamp, None, None,
                                   parsed_mooncake(rec, bt))
                            for line, rec in enumerate(checked, first)]
            else:  # keep the offsets only: each line's start, and its end before the newline
                keep = 0
                starts = list(accumulate((len(t) + 1 for t in chunk.split(b"\n")), initial=start))
                entries += [_Entry(first + i, starts[i], starts[i + 1] - 1, rec.timestamp, None,
                                   None) for i, rec in enumerate(checked)]
            pos = end
            line_no += lines
        return pos, line_no, keep

    def _scan_lines(self) -> None:
        lp = self._lineparser
        parse = self._parse
        entries = self._entries
        timed: bool | None = None
        keep = lp.keep_block_ids
        wants_header, check_across = lp.wants_header, type(lp).seen is not LineParser.seen
        pos = line_no = 0
        if lp.chunked:
            if self._scan_sorted_mooncake():
                return
            pos, line_no, keep = self._scan_mooncake_chunks(keep)
            if entries:
                timed = True
        for line, start, end, raw in self._lines(pos, line_no):
            if wants_header:
                lp.header(raw, line)
                wants_header = False
                continue
            try:
                req = parse(raw, keys=False)
                has_ts = req.timestamp is not None
                if timed is None:
                    timed = has_ts
                elif has_ts != timed:
                    raise BadLine("missing, but earlier lines have timestamps" if timed else
                                  "present, but earlier lines have none (all or none)",
                                  "timestamp")
                if check_across:
                    lp.seen(req, line)
            except BadLine as bad:
                self._bad(line, bad)
                continue
            n = len(req.block_keys)
            if keep and keep >= n:
                keep -= n
                entries.append(_Entry(line, start, end, req.timestamp or 0.0, req.session,
                                      req.round, req))
            else:
                keep = 0
                entries.append(_Entry(line, start, end, req.timestamp or 0.0, req.session,
                                      req.round))
        if not entries:
            raise InputError("no requests in the trace" if not self.bad_lines
                             else "no valid requests in the trace", file=self.path)
        self.timed = bool(timed)
        lp.finish(entries)
        self._order()

    def _order(self) -> None:
        """Sort into serve order and infer rounds (request i of a session is round i)."""
        entries = self._entries
        self.has_rounds = any(e.session is not None or e.round is not None for e in entries)
        if self.timed:
            # list.sort is stable (ties keep file order) and linear on sorted input.
            entries.sort(key=lambda e: e.timestamp)
            self._infer_rounds()
            self._t0 = entries[0].timestamp
        else:
            self._infer_rounds()
            entries.sort(key=lambda e: e.round if e.round is not None else 1)

    def _infer_rounds(self) -> None:
        count: dict[str | int, int] = {}
        for e in self._entries:
            if e.session is None:
                continue
            n = count.get(e.session, 0) + 1
            count[e.session] = n
            if e.round is None:
                e.round = n

    # -- pass 2 ----------------------------------------------------------------------------
    def __len__(self) -> int:
        return sum(run[3] for run in self._runs) if self._runs else len(self._entries)

    def __iter__(self) -> Iterator[Request]:
        return self._stream() if self._runs else self._served()

    def _stream(self) -> Iterator[Request]:
        """The requests of a streamed Mooncake trace (:meth:`_scan_sorted_mooncake`):
        its chunks decoded again (:meth:`_decoded`), in file order. With late id checks,
        a chunk's ids are checked here, before any of its requests is yielded."""
        bt, t0, window, floor = self.block_tokens, self._t0, self.window_ms, math.floor
        decoder = RECORD_DECODER
        late = self._late_ids
        for start, end, first, lines in self._runs:
            try:
                recs = self._decoded(decoder, start, end)
            except msgspec.MsgspecError:
                recs = []
            if late and (len(recs) != lines or any(
                    len(rec.hash_ids) > -(-rec.input_length // bt) for rec in recs)):
                self._check_lines(start, end, first)
                recs = []  # no line is bad: the file changed under us
            if len(recs) != lines:  # pragma: no cover - only if the file changed under us
                raise InputError("changed while being read: the lines from here no longer "
                                 "decode as they did", file=self.path, line=first)
            # (pass 1 or the late check above checked the ids' count; a Mooncake request has
            # no round, so its period is its window: :meth:`_served`'s rule for a timed
            # request without a round)
            for line, rec in enumerate(recs, first):
                ts = rec.timestamp
                yield Request(ts, rec.input_length, rec.output_length, rec.hash_ids, bt, None,
                              None, line, floor((ts - t0) / window) + 1)

    def _served(self) -> Iterator[Request]:
        """The requests in serve order, from :attr:`_entries`."""
        fresh = self._lineparser.fresh_keys
        next_key = 0
        # a timed request without a round is filed under its window (inline: this loop
        # runs once per request of every replay)
        timed, t0, window, floor = self.timed, self._t0, self.window_ms, math.floor
        run: list[Parsed] = []  # lines decoded again (:meth:`_redecoded`), in order
        taken = 0
        for i, e in enumerate(self._entries):
            req = e.parsed
            if req is None:  # a run holds consecutive entries that pass 1 did not keep
                if taken == len(run):
                    run, taken = self._redecoded(i), 0
                req = run[taken]
                taken += 1
            keys = req.block_keys
            if fresh:  # no prefix structure: every block is new (module docstring)
                n = -(-req.input_length // self.block_tokens)
                keys = list(range(next_key, next_key + n))
                next_key += n
            rnd = e.round
            yield Request(e.timestamp, req.input_length, req.output_length, keys,
                          req.block_tokens, e.session, rnd, e.line,
                          None if rnd is not None or not timed
                          else floor((e.timestamp - t0) / window) + 1)

    def _check_lines(self, start: int, end: int, first: int) -> None:
        """Raise the error of the first bad Mooncake line in the file's bytes
        ``start:end`` (line ``first`` on), worded as pass 1 words it; return when none
        is bad. Late id checks only, so ``skip_bad`` is 0 and :meth:`_bad` raises."""
        for line, _start, stop, raw in self._lines(start, first - 1):
            if stop > end:
                break
            try:
                self._parse(raw, keys=True)
            except BadLine as bad:
                self._bad(line, bad)

    def _decoded(self, decoder: msgspec.json.Decoder[Any], start: int, end: int) -> list[Any]:
        """``decoder.decode_lines`` of the file's bytes ``start:end``, read in place: from a
        view of the mapped file, released before it returns (a copy per chunk churns the
        heap: BENCHMARKS.md, "Issue 23 speed, seventh pass"; pass 1 copies its chunks,
        whose lines it counts with ``bytes`` methods)."""
        with memoryview(self._buf) as whole, whole[start:end] as part:
            return decoder.decode_lines(part)

    def _redecoded(self, i: int) -> list[Parsed]:
        """Entry ``i``'s line decoded again, with the lines right after it in the file
        when they follow it in serve order too and are not kept (a sorted Mooncake
        trace past :data:`KEEP_BLOCK_IDS`): those go to the decoder as one chunk of up to
        :data:`CHUNK_BYTES`."""
        entries, buf, bt = self._entries, self._buf, self.block_tokens
        e = entries[i]
        j = i + 1
        if self._lineparser.chunked:
            stop = min(len(entries), i + 1 + CHUNK_BYTES // 64)
            limit = e.start + CHUNK_BYTES
            while (j < stop and entries[j].parsed is None and entries[j].start == entries[j - 1].end + 1
                   and entries[j].end <= limit):
                j += 1
        if j > i + 1:
            try:
                recs = self._decoded(LINE_DECODER, e.start, entries[j - 1].end)
            except msgspec.MsgspecError:  # pragma: no cover - only if the file changed under us
                recs = []
            if len(recs) == j - i:  # (pass 1 checked every field of these lines)
                return [parsed_mooncake(r, bt) for r in recs]
        try:
            return [self._parse(buf[e.start:e.end], keys=True)]
        except BadLine as bad:  # pragma: no cover - only if the file changed under us
            raise InputError(bad.message, file=self.path, line=e.line, field=bad.field) from None

    def close(self) -> None:
        if isinstance(self._buf, mmap.mmap):
            self._buf.close()

    def __enter__(self) -> TraceReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_trace(
    path: str | os.PathLike[str],
    *,
    fmt: str = "auto",
    block_tokens: int | None = None,
    skip_bad: int = 0,
    window_ms: float = DEFAULT_WINDOW_MS,
    late_id_checks: bool = False,
) -> TraceReader:
    """Open a trace (``"-"`` reads stdin); see :class:`TraceReader`.

    ``fmt="auto"`` picks azure when the first line is the Azure CSV header; else, from the
    first JSON record, kvtool when it has a kvtool-only key (``session``, ``round``,
    ``block_tokens``, ``tokens``), bailian when it has ``chat_id``, ``parent_chat_id`` or
    ``turn``, else Mooncake. ``block_tokens`` overrides the trace's block size (the first
    line's ``block_tokens``, else 256 for kvtool and Azure, 512 for Mooncake, 16 for
    Qwen-Bailian). Requests without a round in a timed trace get a ``period``: the
    1-based index of their ``window_ms`` window from the first request.
    ``late_id_checks``: see :class:`TraceReader`.
    """
    return TraceReader(Path(path) if path != "-" else "-", fmt=fmt, block_tokens=block_tokens,
                       skip_bad=skip_bad, window_ms=window_ms, late_id_checks=late_id_checks)
