"""Bytes per block: the one definition every command uses (docs/definitions.md).

A block's **size** ``s`` is the KV object ONE tensor-parallel rank stores for one block
of ``B`` tokens: its shard of the heads for MHA/GQA (``copy / min(tp, kv_heads)``, padded
per component), a full copy for MLA. Tier capacities are per rank too, so a tier of
``M`` bytes holds ``⌊M / s⌋`` blocks. Under TP every rank sees the same requests, so one
rank's cache is the whole cache's behaviour; the figures for all ranks are ``tp × s``.

Reported alongside: the full-copy size (all layers, all heads) and ``t``, the number of
ranks holding each byte (the capacity formula's per-rank duplication).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvtool.errors import UsageError


@dataclass(frozen=True)
class BlockSize:
    """The size of one block as stored, with the terms it comes from."""

    block_bytes: int
    """s: one rank's KV object for one block (the size every tier counts)."""
    copy_bytes: int
    """One full copy: all layers, all heads."""
    tp: int
    per_rank_duplication: int
    """t: ranks that hold each byte (1 for MHA/GQA split over TP; tp for MLA)."""
    block_tokens: int
    model: str | None = None
    dtype: str | None = None

    @property
    def all_ranks_bytes(self) -> int:
        """What all ranks store for one block together (``tp × s``)."""
        return self.block_bytes * self.tp

    @property
    def bytes_per_token(self) -> float:
        """s / B: one rank's bytes per token."""
        return self.block_bytes / self.block_tokens

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready; the same keys in every command's report (docs/json.md)."""
        return {"model": self.model, "dtype": self.dtype, "tp": self.tp,
                "block_tokens": self.block_tokens, "block_bytes": self.block_bytes,
                "copy_bytes": self.copy_bytes,
                "per_rank_duplication": self.per_rank_duplication,
                "all_ranks_bytes": self.all_ranks_bytes}


def block_size(model: str | None = None, *, dtype: str | None = None, tp: int | None = None,
               block_tokens: int = 256, block_bytes: int | None = None) -> BlockSize | None:
    """The size of one block from a model preset or a given size; ``None`` when neither.

    ``dtype`` and ``tp`` describe a model: without ``model`` they are an error rather than
    silently ignored. A given ``block_bytes`` is one stored object (tp = t = 1).
    """
    if model is not None and block_bytes is not None:
        raise UsageError("give a model or a block size, not both", field="block_bytes")
    if model is None:
        for name, value in (("dtype", dtype), ("tp", tp)):
            if value is not None:
                raise UsageError("needs a model: it describes a model's KV cache",
                                 field=name)
    if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or block_tokens <= 0:
        raise UsageError(f"must be a positive integer, got {block_tokens!r}",
                         field="block_tokens")
    if block_bytes is not None:
        if isinstance(block_bytes, bool) or not isinstance(block_bytes, int) or block_bytes <= 0:
            raise UsageError(f"must be a positive number of bytes, got {block_bytes!r}",
                             field="block_bytes")
        return BlockSize(block_bytes, block_bytes, 1, 1, block_tokens)
    if model is None:
        return None
    from kvtool.geometry.presets import resolve

    g = resolve(model, dtype=dtype, block_tokens=block_tokens, tp=1 if tp is None else tp)
    return BlockSize(g.block_bytes, g.copy_block_bytes, g.tp, g.per_rank_duplication,
                     block_tokens, g.model, g.dtype)
