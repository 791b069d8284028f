"""The request record every trace reader yields, and the trace formats.

kvtool JSONL is a superset of Mooncake's (docs/trace.md): one JSON object per line with
``timestamp`` (ms), ``input_length``, ``output_length`` and ``hash_ids``, plus optional
``session``, ``round``, ``block_tokens``, or ``tokens`` (token ids to hash into chained
block keys) instead of ``hash_ids``. Two more formats are read and written: the Azure LLM
inference CSVs (arrivals and lengths only) and the Qwen-Bailian JSONL (sessions as
``chat_id``/``parent_chat_id`` chains, 16-token blocks). The full schema is in docs/trace.md.
"""

from __future__ import annotations

import msgspec

from kvtool.trace.formats import TRACE_FORMATS

TraceFormat = str
"""A registered format's name (a key of :data:`kvtool.trace.formats.TRACE_FORMATS`): the
registry is the one list of them, so adding a format names it nowhere else."""
WRITABLE: tuple[TraceFormat, ...] = tuple(n for n, f in TRACE_FORMATS.items() if f.writable)
"""Formats ``kvtool trace convert`` writes (every format it reads)."""
FORMATS: tuple[str, ...] = ("auto", *TRACE_FORMATS)
"""Values of ``--format`` for every command that reads a trace."""

DEFAULT_BLOCK_TOKENS: dict[str, int] = {n: f.default_block_tokens for n, f in TRACE_FORMATS.items()}
"""Block size when neither the trace nor ``--block-tokens`` says (docs/definitions.md; the
registry's)."""

DEFAULT_WINDOW_MS = 60_000.0
"""Reporting window for timed traces without sessions or rounds (Mooncake's): one minute."""


class Request(msgspec.Struct, frozen=True, gc=False):
    """One request of a trace, as the cache replayer consumes it.

    Invariants (checked by the reader):

    * ``input_length >= 0``, ``output_length >= 0``;
    * ``block_keys`` are the request's cacheable blocks, head first: with ``hash_ids``
      every listed id (the last may cover a partial block), with ``tokens`` the chained
      keys of the full blocks only, for Azure traces ``ceil(input_length /
      block_tokens)`` keys no other request has; so ``len(block_keys) <= ceil(input_length /
      block_tokens)`` and the prefix hit of *k* blocks is ``min(k * block_tokens,
      input_length)`` tokens;
    * ``block_tokens`` is the same for every request of a trace;
    * ``timestamp`` is in milliseconds, as the trace gives it (Qwen-Bailian's seconds
      × 1000; Azure's after the earliest row); ``0.0`` for every request of an untimed
      trace (:attr:`TraceReader.timed` tells which);
    * ``round`` is the ``round`` field, or for a request with a ``session`` but no
      ``round`` its 1-based position among its session's requests in serve order;
      ``None`` when the trace says nothing about sessions or rounds;
    * ``period`` is the reporting round the reader assigned (see :attr:`report_round`);
    * ``line`` is the 1-based source line (0 for requests not read from a file);
    * a request holds no reference cycle (``gc=False``: the cyclic collector skips it).
    """

    timestamp: float
    input_length: int
    output_length: int
    block_keys: list[int]
    block_tokens: int
    session: str | int | None = None
    round: int | None = None
    line: int = 0
    period: int | None = None

    @property
    def report_round(self) -> int:
        """The round a per-round table files this request under.

        ``round`` when known; otherwise ``period``, which the reader sets to the 1-based
        index of the trace's :data:`DEFAULT_WINDOW_MS` time window (Mooncake traces:
        one-minute windows from the first request); otherwise 1.
        """
        if self.round is not None:
            return self.round
        return self.period if self.period is not None else 1

    def hit_tokens(self, blocks: int) -> int:
        """Tokens covered by a prefix hit of ``blocks`` leading blocks (docs/definitions.md)."""
        return min(blocks * self.block_tokens, self.input_length)
