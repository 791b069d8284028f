"""Accounting: per-round counters and the report dictionary (the collapse round: kvtool.collapse).

Counters are kept in blocks per tier (lists indexed like the hierarchy's tiers) and turned
into bytes only when reported, so a replay without a known block size still reports
blocks. The JSON schema built here is documented in docs/replay.md. The cache counts; it
keeps no clock: a replay's times (TTFT, wall time) come from the serving model
(:mod:`kvtool.replay.timing`), which fills the ``TIME_KEYS`` this leaves ``None``.
"""

from __future__ import annotations

import math
from typing import Any

TIME_KEYS = ("ttft_p50_s", "ttft_p99_s", "wall_s", "requests_per_s")
"""A report's times: ``None`` here, filled by the serving model's one-engine case."""


def percentile(sorted_values: list[float], q: float) -> float | None:
    """Nearest-rank percentile of an already sorted list (``None`` when empty)."""
    if not sorted_values:
        return None
    rank = max(1, math.ceil(q / 100 * len(sorted_values)))
    return sorted_values[rank - 1]


class RoundStats:
    """Everything counted for one round (or one reporting window), per tier.

    Invariants: ``Σ hit_tokens + recompute_tokens == input_tokens``; each hit block is
    counted once, in the tier it was attributed to; ``blocks_read`` counts blocks read
    out of a tier (loads of hits, and copies made when it demotes a block);
    ``blocks_written`` counts blocks inserted into a tier (computed, promoted, demoted);
    ``promoted_blocks`` the part of them that are *promotions* (hits copied up from a lower
    tier); the rest are *puts* (blocks computed now, or demoted on eviction under
    write-back): docs/definitions.md; the published "writes per round" are puts.
    """

    __slots__ = ("blocks_read", "blocks_written", "evictions", "hit_blocks", "hit_tokens",
                 "input_tokens", "output_tokens", "promoted_blocks", "recompute_tokens",
                 "requests")

    def __init__(self, tiers: int) -> None:
        self.requests = 0
        self.input_tokens = 0
        self.output_tokens = 0
        self.recompute_tokens = 0
        self.hit_tokens = [0] * tiers
        self.hit_blocks = [0] * tiers
        self.blocks_written = [0] * tiers
        self.blocks_read = [0] * tiers
        self.promoted_blocks = [0] * tiers
        self.evictions = [0] * tiers

    def count_request(self, input_tokens: int, output_tokens: int) -> None:
        """One served request: its tokens."""
        self.requests += 1
        self.input_tokens += input_tokens
        self.output_tokens += output_tokens

    def add(self, other: RoundStats) -> None:
        self.requests += other.requests
        self.input_tokens += other.input_tokens
        self.output_tokens += other.output_tokens
        self.recompute_tokens += other.recompute_tokens
        for mine, theirs in ((self.hit_tokens, other.hit_tokens),
                             (self.hit_blocks, other.hit_blocks),
                             (self.blocks_written, other.blocks_written),
                             (self.blocks_read, other.blocks_read),
                             (self.promoted_blocks, other.promoted_blocks),
                             (self.evictions, other.evictions)):
            for i, v in enumerate(theirs):
                mine[i] += v

    @property
    def hit_total(self) -> int:
        return sum(self.hit_tokens)

    @property
    def token_hit_ratio(self) -> float:
        return self.hit_total / self.input_tokens if self.input_tokens else 0.0

    def to_dict(self, tier_names: list[str], block_bytes: int | None) -> dict[str, Any]:
        def per_tier(values: list[int], scale: int | None = 1) -> dict[str, int | None]:
            return {n: (v * scale if scale is not None else None)
                    for n, v in zip(tier_names, values, strict=True)}

        inp = self.input_tokens
        puts = [w - p for w, p in zip(self.blocks_written, self.promoted_blocks, strict=True)]
        return {
            "requests": self.requests,
            "input_tokens": inp,
            "output_tokens": self.output_tokens,
            "token_hit_ratio": self.token_hit_ratio,
            "hit_tokens": {**per_tier(self.hit_tokens), "total": self.hit_total},
            "hit_ratio_by_tier": {n: (v / inp if inp else 0.0)
                                  for n, v in zip(tier_names, self.hit_tokens, strict=True)},
            "recompute_tokens": self.recompute_tokens,
            "blocks_written": per_tier(self.blocks_written),
            "blocks_read": per_tier(self.blocks_read),
            "bytes_written": per_tier(self.blocks_written, block_bytes),
            "bytes_read": per_tier(self.blocks_read, block_bytes),
            "put_blocks": per_tier(puts),
            "put_bytes": per_tier(puts, block_bytes),
            "promoted_blocks": per_tier(self.promoted_blocks),
            "promoted_bytes": per_tier(self.promoted_blocks, block_bytes),
            "evictions": per_tier(self.evictions),
            **dict.fromkeys(TIME_KEYS),
        }
