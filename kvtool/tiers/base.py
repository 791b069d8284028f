"""The data-tier interface, shaped like vLLM's offloading connector.

A tier stores whole blocks by key (the block's chain hash). Transfers are two-phase so a
caller can overlap them with other work, as vLLM's ``OffloadingManager`` /
``OffloadingHandler`` pair does:

* ``lookup(keys)`` — how many *leading* keys the tier can load now;
* ``prepare_load(keys, dsts)`` → job — start copying each key's bytes into ``dsts[i]``
  (a ``uint8`` array of ``block_bytes``); ``complete_load(job)`` waits and returns, per
  key, whether its bytes arrived (a key the tier does not hold is ``False``). Content is
  not checked here: the caller verifies what it receives;
* ``prepare_store(keys, srcs[, crcs])`` → job — start storing; every ``srcs[i]`` has been read
  (copied) before it returns, so the caller may reuse its buffers at once; the write to
  the medium may continue until ``complete_store(job)``;
* ``evict(keys)`` — forget the keys and free their space (keys it lacks are ignored).

Errors of the medium raise :class:`TierError` (the tier name and URL, then the cause);
a key stored but lost later is a ``False`` from ``complete_load``, not an error.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np


class TierError(Exception):
    """A tier's medium failed (target gone, I/O error); ``str()`` is one line."""

    def __init__(self, tier: str, url: str | None, cause: str) -> None:
        self.tier, self.url, self.cause = tier, url, cause
        where = f"{tier} tier" + (f" ({url})" if url else "")
        super().__init__(f"{where}: {cause}")


@dataclass
class Link:
    """Bytes moved over one link and the wall seconds it took (measured)."""

    blocks: int = 0
    bytes: int = 0
    seconds: float = 0.0

    def add(self, blocks: int, nbytes: int, seconds: float) -> None:
        self.blocks += blocks
        self.bytes += nbytes
        self.seconds += seconds

    def to_dict(self) -> dict[str, Any]:
        return {"blocks": self.blocks, "bytes": self.bytes, "seconds": self.seconds,
                "gbps": (self.bytes / self.seconds / 1e9) if self.seconds > 0 else None}


@dataclass
class TransferJob:
    """One prepared load or store: its keys, per-key outcome, and what is in flight."""

    keys: list[int]
    ok: list[bool]
    nbytes: int = 0
    started: float = field(default_factory=time.perf_counter)
    futures: list[Future[Any]] = field(default_factory=list)
    ends: list[float] = field(default_factory=list)
    """Completion times of the futures (perf_counter), for measured link time."""
    state: Any = None
    """The tier's own bookkeeping of the transfer."""
    crcs: list[int | None] | None = None
    """A load's CRC32C of each block as it arrived (``checksum=True``), taken by a tier
    whose engine completes reads on threads of its own while the others are in flight;
    ``None`` (all, or one block's): not taken, the caller computes it."""


class DataTier(ABC):
    """Block storage of one tier (see the module docstring for the protocol)."""

    name: str
    """The tier it serves: ``gpu``, ``dram`` or ``nvme``."""
    backend: str
    """What holds the bytes: ``numpy``, ``objectstore``, ``mooncake``, …"""
    url: str | None = None
    block_bytes: int
    slots: int
    """Blocks it can hold at once."""

    @abstractmethod
    def __contains__(self, key: int) -> bool: ...

    def lookup(self, keys: Sequence[int]) -> int:
        n = 0
        for key in keys:
            if key not in self:
                break
            n += 1
        return n

    @abstractmethod
    def prepare_load(self, keys: Sequence[int], dsts: Sequence[np.ndarray], *,
                     checksum: bool = False) -> TransferJob:
        """Start loading ``keys[i]`` into ``dsts[i]``. ``checksum``: the caller will check
        each block's CRC32C; a tier that can take it as the block arrives, off the
        caller's thread, does (:attr:`TransferJob.crcs`), the others ignore it."""

    @abstractmethod
    def complete_load(self, job: TransferJob) -> list[bool]: ...

    @abstractmethod
    def prepare_store(self, keys: Sequence[int], srcs: Sequence[np.ndarray], *,
                      crcs: Sequence[int] | None = None) -> TransferJob:
        """``crcs``: the CRC32C of each ``srcs[i]``, when the caller took them (the data
        mover, which checks later loads against them). A tier that records a checksum
        with each block (the NVMe tier's index, the shared pool's) records these instead
        of a second pass over the bytes; the others ignore them."""

    @abstractmethod
    def complete_store(self, job: TransferJob) -> None: ...

    @abstractmethod
    def evict(self, keys: Sequence[int]) -> None: ...

    def close(self) -> None:
        return None

    def describe(self) -> dict[str, Any]:
        return {"backend": self.backend, "url": self.url, "slots": self.slots,
                "block_bytes": self.block_bytes}


def prefault(a: np.ndarray) -> None:
    """Touch every page now, so the first copies into a pool measure copying, not page
    faults (the pool is *preallocated*, as a KV engine's is)."""
    flat = a.reshape(-1)
    flat[::4096] = 0
