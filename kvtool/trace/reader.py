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

import datetime as dt
import json
import math
import mmap
import os
import re
import sys
from collections.abc import Iterator
from itertools import accumulate
from pathlib import Path
from typing import Annotated, Any, cast

import msgspec

from kvtool.errors import InputError, param
from kvtool.gcpause import cyclic_gc_paused
from kvtool.trace.hashing import TOKEN_MAX, chain_hashes
from kvtool.trace.schema import (
    AZURE_COLUMNS,
    BAILIAN_KEYS,
    DEFAULT_BLOCK_TOKENS,
    DEFAULT_WINDOW_MS,
    FORMATS,
    KVTOOL_ONLY_KEYS,
    Request,
    TraceFormat,
)

NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
PosInt = Annotated[int, msgspec.Meta(ge=1)]
TokenId = Annotated[int, msgspec.Meta(ge=0, le=TOKEN_MAX)]


class _Line(msgspec.Struct, gc=False):
    """A whole kvtool line; presence rules are checked by hand for clear errors."""

    timestamp: float | None = None
    input_length: NonNegInt | None = None
    output_length: NonNegInt | None = None
    hash_ids: list[int] | None = None
    tokens: list[TokenId] | None = None
    session: str | int | None = None
    round: PosInt | None = None
    block_tokens: PosInt | None = None


class _MooncakeLine(msgspec.Struct, gc=False):
    timestamp: float | None = None
    input_length: NonNegInt | None = None
    output_length: NonNegInt | None = None
    hash_ids: list[int] | None = None


class _MooncakeRecord(msgspec.Struct, gc=False):
    """A Mooncake line with every field present, as a streamed trace's lines are
    (:meth:`TraceReader._scan_sorted_mooncake`): the decoder checks their presence, so
    no per-line code does; a line without one is left to the scan that words the error."""

    timestamp: float
    input_length: NonNegInt
    output_length: NonNegInt
    hash_ids: list[int]


class _BailianLine(msgspec.Struct, gc=False):
    """A Qwen-Bailian line (its README's schema); ``type`` is checked, then ignored."""

    chat_id: int | str | None = None
    parent_chat_id: int | str | None = None
    timestamp: float | None = None
    input_length: NonNegInt | None = None
    output_length: NonNegInt | None = None
    type: str | None = None
    turn: PosInt | None = None
    hash_ids: list[int] | None = None


class _MooncakeHead(msgspec.Struct, gc=False):
    """A Mooncake line with every field present, its block ids left undecoded (checked
    to be present only): pass 1 of a streamed trace with late id checks
    (:meth:`TraceReader._scan_sorted_mooncake`). Building the ids' ints is most of a
    line's decoding; pass 2 builds them anyway."""

    timestamp: float
    input_length: NonNegInt
    output_length: NonNegInt
    hash_ids: msgspec.Raw


_KVTOOL_DECODER = msgspec.json.Decoder(_Line)
_MOONCAKE_DECODER = msgspec.json.Decoder(_MooncakeLine)
_RECORD_DECODER = msgspec.json.Decoder(_MooncakeRecord)
_HEAD_DECODER = msgspec.json.Decoder(_MooncakeHead)
_BAILIAN_DECODER = msgspec.json.Decoder(_BailianLine)
BAILIAN_ROOT = -1
"""``parent_chat_id`` of a session's first request in Qwen-Bailian traces."""
# (patterns compiled on first use, by re's cache: the Mooncake path needs neither)
_AZURE_TIME_RE = (r"^(\d{4})-(\d{2})-(\d{2})[ T](\d{2}):(\d{2}):(\d{2})(?:\.(\d+))?"
                  r"(?:(Z)|([+-])(\d{2}):?(\d{2}))?$")

_TYPE_WORDS = {"int": "an integer", "float": "a number", "str": "a string", "array": "a list",
               "object": "a JSON object", "bool": "true/false", "null": "null"}
_PATH_RE = r"^\$\.([A-Za-z_][A-Za-z0-9_]*)((?:\[\d+\])*)"


class _BadLine(Exception):
    def __init__(self, message: str, field: str | None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field


# _Parsed and _Entry are built once per line: msgspec Structs, whose construction runs in
# C (a NamedTuple's or a dataclass's runs Python code), for the reader's start-up time.
# gc=False (here, on the line Structs and on Request): they hold numbers, strings and lists
# of ints, never a reference cycle, so the cyclic collector need not traverse them.
class _Parsed(msgspec.Struct, frozen=True, gc=False):
    """A validated line before serve-order fields (round inference, period) are known."""

    timestamp: float | None
    input_length: int
    output_length: int
    block_keys: list[int]
    block_tokens: int
    session: str | int | None
    round: int | None
    parent: str | int | None = None
    """Qwen-Bailian: ``parent_chat_id`` (None for a root); ``session`` holds ``chat_id``."""


def _parsed_mooncake(rec: Any, block_tokens: int) -> _Parsed:
    """A Mooncake line, decoded and checked (every field present), as :class:`_Parsed`."""
    return _Parsed(rec.timestamp, rec.input_length, rec.output_length, rec.hash_ids,
                   block_tokens, None, None)


class _Entry(msgspec.Struct, gc=False):
    """One good line after pass 1."""

    line: int
    start: int
    end: int
    timestamp: float
    session: str | int | None
    round: int | None
    parsed: _Parsed | None = None
    """Pass 1's decoded line, kept (Mooncake traces, within :data:`KEEP_BLOCK_IDS`) so
    that pass 2 does not decode it again."""


CHUNK_BYTES = 1 << 20
"""Pass 1 decodes Mooncake traces in chunks of about this many bytes (whole lines), and
pass 2 the lines it did not keep."""

STREAM_CHUNK_BYTES = 1 << 16
"""A Mooncake trace in timestamp order is decoded in chunks of about this many bytes
(:meth:`TraceReader._scan_sorted_mooncake`), in both passes. Small on purpose: a chunk's
decoded lines then reuse the memory the last chunk's freed, where larger chunks make
the allocator map fresh pages, and each page's first touch is a page fault (about 3 µs
here: BENCHMARKS.md, "Issue 23 speed, fifth pass")."""

KEEP_BLOCK_IDS = 2_000_000
"""Pass 1 keeps decoded Mooncake lines until they hold this many block ids (about 40 B
each, so at most about 80 MB): a trace that size is decoded once; beyond it, pass 2
decodes the rest again (a chunk at a time where serve order follows the file), so
memory stays bounded whatever the trace's length."""


def _words(type_expr: str) -> str:
    parts = [p.strip() for p in type_expr.split("|") if p.strip() != "null"]
    return " or ".join(_TYPE_WORDS.get(p, p) for p in parts)


def _explain_validation(err: msgspec.ValidationError, raw: bytes) -> _BadLine:
    """Turn msgspec's ``Expected `int`, got `str` - at `$.input_length``` into our words."""
    text = str(err)
    base, _, where = text.partition(" - at ")
    where = where.strip("`")
    field: str | None = None
    index = ""
    m = re.match(_PATH_RE, where)
    if m:
        field, index = m.group(1), m.group(2)
    got = ""
    value: Any = None
    try:
        value = json.loads(raw)
        if field is not None:
            value = value[field]
            for i in re.findall(r"\[(\d+)\]", index):
                value = value[int(i)]
        got = json.dumps(value)
        if len(got) > 40:
            got = got[:37] + "..."
    except (ValueError, KeyError, IndexError, TypeError):
        got = ""
    m2 = re.match(r"Expected `([^`]*)`(?:, got `([^`]*)`)?(.*)$", base)
    if m2:
        expected, _, rest = m2.groups()
        message = f"expected {_words(expected)}{rest}"
        if where == "" and field is None:
            message = f"each line must be {_words(expected)}"
    else:
        message = base[:1].lower() + base[1:]
    if got and where:
        message += f", got {got}"
    if index:
        message = f"item {index.strip('[]').replace('][', ',')}: {message}"
    return _BadLine(message, field)


def _decode(decoder: msgspec.json.Decoder[Any], raw: bytes) -> Any:
    """``decoder.decode(raw)``; a bad line raises :class:`_BadLine` in kvtool's words."""
    try:
        return decoder.decode(raw)
    except msgspec.ValidationError as err:
        raise _explain_validation(err, raw) from None
    except msgspec.DecodeError as err:
        text = str(err)
        if "truncated" in text:
            raise _BadLine("malformed JSON: the line is truncated", None) from None
        raise _BadLine(f"malformed JSON: {text.removeprefix('JSON is malformed: ')}",
                       None) from None


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
        self._explicit_block_tokens = block_tokens
        self._buf = self._open(self.path)
        detected, first_block_tokens = self._detect()
        self.format: TraceFormat = detected if fmt == "auto" else cast(TraceFormat, fmt)
        if self.format != "kvtool":
            first_block_tokens = None
        self.block_tokens: int = (block_tokens or first_block_tokens
                                  or DEFAULT_BLOCK_TOKENS[self.format])
        self._block_tokens_source = (
            f"--block-tokens {block_tokens}" if block_tokens is not None
            else f"{first_block_tokens} on its first line" if first_block_tokens is not None
            else f"the {self.format} default of {self.block_tokens}")
        self._entries: list[_Entry] = []
        self._azure_columns: tuple[int, int, int, int] | None = None
        self._azure_origin_ns: int | None = None
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

        azure when the first non-blank line is a CSV header naming the Azure columns;
        otherwise, from the first line that is a JSON object: kvtool when it has a
        kvtool-only key (``session``, ``round``, ``block_tokens``, ``tokens``), bailian
        when it has ``chat_id``, ``parent_chat_id`` or ``turn``, else mooncake.
        """
        first_line = True
        for _line, _start, _end, raw in self._lines():
            if first_line and _azure_header(raw) is not None:
                return "azure", None
            first_line = False
            try:
                first = json.loads(raw)
            except ValueError:
                continue
            if isinstance(first, dict):
                bt = first.get("block_tokens")
                bt = bt if isinstance(bt, int) and not isinstance(bt, bool) and bt > 0 else None
                if KVTOOL_ONLY_KEYS & first.keys():
                    return "kvtool", bt
                return ("bailian" if BAILIAN_KEYS & first.keys() else "mooncake"), None
        return "kvtool", None

    # -- errors ----------------------------------------------------------------------------
    def _bad(self, line: int, bad: _BadLine) -> None:
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
    def _parser(self) -> Any:
        return {"kvtool": self._parse_kvtool, "mooncake": self._parse_mooncake,
                "bailian": self._parse_bailian, "azure": self._parse_azure}[self.format]

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
                _HEAD_DECODER if late else _RECORD_DECODER, STREAM_CHUNK_BYTES):
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
        for start, end, chunk, lines, recs in self._clean_chunks(_MOONCAKE_DECODER, CHUNK_BYTES):
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
                                   _parsed_mooncake(rec, bt))
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
        parse = self._parser()
        entries = self._entries
        timed: bool | None = None
        chats: dict[str | int, int] = {}       # bailian: chat_id -> line
        parents: dict[str | int, str | int | None] = {}
        keep = KEEP_BLOCK_IDS if self.format == "mooncake" else 0
        pos = line_no = 0
        if self.format == "mooncake":
            if self._scan_sorted_mooncake():
                return
            pos, line_no, keep = self._scan_mooncake_chunks(keep)
            if entries:
                timed = True
        for line, start, end, raw in self._lines(pos, line_no):
            if self.format == "azure" and self._azure_columns is None:
                self._azure_columns = _azure_header(raw)
                if self._azure_columns is None:
                    raise InputError("expected the Azure CSV header naming "
                                     f"{', '.join(AZURE_COLUMNS)}", file=self.path, line=line)
                continue
            try:
                req = parse(raw, keys=False)
                has_ts = req.timestamp is not None
                if timed is None:
                    timed = has_ts
                elif has_ts != timed:
                    raise _BadLine("missing, but earlier lines have timestamps" if timed else
                                   "present, but earlier lines have none (all or none)",
                                   "timestamp")
                if self.format == "bailian":
                    assert req.session is not None
                    if req.session in chats:
                        raise _BadLine(f"{json.dumps(req.session)} is also the chat_id of line "
                                       f"{chats[req.session]}", "chat_id")
                    chats[req.session] = line
                    parents[req.session] = req.parent
            except _BadLine as bad:
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
        if self.format == "azure":
            first = min(e.timestamp for e in entries)
            if first:
                for e in entries:
                    e.timestamp -= first
        if self.format == "bailian":
            self._sessions_from_chains(parents)
        self._order()

    def _sessions_from_chains(self, parents: dict[str | int, str | int | None]) -> None:
        """Qwen-Bailian: a request's session is the root of its ``parent_chat_id`` chain.

        A root has ``parent_chat_id`` -1; a chain whose parent is not in the trace (cut
        off by the trace's window) is rooted at that parent's id.
        """
        root: dict[str | int, str | int] = {}
        for e in self._entries:
            assert e.session is not None
            path: list[str | int] = []
            cur: str | int = e.session
            while True:
                if cur in root:
                    top = root[cur]
                    break
                parent = parents.get(cur)
                if parent is None:  # a root, or a parent outside the trace
                    top = cur
                    break
                if cur in path:
                    raise InputError(f"the parent_chat_id chain from chat_id "
                                     f"{json.dumps(e.session)} loops back to "
                                     f"{json.dumps(cur)}", file=self.path, line=e.line,
                                     field="parent_chat_id")
                path.append(cur)
                cur = parent
            for c in path:
                root[c] = top
            e.session = top

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
        decoder = _RECORD_DECODER
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
        fresh = self.format == "azure"
        next_key = 0
        # a timed request without a round is filed under its window (inline: this loop
        # runs once per request of every replay)
        timed, t0, window, floor = self.timed, self._t0, self.window_ms, math.floor
        run: list[_Parsed] = []  # lines decoded again (:meth:`_redecoded`), in order
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
                self._parse_mooncake(raw, keys=True)
            except _BadLine as bad:
                self._bad(line, bad)

    def _decoded(self, decoder: msgspec.json.Decoder[Any], start: int, end: int) -> list[Any]:
        """``decoder.decode_lines`` of the file's bytes ``start:end``, read in place: from a
        view of the mapped file, released before it returns (a copy per chunk churns the
        heap: BENCHMARKS.md, "Issue 23 speed, seventh pass"; pass 1 copies its chunks,
        whose lines it counts with ``bytes`` methods)."""
        with memoryview(self._buf) as whole, whole[start:end] as part:
            return decoder.decode_lines(part)

    def _redecoded(self, i: int) -> list[_Parsed]:
        """Entry ``i``'s line decoded again, with the lines right after it in the file
        when they follow it in serve order too and are not kept (a sorted Mooncake
        trace past :data:`KEEP_BLOCK_IDS`): those go to the decoder as one chunk of up to
        :data:`CHUNK_BYTES`."""
        entries, buf, bt = self._entries, self._buf, self.block_tokens
        e = entries[i]
        j = i + 1
        if self.format == "mooncake":
            stop = min(len(entries), i + 1 + CHUNK_BYTES // 64)
            limit = e.start + CHUNK_BYTES
            while (j < stop and entries[j].parsed is None and entries[j].start == entries[j - 1].end + 1
                   and entries[j].end <= limit):
                j += 1
        if j > i + 1:
            try:
                recs = self._decoded(_MOONCAKE_DECODER, e.start, entries[j - 1].end)
            except msgspec.MsgspecError:  # pragma: no cover - only if the file changed under us
                recs = []
            if len(recs) == j - i:  # (pass 1 checked every field of these lines)
                return [_parsed_mooncake(r, bt) for r in recs]
        try:
            return [self._parser()(buf[e.start:e.end], keys=True)]
        except _BadLine as bad:  # pragma: no cover - only if the file changed under us
            raise InputError(bad.message, file=self.path, line=e.line, field=bad.field) from None

    def _check_hash_ids(self, ids: list[int], input_length: int) -> None:
        allowed = -(-input_length // self.block_tokens)
        if len(ids) > allowed:
            raise _BadLine(
                f"{len(ids)} block ids, but input_length {input_length} allows at most "
                f"{allowed} at {self.block_tokens} tokens per block", "hash_ids")

    def _parse_mooncake(self, raw: bytes, *, keys: bool) -> _Parsed:
        try:  # the decoder directly: a call less per line
            rec: _MooncakeLine = _MOONCAKE_DECODER.decode(raw)
        except msgspec.MsgspecError:
            rec = _decode(_MOONCAKE_DECODER, raw)  # raises the line's error in our words
        if (rec.timestamp is None or rec.input_length is None or rec.output_length is None
                or rec.hash_ids is None):
            for name in ("timestamp", "input_length", "output_length", "hash_ids"):
                if getattr(rec, name) is None:
                    raise _BadLine("missing (required in Mooncake traces)", name)
            raise AssertionError("unreachable")
        if len(rec.hash_ids) * self.block_tokens >= rec.input_length + self.block_tokens:
            self._check_hash_ids(rec.hash_ids, rec.input_length)
        return _parsed_mooncake(rec, self.block_tokens)

    def _parse_bailian(self, raw: bytes, *, keys: bool) -> _Parsed:
        try:  # the decoder directly: a call less per line
            rec: _BailianLine = _BAILIAN_DECODER.decode(raw)
        except msgspec.MsgspecError:
            rec = _decode(_BAILIAN_DECODER, raw)  # raises the line's error in our words
        for name in ("chat_id", "timestamp", "input_length", "output_length", "hash_ids"):
            if getattr(rec, name) is None:
                raise _BadLine("missing (required in Qwen-Bailian traces)", name)
        assert rec.timestamp is not None and rec.input_length is not None
        assert rec.output_length is not None and rec.hash_ids is not None
        if rec.parent_chat_id == rec.chat_id:
            raise _BadLine("a request cannot be its own parent", "parent_chat_id")
        if len(rec.hash_ids) * self.block_tokens >= rec.input_length + self.block_tokens:
            self._check_hash_ids(rec.hash_ids, rec.input_length)
        parent = None if rec.parent_chat_id in (None, BAILIAN_ROOT) else rec.parent_chat_id
        return _Parsed(round(rec.timestamp * 1000.0, 6), rec.input_length, rec.output_length,
                       rec.hash_ids, self.block_tokens, rec.chat_id, rec.turn, parent)

    def _parse_azure(self, raw: bytes, *, keys: bool) -> _Parsed:
        assert self._azure_columns is not None
        ts_col, in_col, out_col, ncols = self._azure_columns
        import csv  # Azure traces only (start-up time of the JSONL formats)

        try:
            text = raw.decode("utf-8")
            row = next(csv.reader([text])) if '"' in text else text.split(",")
        except (UnicodeDecodeError, csv.Error) as err:
            raise _BadLine(f"not a CSV row: {err}", None) from None
        if len(row) != ncols:
            raise _BadLine(f"expected {ncols} columns like the header, got {len(row)}", None)
        input_length = _count(row[in_col], AZURE_COLUMNS[1])
        output_length = _count(row[out_col], AZURE_COLUMNS[2])
        if keys:  # pass 2: the entry has the timestamp already
            return _Parsed(0.0, input_length, output_length, [], self.block_tokens, None, None)
        ns = _azure_time_ns(row[ts_col])
        if self._azure_origin_ns is None:
            self._azure_origin_ns = ns
        return _Parsed((ns - self._azure_origin_ns) / 1e6, input_length, output_length, [],
                       self.block_tokens, None, None)

    def _parse_kvtool(self, raw: bytes, *, keys: bool) -> _Parsed:
        try:  # the decoder directly: a call less per line
            rec: _Line = _KVTOOL_DECODER.decode(raw)
        except msgspec.MsgspecError:
            rec = _decode(_KVTOOL_DECODER, raw)  # raises the line's error in our words
        bt = self.block_tokens
        if rec.hash_ids is not None and rec.tokens is not None:
            raise _BadLine("give either hash_ids or tokens, not both", "tokens")
        if rec.block_tokens is not None and rec.block_tokens != bt and (
                rec.tokens is None or self._explicit_block_tokens is None):
            raise _BadLine(f"{rec.block_tokens} tokens per block, but the trace uses "
                           f"{self._block_tokens_source} (one block size per trace)",
                           "block_tokens")
        block_keys: list[int]
        if rec.tokens is not None:
            n = len(rec.tokens)
            if rec.input_length is not None and rec.input_length != n:
                raise _BadLine(f"{rec.input_length}, but the line has {n} tokens",
                               "input_length")
            block_keys = chain_hashes(rec.tokens, bt) if keys else []
            input_length = n
        elif rec.hash_ids is not None:
            if rec.input_length is None:
                raise _BadLine("missing", "input_length")
            input_length = rec.input_length
            self._check_hash_ids(rec.hash_ids, input_length)
            block_keys = rec.hash_ids
        else:
            raise _BadLine("missing: a line needs hash_ids or tokens", "hash_ids")
        if rec.output_length is None:
            raise _BadLine("missing", "output_length")
        return _Parsed(rec.timestamp, input_length, rec.output_length, block_keys, bt,
                       rec.session, rec.round)

    def close(self) -> None:
        if isinstance(self._buf, mmap.mmap):
            self._buf.close()

    def __enter__(self) -> TraceReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _azure_header(raw: bytes) -> tuple[int, int, int, int] | None:
    """Column indices of TIMESTAMP, ContextTokens, GeneratedTokens and the column count."""
    if raw.lstrip().startswith(b"{"):  # a JSON object, not a CSV header: skip the csv import
        return None
    import csv

    try:
        names = [n.strip() for n in next(csv.reader([raw.decode("utf-8").lstrip("\ufeff")]))]
    except (UnicodeDecodeError, csv.Error, StopIteration):
        return None
    if not all(c in names for c in AZURE_COLUMNS):
        return None
    ts, n_in, n_out = (names.index(c) for c in AZURE_COLUMNS)
    return ts, n_in, n_out, len(names)


def _azure_time_ns(text: str) -> int:
    """``2023-11-16 18:15:46.6805900`` (optionally with a UTC offset) in ns since 1970."""
    m = re.match(_AZURE_TIME_RE, text.strip())
    if m is None:
        raise _BadLine(f"expected a time like 2023-11-16 18:15:46.6805900, got "
                       f"{json.dumps(text[:40])}", AZURE_COLUMNS[0])
    y, mo, d, h, mi, s, frac, _z, sign, oh, om = m.groups()
    try:
        when = dt.datetime(int(y), int(mo), int(d), int(h), int(mi), int(s),
                           tzinfo=dt.UTC)
    except ValueError as err:
        raise _BadLine(f"{err}, got {json.dumps(text[:40])}", AZURE_COLUMNS[0]) from None
    seconds = int(when.timestamp())
    if sign is not None:
        offset = int(oh) * 3600 + int(om) * 60
        seconds -= offset if sign == "+" else -offset
    return seconds * 1_000_000_000 + int((frac or "0")[:9].ljust(9, "0"))


def _count(text: str, field: str) -> int:
    """A token count column: an integer >= 0."""
    try:
        value = int(text.strip())
    except ValueError:
        raise _BadLine(f"expected an integer, got {json.dumps(text[:40])}", field) from None
    if value < 0:
        raise _BadLine(f"expected an integer >= 0, got {value}", field)
    return value


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
