"""Hit ratio against capacity for a whole trace, in one pass: LRU stack distances.

For one LRU tier of ``c`` blocks, ``kvtool replay`` serves a request's leading blocks
that the tier holds when the request arrives, and stops at the first it does not hold;
then it touches every block of the request, head to tail, and evicts the least recently
used down to ``c`` (docs/replay.md). Let ``d_j`` be the stack distance of the request's
``j``-th block (the distinct other blocks accessed since its previous access, counting
the request's own earlier blocks; cold: infinite) and ``m_j = max(d_1..d_j)``. Then the
replay at capacity ``c`` hits exactly the blocks with ``m_j < c``:

* a block the tier holds at arrival ranks below ``c`` by recency; if the blocks before it
  are held too, every block accessed since its last access is held, so ``d_j < c``;
* a block the tier does not hold has at least ``c`` others since its last access, and
  re-touching the request's earlier blocks only adds to them: ``d_j >= c``.

So one pass, keeping ``m_j`` per access, gives every capacity's hit tokens at once:
``hits(c) = sum of the tokens of blocks with m_j < c`` (the ``j``-th block covers
``min(j·B, L) - min((j-1)·B, L)`` of the request's ``L`` input tokens, as the replay's
``min(k·B, L)``). Only LRU has this property; other policies need a replay per size.

Traces whose distinct blocks exceed ``max_tracked`` are sampled as in SHARDS
(Waldspurger et al., FAST '15, fixed-size variant): a block is followed only if the
hash of its key is below a threshold, which drops (forgetting the blocks above it)
whenever more than ``max_tracked`` blocks are followed. At sampling rate ``R`` a
distance among followed blocks stands for ``d / R`` blocks and a followed block's
tokens for ``1 / R`` times as many; the curve is then an estimate, labelled so.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Iterable
from typing import Any

from kvtool.trace.schema import Request
from kvtool.trace.stats import Fenwick

TARGETS = (0.5, 0.8, 0.9, 0.95, 0.99)
DEFAULT_MAX_TRACKED = 1 << 21
_M64 = (1 << 64) - 1
_ALL = 1 << 64


def _mix(key: int) -> int:
    """splitmix64's finaliser: block keys may be small sequential ids (Mooncake)."""
    z = (key + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


class LruCurve:
    """Accumulates, request by request in serve order, the tokens each capacity would hit.

    Invariants: ``self.last`` holds exactly the followed blocks (hash below
    ``self.threshold``) with the position of their latest access, each marked once in
    ``self.fenwick``; ``self.hits[d]`` is the (estimated) tokens of accesses whose running
    maximum distance is ``d`` blocks; with ``threshold == 2**64`` (nothing sampled out)
    every figure is exact.
    """

    def __init__(self, max_tracked: int | None = DEFAULT_MAX_TRACKED) -> None:
        if max_tracked is not None and max_tracked < 1:
            raise ValueError("max_tracked must be at least 1")
        self.max_tracked = max_tracked
        self.fenwick = Fenwick()
        self.last: dict[int, int] = {}
        self.heap: list[tuple[int, int]] = []  # (-hash, key) of followed blocks
        self.threshold = _ALL
        self.position = 0
        self.hits: dict[int, float] = {}
        self.requests = self.input_tokens = self.accesses = 0
        self.block_tokens: int | None = None

    @property
    def rate(self) -> float:
        return self.threshold / _ALL

    def _forget_one(self) -> None:
        neg, key = heapq.heappop(self.heap)
        self.threshold = -neg
        self.fenwick.add(self.last.pop(key), -1)

    def add(self, req: Request) -> None:
        self.requests += 1
        self.input_tokens += req.input_length
        self.accesses += len(req.block_keys)
        if self.block_tokens is None:
            self.block_tokens = req.block_tokens
        length, size = req.input_length, req.block_tokens
        fenwick, last_of, hits = self.fenwick, self.last, self.hits
        running = 0
        cold = False
        done = 0
        for j, key in enumerate(req.block_keys, 1):
            covered = min(j * size, length)
            tokens = covered - done
            done = covered
            h = _mix(key)
            if h >= self.threshold:
                continue
            self.position += 1
            last = last_of.get(key)
            if last is None:
                cold = True
                heapq.heappush(self.heap, (-h, key))
            else:
                d = fenwick.total - fenwick.prefix(last)
                fenwick.add(last, -1)
                if d > running:
                    running = d
            fenwick.add(self.position, 1)
            last_of[key] = self.position
            if not cold and tokens:
                rate = self.rate
                at = running if rate == 1.0 else round(running / rate)
                hits[at] = hits.get(at, 0.0) + tokens / rate
            if self.max_tracked is not None and len(last_of) > self.max_tracked:
                self._forget_one()

    def result(self) -> Curve:
        return Curve(self)


class Curve:
    """Token hit ratio of one LRU tier against its capacity in blocks (a step function)."""

    def __init__(self, acc: LruCurve) -> None:
        self.exact = acc.threshold == _ALL
        self.rate = acc.rate
        self.requests, self.input_tokens = acc.requests, acc.input_tokens
        self.accesses = acc.accesses
        self.block_tokens = acc.block_tokens
        self.unique_blocks = round(len(acc.last) / acc.rate) if acc.requests else 0
        self.distances = sorted(acc.hits)
        cum, total = [], 0.0
        for d in self.distances:
            total += acc.hits[d]
            cum.append(total)
        self.cumulative = cum
        self.max_hit_tokens = total

    def hit_tokens(self, capacity_blocks: int) -> float:
        """Tokens an LRU tier of ``capacity_blocks`` blocks hits (``d < capacity``)."""
        i = bisect.bisect_left(self.distances, capacity_blocks)
        return self.cumulative[i - 1] if i else 0.0

    def hit_ratio(self, capacity_blocks: int) -> float:
        return self.hit_tokens(capacity_blocks) / self.input_tokens if self.input_tokens else 0.0

    @property
    def max_hit_ratio(self) -> float:
        return self.max_hit_tokens / self.input_tokens if self.input_tokens else 0.0

    def capacity_for(self, fraction: float) -> int:
        """The smallest capacity (blocks) whose hit tokens reach ``fraction`` of the maximum."""
        target = fraction * self.max_hit_tokens * (1 - 1e-12)
        i = bisect.bisect_left(self.cumulative, target)
        if i >= len(self.distances):
            return self.distances[-1] + 1 if self.distances else 0
        return self.distances[i] + 1

    def points(self, n: int = 400) -> list[int]:
        """About ``n`` capacities spread evenly on a log scale up to the full footprint,
        plus every target's: where to draw or list the curve."""
        top = self.capacity_for(1.0)
        if top <= 1:
            return [top]
        caps = {max(1, round(top ** (i / (n - 1)))) for i in range(n)}
        caps |= {self.capacity_for(f) for f in TARGETS}
        return sorted(caps)

    def to_dict(self, block_bytes: int | None) -> dict[str, Any]:
        bt = self.block_tokens or 0

        def sized(blocks: int) -> dict[str, Any]:
            return {"capacity_blocks": blocks, "capacity_tokens": blocks * bt,
                    "capacity_bytes": blocks * block_bytes if block_bytes else None}

        return {
            "policy": "lru",
            "method": "stack distances" if self.exact else "SHARDS sampling",
            "exact": self.exact,
            "sample_rate": self.rate,
            "requests": self.requests,
            "input_tokens": self.input_tokens,
            "block_accesses": self.accesses,
            "block_tokens": self.block_tokens,
            "block_bytes": block_bytes,
            "unique_blocks": self.unique_blocks,
            "max_token_hit_ratio": self.max_hit_ratio,
            "full": sized(self.capacity_for(1.0)),
            "targets": [{"fraction_of_max": f, "token_hit_ratio": self.hit_ratio(c), **sized(c)}
                        for f in TARGETS for c in (self.capacity_for(f),)],
            "curve": [{"capacity_blocks": c, "token_hit_ratio": self.hit_ratio(c)}
                      for c in self.points()],
        }


def lru_curve(requests: Iterable[Request], *, max_tracked: int | None = DEFAULT_MAX_TRACKED
              ) -> Curve:
    """The LRU hit-ratio curve of ``requests`` (serve order), exact unless the trace has
    more than ``max_tracked`` distinct blocks (then SHARDS-sampled; ``None``: never)."""
    acc = LruCurve(max_tracked)
    for req in requests:
        acc.add(req)
    return acc.result()


class SweepCurve:
    """Token hit ratio of one tier of ``policy`` at given capacities, each replayed
    (for policies without a one-pass curve). Targets are the smallest replayed capacity
    that reaches the fraction of the trace's maximum: only as fine as the sweep."""

    def __init__(self, policy: str, capacities: list[int], hit_tokens: list[int],
                 input_tokens: int, max_hit_tokens: int, block_tokens: int,
                 unique_blocks: int, requests: int) -> None:
        self.policy, self.capacities, self.hits = policy, capacities, hit_tokens
        self.input_tokens, self.max_hit_tokens = input_tokens, max_hit_tokens
        self.block_tokens, self.unique_blocks, self.requests = block_tokens, unique_blocks, requests

    def hit_ratio_at(self, i: int) -> float:
        return self.hits[i] / self.input_tokens if self.input_tokens else 0.0

    def index_for(self, fraction: float) -> int | None:
        target = fraction * self.max_hit_tokens * (1 - 1e-12)
        return next((i for i, h in enumerate(self.hits) if h >= target), None)

    def to_dict(self, block_bytes: int | None) -> dict[str, Any]:
        def sized(blocks: int | None) -> dict[str, Any]:
            return {"capacity_blocks": blocks,
                    "capacity_tokens": None if blocks is None else blocks * self.block_tokens,
                    "capacity_bytes": blocks * block_bytes if blocks and block_bytes else None}

        def at(i: int | None) -> dict[str, Any]:
            return {"token_hit_ratio": None if i is None else self.hit_ratio_at(i),
                    **sized(None if i is None else self.capacities[i])}

        return {
            "policy": self.policy, "method": f"replays at {len(self.capacities)} capacities",
            "exact": True, "sample_rate": 1.0, "requests": self.requests,
            "input_tokens": self.input_tokens, "block_accesses": None,
            "block_tokens": self.block_tokens, "block_bytes": block_bytes,
            "unique_blocks": self.unique_blocks,
            "max_token_hit_ratio": self.max_hit_tokens / self.input_tokens
            if self.input_tokens else 0.0,
            "full": at(self.index_for(1.0)),
            "targets": [{"fraction_of_max": f, **at(self.index_for(f))} for f in TARGETS],
            "curve": [{"capacity_blocks": c, "token_hit_ratio": self.hit_ratio_at(i)}
                      for i, c in enumerate(self.capacities)],
        }


def sweep_capacities(unique_blocks: int, n: int) -> list[int]:
    """``n`` capacities spread on a log scale from 1 block to ``unique_blocks``."""
    if unique_blocks <= 1 or n <= 1:
        return [max(1, unique_blocks)]
    return sorted({max(1, round(unique_blocks ** (i / (n - 1)))) for i in range(n)})


def policy_sweep(requests: Iterable[Request], policy: str, capacities: list[int], *,
                 block_tokens: int, input_tokens: int, max_hit_tokens: int, unique_blocks: int
                 ) -> SweepCurve:
    """Replay ``requests`` once through one single-tier cache of ``policy`` per capacity,
    side by side (:func:`kvtool.cache.replayer.replay`)."""
    from kvtool.cache.replayer import CacheConfig, TierSpec, replay
    from kvtool.units import Capacity

    configs = [CacheConfig([TierSpec("dram", Capacity.parse(f"{c}blk", field="sweep"), policy)])
               for c in capacities]
    reports = replay(requests, configs, block_tokens=block_tokens)
    return SweepCurve(policy, capacities, [r["hit_tokens"]["total"] for r in reports],
                      input_tokens, max_hit_tokens, block_tokens, unique_blocks,
                      reports[0]["requests"] if reports else 0)


def write_curve_plot(doc: dict[str, Any], path: str, *, title: str = "") -> None:
    """Hit ratio against capacity (log scale; bytes when ``block_bytes`` is known), the
    trace's maximum as a dashed line and each target capacity marked. Needs ``plot``."""

    from kvtool.plotting import pyplot, save

    plt = pyplot("plot")
    bb = doc["block_bytes"]
    scale, unit = (bb / 1e9, "GB") if bb else (1, "blocks")
    fig, ax = plt.subplots(figsize=(8, 4.8))
    pts = doc["curve"]
    ax.step([p["capacity_blocks"] * scale for p in pts], [p["token_hit_ratio"] for p in pts],
            where="post", color="black", label=f"{doc['policy']} ({doc['method']})")
    ax.axhline(doc["max_token_hit_ratio"], color="grey", linestyle="--",
               label=f"trace maximum {doc['max_token_hit_ratio']:.3f}")
    for t in doc["targets"]:
        if t["capacity_blocks"] is None:
            continue
        x = t["capacity_blocks"] * scale
        ax.plot([x], [t["token_hit_ratio"]], marker="o", color="tab:blue")
        ax.annotate(f"{t['fraction_of_max']:.0%}", (x, t["token_hit_ratio"]),
                    textcoords="offset points", xytext=(-4, 6), ha="right", fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel(f"capacity of one {doc['policy']} tier ({unit})")
    ax.set_ylabel("token hit ratio")
    ax.set_ylim(0, max(0.05, doc["max_token_hit_ratio"] * 1.15))
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, loc="upper left")
    ax.set_title(title or "kvtool plan", fontsize=10)
    fig.tight_layout()
    save(fig, path)


def trace_document(trace: str, fmt: str, curve: Curve, swept: SweepCurve | None,
                   block_size: dict[str, Any] | None,
                   bad_lines: list[tuple[int, str]]) -> dict[str, Any]:
    """``kvtool plan TRACE``'s document (docs/json.md): the one-pass LRU ``curve``, or the
    policy ``swept`` at several capacities (with the one-pass curve beside it when the
    policy is LRU); bytes from ``block_size`` (a :meth:`~kvtool.geometry.BlockSize.to_dict`)
    when given."""
    bb = block_size["block_bytes"] if block_size else None
    doc: dict[str, Any] = {"schema": "kvtool.plan-trace/1", "trace": trace, "format": fmt,
                           "block_size": block_size}
    if swept is not None:
        doc.update(swept.to_dict(bb))
        doc["one_pass"] = curve.to_dict(bb) if swept.policy == "lru" else None
    else:
        doc.update(curve.to_dict(bb))
        doc["one_pass"] = None
    doc["bad_lines"] = [{"line": line, "message": msg} for line, msg in bad_lines]
    return doc
