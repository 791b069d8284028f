"""The time model: turns a request's hits, loads and recompute into modelled seconds.

Nothing here is measured: every figure is ``work / rate`` with the rates below, so the
report can say what the tiers are worth *given* those rates. Defaults describe a
mid-size model on one modern GPU with a PCIe host link and a local NVMe array; every
parameter is settable (``kvtool replay --prefill-tps/--tpot-ms/--read-gbps/--concurrency``
or the ``[time]`` table of a ``--tiers`` file).

Per request:

* ``ttft = recompute_tokens / prefill_tokens_per_s + Σ_tier loaded_bytes / read_rate``
  (a hit block is loaded whole from the tier it is attributed to; GPU hits cost nothing
  by default because they are used in place);
* ``latency = ttft + output_length × tpot``.

Per round: ``wall = Σ latency / concurrency`` (requests of a round overlap
``concurrency`` at a time; the model ignores batching effects on prefill and decode).
"""

from __future__ import annotations

import math

import msgspec

DEFAULT_READ_GBPS: dict[str, float] = {"gpu": math.inf, "dram": 25.0, "nvme": 5.2}
"""GB/s (10⁹ B/s) a request loads hit blocks at: HBM in place; PCIe 5 host→device;
a parallel NVMe(-oF) read path (the seed report measured 5.23 GB/s)."""


class TimeModel(msgspec.Struct):
    """Rates of the modelled times (all settable)."""

    prefill_tokens_per_s: float = 10_000.0
    tpot_ms: float = 20.0
    read_gbps: dict[str, float] = msgspec.field(default_factory=lambda: dict(DEFAULT_READ_GBPS))
    concurrency: int = 1

    def __post_init__(self) -> None:
        if not self.prefill_tokens_per_s > 0:
            raise ValueError("prefill_tokens_per_s must be positive")
        if not self.tpot_ms >= 0:
            raise ValueError("tpot_ms must not be negative")
        if self.concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        for name, rate in self.read_gbps.items():
            if not rate > 0:
                raise ValueError(f"read_gbps.{name} must be positive")

    def seconds_per_block(self, tier: str, block_bytes: int | None) -> float:
        """Load time of one block from ``tier`` (0 when the block size is unknown)."""
        rate = self.read_gbps.get(tier, math.inf)
        if not block_bytes or rate == math.inf:
            return 0.0
        return block_bytes / (rate * 1e9)

    def to_dict(self) -> dict[str, object]:
        return {
            "prefill_tokens_per_s": self.prefill_tokens_per_s,
            "tpot_ms": self.tpot_ms,
            "read_gbps": dict(self.read_gbps),
            "concurrency": self.concurrency,
        }


def percentile(sorted_values: list[float], q: float) -> float | None:
    """Nearest-rank percentile of an already sorted list (``None`` when empty)."""
    if not sorted_values:
        return None
    rank = max(1, math.ceil(q / 100 * len(sorted_values)))
    return sorted_values[rank - 1]
