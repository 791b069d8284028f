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

from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from kvtool.errors import UsageError, param

if TYPE_CHECKING:
    from kvtool.geometry.model import KVGeometry


class BlockSize(NamedTuple):
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


def resolve_geometry(*, model: str | None = None, geometry_file: str | Path | None = None,
                     layers: int | None = None, kv_heads: int | None = None,
                     head_dim: int | None = None, kv_lora_rank: int | None = None,
                     qk_rope_head_dim: int | None = None, dtype: str | None = None,
                     tp: int | None = None, block_tokens: int = 256,
                     block_bytes: int | None = None) -> KVGeometry | None:
    """The KV geometry one of four sources describes: a preset ``model``, a
    ``geometry_file`` (TOML, docs/geometry.md), custom numbers (``layers`` with
    ``kv_heads``/``head_dim`` or ``kv_lora_rank``/``qk_rope_head_dim``), or none when
    ``block_bytes`` (a size, no geometry) or nothing is given.

    Invariant: at most one source; ``dtype``, ``tp`` and a non-default ``block_tokens``
    describe a model, so they are an error with ``block_bytes`` or without any source.
    Errors name the parameters (:func:`~kvtool.errors.param`).
    """
    custom_given = any(v is not None
                       for v in (layers, kv_heads, head_dim, kv_lora_rank, qk_rope_head_dim))
    given = [name for name, v in (("model", model), ("block_bytes", block_bytes),
                                  ("geometry_file", geometry_file)) if v is not None]
    names = [param(n) for n in given]
    if custom_given:
        given.append("layers")
        names.append(f"{param('layers')}/{param('kv_heads')}/...")
    if len(given) > 1:
        raise UsageError(f"give only one of {', '.join(names)}", field=given[1])
    if block_bytes is not None and (dtype is not None or tp is not None or block_tokens != 256):
        raise UsageError(f"{param('dtype')}, {param('tp')} and {param('block_tokens')} "
                         f"describe a model; {param('block_bytes')} is already a size",
                         field="block_bytes")
    if not given and (dtype is not None or tp is not None):
        raise UsageError(f"{param('dtype')} and {param('tp')} describe a model: give "
                         f"{param('model')}, {param('geometry_file')} or {param('layers')}/...",
                         field="dtype" if dtype is not None else "tp")
    if model is not None:
        from kvtool.geometry.presets import lookup
        spec = lookup(model)
    elif geometry_file is not None:
        from kvtool.geometry.custom import from_toml
        spec = from_toml(geometry_file)
    elif custom_given:
        if layers is None:
            raise UsageError("a custom model needs the number of layers", field="layers")
        from kvtool.geometry.custom import custom
        spec = custom(layers=layers, kv_heads=kv_heads, head_dim=head_dim,
                      kv_lora_rank=kv_lora_rank, qk_rope_head_dim=qk_rope_head_dim, dtype=dtype)
    else:
        return None
    return spec.geometry(dtype=dtype, block_tokens=block_tokens, tp=1 if tp is None else tp)
