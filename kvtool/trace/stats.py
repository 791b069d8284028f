"""Statistics of a trace, including its theoretical maximum prefix hit ratio.

This module is deliberately written from the definitions (docs/definitions.md) and shares no code
with the cache replayer: ``kvtool replay`` with unbounded tiers must reproduce
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

from kvtool.trace.reader import TraceReader
from kvtool.trace.schema import Request


class Fenwick:
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


class RequestTally:
    """Counts, tokens, sessions, rounds, input lengths and duration of the requests."""

    def __init__(self) -> None:
        self.requests = self.input_tokens = self.output_tokens = self.max_round = 0
        self.sessions: set[str | int] = set()
        self.block_tokens: int | None = None
        self.first_ts: float | None = None
        self.last_ts: float | None = None
        self.lengths: list[int] = []

    def add(self, req: Request) -> None:
        self.requests += 1
        if self.block_tokens is None:
            self.block_tokens = req.block_tokens
        if self.first_ts is None:
            self.first_ts = req.timestamp
        self.last_ts = req.timestamp
        self.input_tokens += req.input_length
        self.output_tokens += req.output_length
        self.lengths.append(req.input_length)
        if req.session is not None:
            self.sessions.add(req.session)
        if req.round is not None and req.round > self.max_round:
            self.max_round = req.round

    def to_dict(self) -> dict[str, Any]:
        lengths = sorted(self.lengths)
        n = self.requests
        return {
            "requests": n, "sessions": len(self.sessions), "rounds": self.max_round,
            "block_tokens": self.block_tokens, "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "input_length": {"mean": self.input_tokens / n if n else 0.0,
                             "p50": _quantile(lengths, 0.50), "p99": _quantile(lengths, 0.99),
                             "max": lengths[-1] if lengths else 0},
            "duration_ms": (self.last_ts - self.first_ts)
            if self.first_ts is not None and self.last_ts is not None else 0.0,
        }


class ReuseDistances:
    """The histogram of reuse distances (LRU stack distances, in blocks)."""

    def __init__(self) -> None:
        self.fenwick = Fenwick()
        self.buckets: list[int] = []
        self.cold = 0
        self.reuses = 0

    def access(self, position: int, last: int | None) -> None:
        """Block access number ``position``; ``last``: its previous access, if any."""
        fenwick = self.fenwick
        if last is None:
            self.cold += 1
        else:
            # Every tracked block's mark lies before `position`, so the distinct blocks
            # touched since `last` are the marks after it.
            b = (fenwick.total - fenwick.prefix(last)).bit_length()
            if b >= len(self.buckets):
                self.buckets.extend([0] * (b + 1 - len(self.buckets)))
            self.buckets[b] += 1
            self.reuses += 1
            fenwick.add(last, -1)
        fenwick.add(position, 1)

    def to_dict(self) -> dict[str, Any]:
        return {"unit": "blocks", "cold": self.cold, "reuses": self.reuses,
                "buckets": [{"min": lo, "max": hi, "count": count} for lo, hi, count in
                            ((*_bucket_bounds(i), c) for i, c in enumerate(self.buckets))]}


class InfiniteCache:
    """Prefix hits of an infinite cache (the theoretical maximum), overall and per round."""

    def __init__(self, reuse: ReuseDistances | None = None) -> None:
        self.seen: dict[int, int] = {}  # key -> position of its latest access (1-based)
        self.reuse = reuse
        self.position = self.accesses = self.hit_blocks = 0
        self.input_tokens = self.hit_tokens = 0
        self.rounds: dict[int, list[int]] = {}  # round -> [requests, input, hit, new blocks]

    def add(self, req: Request) -> None:
        seen, reuse = self.seen, self.reuse
        keys = req.block_keys
        k = 0
        for key in keys:
            if key not in seen:
                break
            k += 1
        hit = min(k * req.block_tokens, req.input_length)
        new_blocks = 0
        position = self.position
        for key in keys:
            position += 1
            last = seen.get(key)
            if last is None:
                new_blocks += 1
            if reuse is not None:
                reuse.access(position, last)
            seen[key] = position
        self.position = position
        self.accesses += len(keys)
        self.hit_blocks += k
        self.hit_tokens += hit
        self.input_tokens += req.input_length
        row = self.rounds.setdefault(req.report_round, [0, 0, 0, 0])
        row[0] += 1
        row[1] += req.input_length
        row[2] += hit
        row[3] += new_blocks

    def to_dict(self, block_bytes: int | None) -> dict[str, Any]:
        unique = len(self.seen)
        return {
            "block_accesses": self.accesses,
            "unique_blocks": unique,
            "unique_bytes": unique * block_bytes if block_bytes else None,
            "max_hit_tokens": self.hit_tokens,
            "max_token_hit_ratio": self.hit_tokens / self.input_tokens
            if self.input_tokens else 0.0,
            "max_block_hit_ratio": self.hit_blocks / self.accesses if self.accesses else 0.0,
            "per_round": [
                {"round": r, "requests": row[0], "input_tokens": row[1],
                 "max_hit_tokens": row[2],
                 "max_token_hit_ratio": row[2] / row[1] if row[1] else 0.0,
                 "new_blocks": row[3]}
                for r, row in sorted(self.rounds.items())],
        }


class MaxHitRatio:
    """The infinite-cache token hit ratio alone (:class:`InfiniteCache`'s
    ``max_token_hit_ratio``), lean enough to run beside a replay (``kvtool replay``'s
    "% of max"): the seen keys, and one membership test per prefix block.

    The seen keys take the cheapest of three forms that holds, checked request by
    request, each turning into the next for good at the first request it cannot hold:

    1. **A watermark** while the keys were minted in order, as a Mooncake trace's
       ``hash_ids`` are (a block's id is the number of distinct blocks before it): the
       seen keys are exactly ``range(watermark)``, so the prefix test is ``key <
       watermark``, and a request's keys after the prefix must be ``watermark,
       watermark + 1, …``: one comparison each, and nothing per key is kept. (C-level
       checks, ``all(map(lt, …))`` for order with a ``bisect``, or a comparison with
       ``list(range(…))``, were slower than these two loops on 3.11: BENCHMARKS.md.)
    2. **A bitmap** while every key is a small non-negative int: ``flags[key]`` is 1 for
       a seen key, so millions of blocks cost a few MB and keep no int alive, where a
       set costs about 60 B per key and, on a long trace, its page faults and cache
       misses slow the replay beside it more than its loop costs (BENCHMARKS.md,
       "Replay speed"). It stops at a key that is negative or that would make the
       bitmap larger than :attr:`BITMAP_BYTES_PER_BLOCK` bytes per block added.
    3. **A set** (``seen``) otherwise.

    Invariant: the seen keys (``range(watermark)``, ``flags``' set bytes, or ``seen``)
    are every key of every request added; ``hit_tokens`` and ``input_tokens`` are those
    of :class:`InfiniteCache` over the same requests.
    """

    __slots__ = ("blocks", "flags", "hit_tokens", "input_tokens", "seen", "watermark")

    BITMAP_BYTES_PER_BLOCK = 64
    """How sparse the keys may be for the bitmap (beyond its first 64 KiB)."""

    def __init__(self) -> None:
        self.watermark: int | None = 0
        """While not None: the seen keys are exactly ``range(watermark)``."""
        self.seen: set[int] = set()
        self.flags: bytearray | None = None
        self.blocks = 0
        """Blocks added while the bitmap lasts (new ones, duplicates counted)."""
        self.hit_tokens = self.input_tokens = 0

    def _grow(self, keys: list[int]) -> bool:
        """Grow the bitmap to cover ``keys``; False when they do not belong in one."""
        flags = self.flags
        assert flags is not None
        if min(keys) < 0:
            return False
        size = max(max(keys) + 1, 2 * len(flags), 1 << 16)
        if size > max(1 << 16, self.BITMAP_BYTES_PER_BLOCK * (self.blocks + len(keys))):
            return False
        flags.extend(bytes(size - len(flags)))
        return True

    def _to_bitmap(self) -> None:
        """Leave the watermark: ``range(watermark)`` as a bitmap."""
        w = self.watermark
        assert w is not None
        self.flags = bytearray(b"\x01") * w
        self.blocks = w
        self.watermark = None

    def _to_set(self) -> None:
        flags = self.flags
        assert flags is not None
        self.seen = {key for key, flag in enumerate(flags) if flag}
        self.flags = None

    def add(self, keys: list[int], input_length: int, block_tokens: int) -> None:
        w = self.watermark
        k = 0
        if w is not None:
            # Seen: range(w). The prefix is the keys below w; the rest must be w, w + 1, ….
            for key in keys:
                if key >= w or key < 0:
                    break
                k += 1
            top = w
            for key in keys[k:] if k else keys:
                if key != top:
                    break
                top += 1
            else:
                self.watermark = top
                hit = k * block_tokens
                self.hit_tokens += hit if hit < input_length else input_length
                self.input_tokens += input_length
                return
            self._to_bitmap()
            k = 0
        flags = self.flags
        if (flags is not None and keys and (min(keys) < 0 or max(keys) >= len(flags))
                and not self._grow(keys)):
            self._to_set()
            flags = None
        if flags is not None:
            for key in keys:
                if not flags[key]:
                    break
                k += 1
            if k < len(keys):
                for key in keys[k:] if k else keys:
                    flags[key] = 1
                self.blocks += len(keys) - k
        else:
            seen = self.seen
            for key in keys:
                if key not in seen:
                    break
                k += 1
            if k < len(keys):  # the prefix is in `seen` already
                seen.update(keys[k:] if k else keys)
        hit = k * block_tokens
        self.hit_tokens += hit if hit < input_length else input_length
        self.input_tokens += input_length

    @property
    def ratio(self) -> float:
        return self.hit_tokens / self.input_tokens if self.input_tokens else 0.0


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
    tally = RequestTally()
    distances = ReuseDistances() if reuse else None
    cache = InfiniteCache(distances)
    for req in requests:
        tally.add(req)
        cache.add(req)
    return {**tally.to_dict(), **cache.to_dict(block_bytes),
            "reuse_distance": distances.to_dict() if distances is not None else None}


def stats_document(reader: TraceReader, *, path: str, reuse: bool = True,
                   block_size: dict[str, Any] | None = None) -> dict[str, Any]:
    """``kvtool trace stats``'s document (docs/json.md) for the trace ``reader`` reads from
    ``path``: :func:`trace_stats` (bytes from ``block_size``, the
    :meth:`~kvtool.geometry.BlockSize.to_dict` of the block size, when given), how the trace
    was read, and the bad lines skipped."""
    result = trace_stats(reader, reuse=reuse,
                         block_bytes=block_size["block_bytes"] if block_size else None)
    return {"schema": "kvtool.trace.stats/1", "trace": path, "format": reader.format,
            "timed": reader.timed, "window_ms": reader.window_ms, "block_size": block_size,
            **result, "bad_lines": bad_lines(reader)}


def bad_lines(reader: TraceReader) -> list[dict[str, Any]]:
    """The lines ``reader`` skipped, as documents list them."""
    return [{"line": n, "message": m} for n, m in reader.bad_lines]
