"""The Azure LLM inference CSVs (``TIMESTAMP,ContextTokens,GeneratedTokens``): arrivals and
lengths only. Timestamps become ms after the earliest row. The trace has no prefix
structure, so each request gets fresh keys (the reader numbers them in serve order)."""

from __future__ import annotations

import datetime as dt
import json
import re
from collections.abc import Sequence
from typing import Any

from kvtool.errors import InputError
from kvtool.trace.formats.lines import (
    BadLine,
    LineParser,
    Parsed,
)

AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
"""The Azure CSV columns kvtool reads; a first line naming them makes ``auto`` pick azure."""
# (compiled on first use, by re's cache: the JSONL formats need it not)
AZURE_TIME_RE = (r"^(\d{4})-(\d{2})-(\d{2})[ T](\d{2}):(\d{2}):(\d{2})(?:\.(\d+))?"
                  r"(?:(Z)|([+-])(\d{2}):?(\d{2}))?$")


class Parser(LineParser):
    """Azure CSV rows, after the header."""

    wants_header = True
    fresh_keys = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.columns: tuple[int, int, int, int] | None = None
        self.origin_ns: int | None = None

    def header(self, raw: bytes, line: int) -> None:
        self.columns = header_columns(raw)
        if self.columns is None:
            raise InputError("expected the Azure CSV header naming "
                             f"{', '.join(AZURE_COLUMNS)}", file=self.path, line=line)

    def parse(self, raw: bytes, *, keys: bool) -> Parsed:
        assert self.columns is not None
        ts_col, in_col, out_col, ncols = self.columns
        import csv  # Azure traces only (start-up time of the JSONL formats)

        try:
            text = raw.decode("utf-8")
            row = next(csv.reader([text])) if '"' in text else text.split(",")
        except (UnicodeDecodeError, csv.Error) as err:
            raise BadLine(f"not a CSV row: {err}", None) from None
        if len(row) != ncols:
            raise BadLine(f"expected {ncols} columns like the header, got {len(row)}", None)
        input_length = count(row[in_col], AZURE_COLUMNS[1])
        output_length = count(row[out_col], AZURE_COLUMNS[2])
        if keys:  # pass 2: the entry has the timestamp already
            return Parsed(0.0, input_length, output_length, [], self.block_tokens, None, None)
        ns = time_ns(row[ts_col])
        if self.origin_ns is None:
            self.origin_ns = ns
        return Parsed((ns - self.origin_ns) / 1e6, input_length, output_length, [],
                       self.block_tokens, None, None)

    def finish(self, entries: Sequence[Any]) -> None:
        first = min(e.timestamp for e in entries)
        if first:
            for e in entries:
                e.timestamp -= first


def header_columns(raw: bytes) -> tuple[int, int, int, int] | None:
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


def time_ns(text: str) -> int:
    """``2023-11-16 18:15:46.6805900`` (optionally with a UTC offset) in ns since 1970."""
    m = re.match(AZURE_TIME_RE, text.strip())
    if m is None:
        raise BadLine(f"expected a time like 2023-11-16 18:15:46.6805900, got "
                       f"{json.dumps(text[:40])}", AZURE_COLUMNS[0])
    y, mo, d, h, mi, s, frac, _z, sign, oh, om = m.groups()
    try:
        when = dt.datetime(int(y), int(mo), int(d), int(h), int(mi), int(s),
                           tzinfo=dt.UTC)
    except ValueError as err:
        raise BadLine(f"{err}, got {json.dumps(text[:40])}", AZURE_COLUMNS[0]) from None
    seconds = int(when.timestamp())
    if sign is not None:
        offset = int(oh) * 3600 + int(om) * 60
        seconds -= offset if sign == "+" else -offset
    return seconds * 1_000_000_000 + int((frac or "0")[:9].ljust(9, "0"))


def count(text: str, field: str) -> int:
    """A token count column: an integer >= 0."""
    try:
        value = int(text.strip())
    except ValueError:
        raise BadLine(f"expected an integer, got {json.dumps(text[:40])}", field) from None
    if value < 0:
        raise BadLine(f"expected an integer >= 0, got {value}", field)
    return value




def is_header(raw: bytes) -> bool:
    """Whether ``raw``, a trace's first line, is the Azure CSV header (``--format auto``)."""
    return header_columns(raw) is not None
