"""The KV geometry of a model: what one block of tokens costs in bytes, and how it is split.

Vocabulary (see docs/geometry.md):

* A **component** is one kind of per-layer KV record: ``kv`` (K and V of MHA/GQA),
  ``latent`` (MLA's compressed KV plus RoPE key), ``indexer`` (DeepSeek sparse-attention
  indexer keys). A component may store one **entry** per ``tokens_per_entry`` tokens
  (compressed attention) and pad each layer's page to a multiple of ``pad_to`` bytes.
* A **copy** is the whole model's KV for one block (all layers, all heads).
* A **rank's object**: MHA/GQA heads are sharded over ``min(tp, kv_heads)`` ranks (and
  replicated when ``tp > kv_heads``); MLA has no heads to shard, so every rank stores a
  full copy unless the connector de-duplicates.

Invariants of :class:`KVGeometry`:

* ``block_bytes == sum(object_bytes("layer")) == object_bytes("block")[0]``
* ``block_bytes * shards == copy_block_bytes``
* ``per_rank_duplication == tp // shards`` (t in the capacity formula)
* ``bytes_per_token == copy_block_bytes / block_tokens`` (a float: padded records need not
  divide evenly; for MHA/GQA and MLA presets it is a whole number)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from kvtool.errors import UsageError
from kvtool.geometry.dtypes import DTYPE_BYTES, KNOWN_DTYPES, canonical_dtype
from kvtool.geometry.params import Architecture

Attention = Literal["mha", "mla"]
Layout = Literal["block", "layer"]
LAYOUTS: tuple[str, ...] = ("block", "layer")
ComponentKind = Literal["kv", "latent", "indexer"]


def _round_up(n: int, a: int) -> int:
    return -(-n // a) * a


@dataclass(frozen=True)
class ComponentSpec:
    """A per-layer record kind as a model defines it, before the dtype is chosen.

    ``elements`` is the number of dtype elements per entry (``2·H_kv·d_head`` for ``kv``,
    ``kv_lora_rank + qk_rope_head_dim`` for ``latent``), or ``None`` when only the packed
    ``records`` are known. ``records`` maps a dtype to an exact entry size in bytes,
    overriding ``elements × bytes(dtype)`` (e.g. ``fp8_ds_mla`` → 656 for DeepSeek-V3).
    ``fixed_bytes`` is an entry size that does not depend on the KV dtype (the fp8 indexer).
    """

    name: str
    kind: ComponentKind
    layers: int
    elements: int | None = None
    records: Mapping[str, int] = field(default_factory=dict)
    fixed_bytes: int | None = None
    tokens_per_entry: int = 1
    pad_to: int = 1

    def entry_bytes(self, dtype: str) -> int | None:
        """Bytes per entry at ``dtype``, or ``None`` when this component has no size for it."""
        if self.fixed_bytes is not None:
            return self.fixed_bytes
        if dtype in self.records:
            return self.records[dtype]
        if self.elements is not None and dtype in DTYPE_BYTES:
            return self.elements * DTYPE_BYTES[dtype]
        return None


@dataclass(frozen=True)
class ModelSpec:
    """A model's KV layout, independent of dtype, block size and TP (a preset or custom).

    ``arch`` adds the weights and attention shape a step-time model needs
    (:class:`~kvtool.geometry.params.Architecture`); ``None`` when only the KV layout is
    known (a custom geometry given as numbers of KV heads or records only).
    """

    name: str
    source: str
    attention: Attention
    layers: int
    components: tuple[ComponentSpec, ...]
    default_dtype: str = "bf16"
    kv_heads: int | None = None
    head_dim: int | None = None
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    aliases: tuple[str, ...] = ()
    notes: str = ""
    dtype_aliases: Mapping[str, str] = field(default_factory=dict)
    arch: Architecture | None = None

    def supported_dtypes(self) -> tuple[str, ...]:
        out = []
        for d in KNOWN_DTYPES:
            if all(c.entry_bytes(self.dtype_aliases.get(d, d)) is not None
                   for c in self.components):
                out.append(d)
        return tuple(out)

    def geometry(self, *, dtype: str | None = None, block_tokens: int = 256,
                 tp: int = 1) -> KVGeometry:
        """Resolve to concrete sizes; bad values raise :class:`UsageError` naming the option."""
        canon = canonical_dtype(dtype if dtype is not None else self.default_dtype)
        record = self.dtype_aliases.get(canon, canon)
        if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or block_tokens <= 0:
            raise UsageError(f"block tokens must be a positive integer, got {block_tokens!r}",
                             field="block_tokens")
        if isinstance(tp, bool) or not isinstance(tp, int) or tp <= 0:
            raise UsageError(f"TP size must be a positive integer, got {tp!r}", field="tp")
        comps: list[Component] = []
        for spec in self.components:
            entry = spec.entry_bytes(record)
            if entry is None:
                raise UsageError(
                    f"{self.name} has no known KV layout for dtype {canon} "
                    f"(supported: {', '.join(self.supported_dtypes())})", field="dtype")
            if block_tokens % spec.tokens_per_entry:
                raise UsageError(
                    f"{self.name}: the {spec.name} component stores one entry per "
                    f"{spec.tokens_per_entry} tokens, so block tokens must be a multiple of "
                    f"{spec.tokens_per_entry}, got {block_tokens}", field="block_tokens")
            comps.append(Component(spec.name, spec.kind, spec.layers, entry,
                                   spec.tokens_per_entry, spec.pad_to))
        shards = 1
        if self.attention == "mha":
            heads = self.kv_heads or 1
            if heads % tp and tp % heads:
                raise UsageError(
                    f"{self.name} has {heads} KV heads; TP size must divide it or be a multiple "
                    f"of it (vLLM's rule), got {tp}", field="tp")
            shards = min(tp, heads)
        return KVGeometry(model=self.name, dtype=canon, block_tokens=block_tokens, tp=tp,
                          attention=self.attention, layers=self.layers,
                          kv_heads=self.kv_heads, shards=shards, components=tuple(comps),
                          source=self.source, record=record if record != canon else None)


@dataclass(frozen=True)
class Component:
    """A per-layer record kind with concrete sizes (one full copy, not yet sharded)."""

    name: str
    kind: ComponentKind
    layers: int
    entry_bytes: int
    tokens_per_entry: int = 1
    pad_to: int = 1

    def entries(self, block_tokens: int) -> int:
        return block_tokens // self.tokens_per_entry

    def page_bytes(self, block_tokens: int, shards: int = 1) -> int:
        """One layer's bytes for one block on one rank, padded to ``pad_to``."""
        raw = self.entries(block_tokens) * self.entry_bytes
        return _round_up(raw // shards, self.pad_to)

    def unpadded_bytes(self, block_tokens: int) -> int:
        return self.entries(block_tokens) * self.entry_bytes


@dataclass(frozen=True)
class ObjectSize:
    """``count`` objects of ``nbytes`` each, per block per rank, in some layout."""

    name: str
    nbytes: int
    count: int


@dataclass(frozen=True)
class KVGeometry:
    """Concrete KV sizes of one model at one dtype, block size and TP size."""

    model: str
    dtype: str
    block_tokens: int
    tp: int
    attention: Attention
    layers: int
    components: tuple[Component, ...]
    shards: int = 1
    kv_heads: int | None = None
    source: str = ""
    record: str | None = None

    @property
    def copy_block_bytes(self) -> int:
        """One block, all layers, all heads: one full copy of the model's KV."""
        return sum(c.layers * c.page_bytes(self.block_tokens) for c in self.components)

    @property
    def block_bytes(self) -> int:
        """One whole-block object as ONE rank stores it (its shard for MHA; a copy for MLA)."""
        return sum(c.layers * c.page_bytes(self.block_tokens, self.shards)
                   for c in self.components)

    @property
    def unpadded_block_bytes(self) -> int:
        """:attr:`copy_block_bytes` without per-component page padding."""
        return sum(c.layers * c.unpadded_bytes(self.block_tokens) for c in self.components)

    @property
    def bytes_per_token(self) -> float:
        """Whole model, all layers, per stored copy (b in the capacity formula)."""
        return self.copy_block_bytes / self.block_tokens

    @property
    def per_rank_duplication(self) -> int:
        """t in the capacity formula: how many ranks hold each byte of KV."""
        return self.tp // self.shards

    @property
    def all_ranks_block_bytes(self) -> int:
        """Bytes all TP ranks store for one block (``copy_block_bytes × t``)."""
        return self.block_bytes * self.tp

    def per_layer_object_bytes(self) -> tuple[int, ...]:
        """One rank's per-layer objects for one block, component by component."""
        out: list[int] = []
        for c in self.components:
            out.extend([c.page_bytes(self.block_tokens, self.shards)] * c.layers)
        return tuple(out)

    def object_bytes(self, layout: Layout = "block") -> tuple[int, ...]:
        """Size of every object one rank writes per block in ``layout``.

        ``block``: one object spanning all layers (vLLM offload, vLLM-Mooncake, LMCache's
        default ``KV_2LTD`` chunk). ``layer``: one object per layer and component
        (LMCache layerwise ``KV_T2D``; vLLM's GPU pages).
        """
        if layout == "block":
            return (self.block_bytes,)
        if layout == "layer":
            return self.per_layer_object_bytes()
        raise UsageError(f"unknown layout {layout!r} (use block or layer)", field="layout")

    def object_sizes(self, layout: Layout = "block") -> tuple[ObjectSize, ...]:
        """Distinct objects of ``layout`` with how many of each a rank writes per block."""
        if layout == "block":
            return (ObjectSize("block", self.block_bytes, 1),)
        if layout == "layer":
            return tuple(ObjectSize(f"layer:{c.name}", c.page_bytes(self.block_tokens, self.shards),
                                    c.layers) for c in self.components)
        raise UsageError(f"unknown layout {layout!r} (use block or layer)", field="layout")

    def to_dict(self) -> dict[str, object]:
        """JSON-ready summary (schema in docs/geometry.md)."""
        return {
            "model": self.model,
            "dtype": self.dtype,
            "record": self.record,
            "attention": self.attention,
            "layers": self.layers,
            "kv_heads": self.kv_heads,
            "block_tokens": self.block_tokens,
            "tp": self.tp,
            "shards": self.shards,
            "per_rank_duplication": self.per_rank_duplication,
            "bytes_per_token": self.bytes_per_token,
            "copy_block_bytes": self.copy_block_bytes,
            "unpadded_block_bytes": self.unpadded_block_bytes,
            "block_bytes": self.block_bytes,
            "all_ranks_block_bytes": self.all_ranks_block_bytes,
            "components": [
                {"name": c.name, "kind": c.kind, "layers": c.layers, "entry_bytes": c.entry_bytes,
                 "tokens_per_entry": c.tokens_per_entry, "pad_to": c.pad_to,
                 "layer_object_bytes": c.page_bytes(self.block_tokens, self.shards)}
                for c in self.components
            ],
            "source": self.source,
        }
