"""Mooncake JSONL: ``timestamp`` (ms), ``input_length``, ``output_length``, ``hash_ids``.

Its lines decode a chunk at a time: the reader's fast paths (kvtool/trace/reader.py) use
the decoders here."""

from __future__ import annotations

from typing import Any

import msgspec

from kvtool.trace.formats.lines import (
    BadLine,
    LineParser,
    NonNegInt,
    Parsed,
    decode,
)


class MooncakeLine(msgspec.Struct, gc=False):
    timestamp: float | None = None
    input_length: NonNegInt | None = None
    output_length: NonNegInt | None = None
    hash_ids: list[int] | None = None


class MooncakeRecord(msgspec.Struct, gc=False):
    """A Mooncake line with every field present, as a streamed trace's lines are
    (:meth:`kvtool.trace.reader.TraceReader._scan_sorted_mooncake`): the decoder checks their presence, so
    no per-line code does; a line without one is left to the scan that words the error."""

    timestamp: float
    input_length: NonNegInt
    output_length: NonNegInt
    hash_ids: list[int]


class MooncakeHead(msgspec.Struct, gc=False):
    """A Mooncake line with every field present, its block ids left undecoded (checked
    to be present only): pass 1 of a streamed trace with late id checks
    (:meth:`kvtool.trace.reader.TraceReader._scan_sorted_mooncake`). Building the ids' ints is most of a
    line's decoding; pass 2 builds them anyway."""

    timestamp: float
    input_length: NonNegInt
    output_length: NonNegInt
    hash_ids: msgspec.Raw


LINE_DECODER = msgspec.json.Decoder(MooncakeLine)
RECORD_DECODER = msgspec.json.Decoder(MooncakeRecord)
HEAD_DECODER = msgspec.json.Decoder(MooncakeHead)

KEEP_BLOCK_IDS = 2_000_000
"""Pass 1 keeps decoded Mooncake lines until they hold this many block ids (about 40 B
each, so at most about 80 MB): a trace that size is decoded once; beyond it, pass 2
decodes the rest again (a chunk at a time where serve order follows the file), so
memory stays bounded whatever the trace's length."""


def parsed_mooncake(rec: Any, block_tokens: int) -> Parsed:
    """A Mooncake line, decoded and checked (every field present), as :class:`Parsed`."""
    return Parsed(rec.timestamp, rec.input_length, rec.output_length, rec.hash_ids,
                   block_tokens, None, None)


class Parser(LineParser):
    """Mooncake lines."""

    keep_block_ids = KEEP_BLOCK_IDS
    chunked = True

    def parse(self, raw: bytes, *, keys: bool) -> Parsed:
        try:  # the decoder directly: a call less per line
            rec: MooncakeLine = LINE_DECODER.decode(raw)
        except msgspec.MsgspecError:
            rec = decode(LINE_DECODER, raw)  # raises the line's error in our words
        if (rec.timestamp is None or rec.input_length is None or rec.output_length is None
                or rec.hash_ids is None):
            for name in ("timestamp", "input_length", "output_length", "hash_ids"):
                if getattr(rec, name) is None:
                    raise BadLine("missing (required in Mooncake traces)", name)
            raise AssertionError("unreachable")
        if len(rec.hash_ids) * self.block_tokens >= rec.input_length + self.block_tokens:
            self.check_hash_ids(rec.hash_ids, rec.input_length)
        return parsed_mooncake(rec, self.block_tokens)

