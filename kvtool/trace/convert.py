"""Convert traces between every format kvtool reads (``tokens`` → compact ``hash_ids``).

The output is always in serve order, with block keys renumbered 0, 1, 2, … by first
appearance (:func:`~kvtool.trace.writer.compact_ids`), so converting a ``tokens`` trace
gives the same blocks, and the same replay, in a far smaller file.

* **→ kvtool**: keeps ``session`` and ``round`` (inferred rounds are written out),
  writes ``block_tokens`` on every line, and keeps timestamps when the source has them.
* **→ mooncake**: Mooncake lines carry only ``timestamp``, ``input_length``,
  ``output_length`` and ``hash_ids``; sessions and rounds are dropped.
* **→ bailian**: Qwen-Bailian lines; a session becomes a ``chat_id`` ←
  ``parent_chat_id`` chain and its round the ``turn`` (:class:`~kvtool.trace.writer.BailianChains`);
  timestamps in seconds.
* **→ azure**: the CSV's three columns; block keys, sessions and rounds are dropped (an
  Azure trace has no prefix structure: read back, every block is new).

Mooncake, Qwen-Bailian and Azure traces are timed: an untimed source gets timestamps in
serve order, ``interval_ms`` apart. Their readers assume 512 (Mooncake) and 16
(Qwen-Bailian) tokens per block, so a trace with another block size must be read back
with ``--block-tokens``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from kvtool.errors import UsageError
from kvtool.trace.reader import TraceReader
from kvtool.trace.schema import DEFAULT_BLOCK_TOKENS, WRITABLE, Request
from kvtool.trace.writer import (
    BailianChains,
    Output,
    compact_ids,
    to_record,
    write_azure,
    write_records,
)


@dataclass(frozen=True)
class ConvertResult:
    requests: int
    to: str
    block_tokens: int
    timestamps_added: bool
    read_back_block_tokens: int | None
    """``--block-tokens`` needed to read the output back (None: the format's default)."""
    dropped: tuple[str, ...] = field(default=())
    """What the source has and the output format cannot carry (``hash_ids``, ``session``)."""

    def to_document(self, source: str, output: str,
                    bad_lines: list[dict[str, Any]]) -> dict[str, Any]:
        """``kvtool trace convert``'s document (docs/json.md)."""
        return {"schema": "kvtool.trace.convert/1", "input": source, "output": output,
                "to": self.to, "requests": self.requests, "block_tokens": self.block_tokens,
                "timestamps_added": self.timestamps_added,
                "read_back_block_tokens": self.read_back_block_tokens,
                "dropped": list(self.dropped), "bad_lines": bad_lines}


def convert_trace(reader: TraceReader, out: Output, *, to: str,
                  interval_ms: float = 1.0) -> ConvertResult:
    """Write ``reader``'s requests to ``out`` (a file, or a binary stream) in format ``to``
    (one of :data:`WRITABLE`)."""
    if to not in WRITABLE:
        raise UsageError(f"unknown format {to!r} (use {', '.join(WRITABLE)})", field="to")
    if not interval_ms >= 0:
        raise UsageError(f"must not be negative, got {interval_ms}", field="interval_ms")
    add_ts = to != "kvtool" and not reader.timed

    def stamped() -> Iterator[tuple[float | None, list[int], Request]]:
        for i, (req, ids) in enumerate(compact_ids(reader)):
            ts = i * interval_ms if add_ts else req.timestamp if reader.timed else None
            yield ts, ids, req

    n: int
    if to == "azure":
        n = write_azure(((ts or 0.0, req.input_length, req.output_length)
                         for ts, _ids, req in stamped()), out)
    elif to == "bailian":
        chains = BailianChains()
        n = write_records((chains.record(req, ids, ts or 0.0) for ts, ids, req in stamped()),
                          out)
    else:
        n = write_records((to_record(req, ids, fmt=to, timestamp=ts)
                           for ts, ids, req in stamped()), out)
    dropped: list[str] = []
    if to == "azure" and reader.format != "azure":
        dropped.append("hash_ids")
    if to in ("azure", "mooncake") and reader.has_rounds:
        dropped += ["session", "round"]
    needs_bt = (to in ("mooncake", "bailian")
                and reader.block_tokens != DEFAULT_BLOCK_TOKENS[to])
    return ConvertResult(n, to, reader.block_tokens, add_ts,
                         reader.block_tokens if needs_bt else None, tuple(dropped))
