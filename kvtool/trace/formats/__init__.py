"""The trace formats: one reader module per format (its line parser, a
:class:`~kvtool.trace.formats.lines.LineParser`), registered in :data:`TRACE_FORMATS`.

Cheap to import (no format module is imported until a trace of that format is read), so
that ``--format``'s choices come from here. :class:`kvtool.trace.reader.TraceReader` does the
rest for every format: the two passes, serve order, rounds, periods. Adding a format:
docs/architecture.md, "Where to add…".
"""

from __future__ import annotations

import importlib
from typing import Any, NamedTuple


class TraceFormatEntry(NamedTuple):
    """A registered trace format."""

    module: str
    """The module of this package whose ``Parser`` reads its lines."""
    default_block_tokens: int
    """Block size when neither the trace nor ``--block-tokens`` says (docs/definitions.md)."""
    keys: frozenset[str] = frozenset()
    """``--format auto``: a first JSON record with any of these keys is this format
    (formats are tried in registry order; a record no format claims is :data:`FALLBACK`)."""
    header: bool = False
    """``--format auto``: the format is known by its first line (the module's
    ``is_header(raw)``)."""
    writable: bool = True
    """``kvtool trace convert --to`` writes it (kvtool/trace/writer.py)."""


KVTOOL_ONLY_KEYS = frozenset({"session", "round", "block_tokens", "tokens"})
"""A first record with any of these keys makes ``--format auto`` pick kvtool."""

BAILIAN_KEYS = frozenset({"chat_id", "parent_chat_id", "turn"})
"""Else a first record with any of these keys makes ``--format auto`` pick bailian."""

TRACE_FORMATS: dict[str, TraceFormatEntry] = {
    "kvtool": TraceFormatEntry("kvtool_jsonl", 256, keys=KVTOOL_ONLY_KEYS),
    "mooncake": TraceFormatEntry("mooncake", 512),
    "azure": TraceFormatEntry("azure", 256, header=True),
    "bailian": TraceFormatEntry("bailian", 16, keys=BAILIAN_KEYS),
}
"""Mooncake's traces use 512-token blocks and Qwen-Bailian's 16 (their READMEs); the Azure
CSVs have no blocks, so their made-up unique keys use kvtool's own default."""

FALLBACK = "mooncake"
"""The format of a first JSON record that no format's keys claim."""


def format_module(name: str) -> Any:
    """The reader module of format ``name``."""
    return importlib.import_module(f"{__name__}.{TRACE_FORMATS[name].module}")
