"""Convert traces between kvtool and Mooncake JSONL (and ``tokens`` → ``hash_ids``).

The output is always in serve order with ``hash_ids``: block keys renumbered 0, 1, 2, …
by first appearance (:func:`~kvtool.trace.writer.compact_ids`), so converting a
``tokens`` trace gives the same blocks, and the same replay, in a far smaller file.

* **→ kvtool**: keeps ``session`` and ``round`` (inferred rounds are written out),
  writes ``block_tokens`` on every line, and keeps timestamps when the source has them.
* **→ mooncake**: Mooncake lines carry only ``timestamp``, ``input_length``,
  ``output_length`` and ``hash_ids``. An untimed source gets timestamps in serve order,
  ``interval_ms`` apart. Mooncake readers assume 512 tokens per block, so a trace with
  another block size must be read back with ``--block-tokens``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from kvtool.errors import UsageError
from kvtool.trace.reader import TraceReader
from kvtool.trace.schema import DEFAULT_BLOCK_TOKENS
from kvtool.trace.writer import compact_ids, to_record, write_records


@dataclass(frozen=True)
class ConvertResult:
    requests: int
    to: str
    block_tokens: int
    timestamps_added: bool
    read_back_block_tokens: int | None
    """``--block-tokens`` needed to read the output back (None: the format's default)."""


def convert_trace(reader: TraceReader, out: str | os.PathLike[str], *, to: str,
                  interval_ms: float = 1.0) -> ConvertResult:
    """Write ``reader``'s requests to ``out`` in format ``to`` ("kvtool" or "mooncake")."""
    if to not in ("kvtool", "mooncake"):
        raise UsageError(f"unknown format {to!r} (use kvtool or mooncake)", field="to")
    if not interval_ms >= 0:
        raise UsageError(f"must not be negative, got {interval_ms}", field="interval_ms")
    add_ts = to == "mooncake" and not reader.timed
    records = (
        to_record(req, ids, fmt=to,
                  timestamp=(i * interval_ms if add_ts else req.timestamp if reader.timed
                             else None))
        for i, (req, ids) in enumerate(compact_ids(reader))
    )
    n = write_records(records, out)
    needs_bt = to == "mooncake" and reader.block_tokens != DEFAULT_BLOCK_TOKENS["mooncake"]
    return ConvertResult(n, to, reader.block_tokens, add_ts,
                         reader.block_tokens if needs_bt else None)
