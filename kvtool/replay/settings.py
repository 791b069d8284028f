"""``kvtool replay``'s settings: every option as a typed value (:class:`ReplaySettings`),
their checks, and the defaults of data mode."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import msgspec

from kvtool.errors import UsageError, param
from kvtool.tiers.option import ON_TIER_ERROR, TierOption

if TYPE_CHECKING:
    from kvtool.nvme.hostauth import HostCredentials

SCHEMA = "kvtool.replay/2"

DEFAULT_MODEL = ("deepseek-v4-flash", "fp8")
"""Model whose block size data mode uses when neither --model nor --block-bytes is given."""

DEFAULT_PROFILE: dict[str, tuple[str, str]] = {
    "gpu": ("128MiB", "vllm"),
    "dram": ("256MiB", "lru"),
}
"""Default data-mode tiers (capacity, policy): a small GPU pool with vLLM's own prefix-cache
semantics (:class:`kvtool.cache.policies.VllmPolicy`) and a Mooncake-like DRAM tier; the
NVMe tier is the default place."""

DEFAULT_NVME_FILE_BYTES = 1 << 30
"""Size of the store file the NVMe tier uses when no kvtool target is up (allocated on
disk when created; the default target's memory-backed namespace is larger)."""

MEMORY_SHARE = 0.8
"""Data mode refuses pools larger than this share of the memory available now."""


class ReplaySettings(msgspec.Struct):
    """Everything ``kvtool replay`` takes, as typed values (CLI options map 1:1)."""

    trace: str
    fmt: str = "auto"
    block_tokens: int | None = None
    skip_bad: int = 0
    simulate: bool = False
    tiers: dict[str, TierOption] = msgspec.field(default_factory=dict)
    policy: str | None = None
    tiers_file: str | None = None
    write_policy: str | None = None
    watermark: float | None = None
    evict_ratio: float | None = None
    compares: Sequence[str] = ()
    model: str | None = None
    dtype: str | None = None
    tp: int | None = None
    block_bytes: int | None = None
    read_gbps: dict[str, float] = msgspec.field(default_factory=dict)
    concurrency: int | None = None
    engine_gpu: str | None = None
    """The GPU of the one-engine case that times the replay (kvtool.replay.timing)."""
    times: str = "serving"
    """Where the report's times come from: ``serving`` (the serving model's one-engine
    case) or ``none`` (null: ``--no-times``). There is no other time model."""
    exact_steps: bool = False
    """The serving model's engines schedule every step on its own (the same times;
    :mod:`kvtool.serving.engine`)."""
    read_qd: int = 32
    write_qd: int = 16
    seed: int = 0
    on_tier_error: str = "fail"
    requests_csv: str | None = None
    iolog: str | None = None
    """--simulate: write the NVMe tier's block I/O as a fio iolog here (kvtool.cache.iolog)."""
    iolog_version: int = 3
    credentials: HostCredentials | None = None  # nvme+tcp:// places: host NQN, DH-HMAC-CHAP


def check_settings(s: ReplaySettings) -> None:
    """Values no type says are wrong: one line naming the setting."""
    if s.concurrency is not None and s.concurrency < 1:
        raise UsageError(f"must be at least 1, got {s.concurrency}", field="concurrency")
    if s.read_qd < 1:
        raise UsageError(f"must be at least 1, got {s.read_qd}", field="read_qd")
    if s.times not in ("serving", "none"):
        raise UsageError(f"use serving or none, got {s.times!r}", field="times")
    for tier, rate in s.read_gbps.items():
        if not rate > 0:
            raise UsageError(f"must be a positive number, got {rate!r}",
                             field=f"read_gbps.{tier}")
    if s.on_tier_error not in ON_TIER_ERROR:
        raise UsageError(f"use {' or '.join(ON_TIER_ERROR)}", field="on_tier_error")
    if s.iolog is not None and not s.simulate:
        raise UsageError(f"logs the simulated NVMe layout: add {param('simulate')} (data mode's "
                         "offsets are the object store's; trace the device itself there)",
                         field="iolog")
