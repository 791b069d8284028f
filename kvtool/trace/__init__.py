"""Traces: the request schema, streaming readers, chained block hashing, generators, stats.

Public names: :class:`Request`, :func:`read_trace` / :class:`TraceReader`,
:func:`chain_hashes` (in :mod:`kvtool.trace.hashing`, the one module that hashes blocks).
Format reference: docs/trace.md.
"""

from typing import TYPE_CHECKING

from kvtool.lazy import exports

if TYPE_CHECKING:
    from kvtool.trace.hashing import chain_hashes
    from kvtool.trace.reader import TraceReader, read_trace
    from kvtool.trace.schema import DEFAULT_BLOCK_TOKENS, DEFAULT_WINDOW_MS, Request, TraceFormat

__getattr__, __dir__ = exports(__name__, {
    "DEFAULT_BLOCK_TOKENS": "schema",
    "DEFAULT_WINDOW_MS": "schema",
    "Request": "schema",
    "TraceFormat": "schema",
    "TraceReader": "reader",
    "chain_hashes": "hashing",
    "read_trace": "reader",
})

__all__ = [
    "DEFAULT_BLOCK_TOKENS",
    "DEFAULT_WINDOW_MS",
    "Request",
    "TraceFormat",
    "TraceReader",
    "chain_hashes",
    "read_trace",
]
