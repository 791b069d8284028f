"""Statistics of a trace, including its theoretical maximum prefix hit ratio.

This module is deliberately written from the definitions (docs/definitions.md) and shares no code
with the cache engine: ``kvtool replay`` with unbounded tiers must reproduce
:func:`trace_stats`'s ``max_token_hit_ratio`` exactly, so it is the engine's independent
reference.

Definitions used:

* **Infinite-cache prefix hit.** Requests are taken in serve order; for each, *k* is the
  number of leading blocks seen in any earlier request (stopping at the first unseen
  block); its hit tokens are ``min(k·B, input_length)``; then all its blocks count as seen.
* **Reuse distance** of a block access: the number of *distinct other* blocks accessed
  since the previous access of the same block (the LRU stack distance, in blocks; a block
  accessed again after *d* other distinct blocks hits an LRU cache of more than *d*
  blocks). Accesses are a request's ``block_keys`` head to tail, requests in serve order.
  First accesses are "cold". Histogram buckets are powers of two: ``[0,0]``, ``[1,1]``,
  ``[2,3]``, ``[4,7]``, …
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kvtool.trace.schema import Request


class _Fenwick:
    """Prefix sums over positions 1..n that grows by doubling (for stack distances)."""

    __slots__ = ("size", "total", "tree")

    def __init__(self) -> None:
        self.size = 1024
        self.tree = [0] * (self.size + 1)
        self.total = 0

    def _grow(self, pos: int) -> None:
        while pos > self.size:
            # A doubled tree's new nodes cover only new (empty) positions, except the last,
            # which covers everything.
            self.tree.extend([0] * self.size)
            self.size *= 2
            self.tree[self.size] = self.total

    def add(self, pos: int, delta: int) -> None:
        if pos > self.size:
            self._grow(pos)
        self.total += delta
        tree, size = self.tree, self.size
        while pos <= size:
            tree[pos] += delta
            pos += pos & -pos

    def prefix(self, pos: int) -> int:
        tree = self.tree
        s = 0
        while pos > 0:
            s += tree[pos]
            pos -= pos & -pos
        return s


def _bucket_bounds(index: int) -> tuple[int, int]:
    if index == 0:
        return 0, 0
    return 1 << (index - 1), (1 << index) - 1


def _quantile(sorted_values: list[int], q: float) -> int:
    if not sorted_values:
        return 0
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def trace_stats(
    requests: Iterable[Request],
    *,
    reuse: bool = True,
    block_bytes: int | None = None,
) -> dict[str, Any]:
    """Statistics of ``requests`` (in serve order); the dict is ``trace stats --json``.

    ``reuse=False`` skips the reuse-distance histogram (the only O(n log n) part).
    ``block_bytes`` adds the footprint of the unique blocks in bytes.
    Schema: docs/trace.md ("trace stats").
    """
    seen: dict[int, int] = {}  # key -> position of its latest access (1-based)
    fenwick = _Fenwick() if reuse else None
    buckets: list[int] = []
    cold = 0
    position = 0
    n_requests = 0
    input_tokens = output_tokens = hit_tokens = 0
    accesses = hit_blocks = 0
    sessions: set[str | int] = set()
    max_round = 0
    block_tokens: int | None = None
    first_ts: float | None = None
    last_ts: float | None = None
    lengths: list[int] = []
    rounds: dict[int, list[int]] = {}  # round -> [requests, input, hit, new blocks]

    for req in requests:
        n_requests += 1
        if block_tokens is None:
            block_tokens = req.block_tokens
        if first_ts is None:
            first_ts = req.timestamp
        last_ts = req.timestamp
        input_tokens += req.input_length
        output_tokens += req.output_length
        lengths.append(req.input_length)
        if req.session is not None:
            sessions.add(req.session)
        if req.round is not None and req.round > max_round:
            max_round = req.round
        keys = req.block_keys
        k = 0
        for key in keys:
            if key not in seen:
                break
            k += 1
        hit = min(k * req.block_tokens, req.input_length)
        hit_tokens += hit
        hit_blocks += k
        new_blocks = 0
        for key in keys:
            position += 1
            last = seen.get(key)
            if last is None:
                cold += 1
                new_blocks += 1
            elif fenwick is not None:
                # Every tracked block's mark lies before `position`, so the distinct blocks
                # touched since `last` are the marks after it.
                distance = fenwick.total - fenwick.prefix(last)
                b = distance.bit_length()
                if b >= len(buckets):
                    buckets.extend([0] * (b + 1 - len(buckets)))
                buckets[b] += 1
                fenwick.add(last, -1)
            if fenwick is not None:
                fenwick.add(position, 1)
            seen[key] = position
        accesses += len(keys)
        row = rounds.setdefault(req.report_round, [0, 0, 0, 0])
        row[0] += 1
        row[1] += req.input_length
        row[2] += hit
        row[3] += new_blocks

    lengths.sort()
    unique = len(seen)
    result: dict[str, Any] = {
        "requests": n_requests,
        "sessions": len(sessions),
        "rounds": max_round,
        "block_tokens": block_tokens,
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "input_length": {
            "mean": input_tokens / n_requests if n_requests else 0.0,
            "p50": _quantile(lengths, 0.50),
            "p99": _quantile(lengths, 0.99),
            "max": lengths[-1] if lengths else 0,
        },
        "duration_ms": (last_ts - first_ts) if first_ts is not None and last_ts is not None
        else 0.0,
        "block_accesses": accesses,
        "unique_blocks": unique,
        "unique_bytes": unique * block_bytes if block_bytes else None,
        "max_hit_tokens": hit_tokens,
        "max_token_hit_ratio": hit_tokens / input_tokens if input_tokens else 0.0,
        "max_block_hit_ratio": hit_blocks / accesses if accesses else 0.0,
        "per_round": [
            {"round": r, "requests": row[0], "input_tokens": row[1], "max_hit_tokens": row[2],
             "max_token_hit_ratio": row[2] / row[1] if row[1] else 0.0, "new_blocks": row[3]}
            for r, row in sorted(rounds.items())
        ],
        "reuse_distance": None,
    }
    if fenwick is not None:
        result["reuse_distance"] = {
            "unit": "blocks",
            "cold": cold,
            "reuses": accesses - cold,
            "buckets": [
                {"min": lo, "max": hi, "count": count}
                for lo, hi, count in ((*_bucket_bounds(i), c) for i, c in enumerate(buckets))
            ],
        }
    return result
