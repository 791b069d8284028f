"""Custom model geometry from explicit numbers or a TOML file (docs/geometry.md).

TOML keys (top level)::

    name = "my-model"            # required
    source = "where the numbers come from"
    layers = 32                  # required
    dtype = "bf16"               # default dtype (or dtype_bytes = 2)
    # MHA/GQA:
    kv_heads = 8
    head_dim = 128
    # or MLA:
    kv_lora_rank = 512
    qk_rope_head_dim = 64
    # or explicit per-layer records (replicated on every rank, like MLA):
    [[components]]
    name = "csa"; layers = 21; entry_bytes = 584; tokens_per_entry = 4; pad_to = 576

    # weights and attention, for the serving model's step time (all optional; any of them
    # makes the model an Architecture, see kvtool/geometry/params.py):
    hidden_size = 4096; q_heads = 32; vocab_size = 32000
    intermediate_size = 11008        # dense FFN; with MHA/GQA the totals are then counted
    total_params = 6738415616        # else required (active_params defaults to it)
    experts = 0; experts_per_token = 0; moe_intermediate_size = 0; moe_layers = layers
    qk_nope_head_dim = 128; v_head_dim = 128   # MLA; attn_head_dim overrides d_qk
    weight_dtype = "bf16"; expert_weight_dtype = "fp4"
    qkv_bias = false; qk_norm = false; tie_word_embeddings = false   # for counting

Every mistake raises :class:`InputError` naming the file, the line (when it can be found)
and the key; unknown keys are rejected so typos do not silently fall back to defaults.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import cast

from kvtool.configfile import ConfigDocument, ConfigTable, read_config
from kvtool.errors import UsageError
from kvtool.geometry.dtypes import DTYPE_BYTES, canonical_dtype
from kvtool.geometry.model import ComponentKind, ComponentSpec, ModelSpec
from kvtool.geometry.params import Architecture, decoder_params, weight_dtype

_ARCH_INTS = ("hidden_size", "q_heads", "vocab_size", "intermediate_size", "total_params",
              "active_params", "experts", "experts_per_token", "shared_experts",
              "moe_intermediate_size", "moe_layers", "q_lora_rank", "qk_nope_head_dim",
              "v_head_dim", "attn_head_dim")
_ARCH_BOOLS = ("qkv_bias", "qk_norm", "tie_word_embeddings")
_ARCH_STRS = ("weight_dtype", "expert_weight_dtype")
_ARCH_KEYS = {*_ARCH_INTS, *_ARCH_BOOLS, *_ARCH_STRS}
_TOP_KEYS = {"name", "source", "layers", "dtype", "dtype_bytes", "kv_heads", "head_dim",
             "kv_lora_rank", "qk_rope_head_dim", "attention", "components", "aliases", "notes",
             *_ARCH_KEYS}
_COMPONENT_KEYS = {"name", "layers", "entry_bytes", "tokens_per_entry", "pad_to", "kind"}
_BYTES_TO_DTYPE = {1: "fp8", 2: "bf16", 4: "fp32"}


def custom(*, layers: int, name: str = "custom", kv_heads: int | None = None,
           head_dim: int | None = None, kv_lora_rank: int | None = None,
           qk_rope_head_dim: int | None = None, dtype: str | None = None,
           dtype_bytes: int | None = None, source: str = "user-supplied numbers") -> ModelSpec:
    """A model from explicit numbers: MHA/GQA (``kv_heads``, ``head_dim``) or MLA
    (``kv_lora_rank`` + ``qk_rope_head_dim``). Errors name the parameter (``field``)."""

    _positive(layers, "layers")
    default_dtype = _pick_dtype(dtype, dtype_bytes)
    mha = kv_heads is not None or head_dim is not None
    mla = kv_lora_rank is not None or qk_rope_head_dim is not None
    if mha and mla:
        raise UsageError("give either kv_heads/head_dim (MHA/GQA) or kv_lora_rank/"
                         "qk_rope_head_dim (MLA), not both", field="kv_lora_rank")
    if mha:
        if kv_heads is None or head_dim is None:
            missing = "kv_heads" if kv_heads is None else "head_dim"
            raise UsageError("MHA/GQA needs both kv_heads and head_dim", field=missing)
        _positive(kv_heads, "kv_heads")
        _positive(head_dim, "head_dim")
        return ModelSpec(
            name=name, source=source, attention="mha", layers=layers, default_dtype=default_dtype,
            components=(ComponentSpec("kv", "kv", layers, elements=2 * kv_heads * head_dim),),
            kv_heads=kv_heads, head_dim=head_dim)
    if mla:
        rank = kv_lora_rank or 0
        rope = qk_rope_head_dim or 0
        _positive(rank, "kv_lora_rank")
        if rope < 0:
            raise UsageError(f"must not be negative, got {rope}", field="qk_rope_head_dim")
        return ModelSpec(
            name=name, source=source, attention="mla", layers=layers, default_dtype=default_dtype,
            components=(ComponentSpec("latent", "latent", layers, elements=rank + rope),),
            kv_lora_rank=rank, qk_rope_head_dim=rope)
    raise UsageError("a custom geometry needs kv_heads and head_dim (MHA/GQA) or kv_lora_rank "
                     "and qk_rope_head_dim (MLA)", field="kv_heads")


def from_toml(path: str | Path) -> ModelSpec:
    """Read a custom geometry from TOML (see the module docstring for the keys)."""
    return _from_doc(read_config(path, kind="toml"))


def _from_doc(doc: ConfigDocument) -> ModelSpec:
    t = doc.table()
    t.check_keys(_TOP_KEYS)
    name = t.text("name", required=True)
    if not name.strip():
        t.fail("must be a non-empty string", t.at("name"))
    source = t.text("source", f"custom geometry from {Path(doc.source or 'geometry').name}")
    layers = t.integer("layers", lo=1, required=True)
    try:
        if not t.has("components"):
            spec = custom(
                layers=layers, name=name, source=source,
                kv_heads=t.integer("kv_heads", lo=1), head_dim=t.integer("head_dim", lo=1),
                kv_lora_rank=t.integer("kv_lora_rank", lo=1),
                qk_rope_head_dim=t.integer("qk_rope_head_dim", lo=1),
                dtype=t.text("dtype"), dtype_bytes=t.integer("dtype_bytes"))
        else:
            spec = _with_components(t, name, source, layers)
        if any(t.has(key) for key in _ARCH_KEYS):
            spec = replace(spec, arch=_architecture(t, spec, source))
    except UsageError as exc:
        t.fail(exc.message, t.at(exc.field) if exc.field else None)
    t.choice("attention", ("mha", "gqa", "mla"))
    return spec


def _with_components(t: ConfigTable, name: str, source: str, layers: int) -> ModelSpec:
    tables = t.tables("components")
    if not tables:
        t.fail("must be a non-empty array of tables ([[components]])", t.at("components"))
    for key in ("kv_heads", "head_dim", "kv_lora_rank", "qk_rope_head_dim"):
        if t.has(key):
            t.fail("give either [[components]] or the head/latent numbers, not both", t.at(key))
    specs = []
    for i, c in enumerate(tables):
        c.check_keys(_COMPONENT_KEYS)
        specs.append(ComponentSpec(
            name=c.text("name", f"component{i + 1}"),
            kind=cast(ComponentKind, c.choice("kind", ("kv", "latent", "indexer"), "latent")),
            layers=c.integer("layers", lo=1, required=True),
            fixed_bytes=c.integer("entry_bytes", lo=1, required=True),
            tokens_per_entry=c.integer("tokens_per_entry", 1, lo=1),
            pad_to=c.integer("pad_to", 1, lo=1)))
    if sum(s.layers for s in specs if s.kind != "indexer") > layers:
        t.fail("components cover more layers than the model has", t.at("layers"))
    dtype = _pick_dtype(t.text("dtype"), t.integer("dtype_bytes"))
    return ModelSpec(name=name, source=source, attention="mla", layers=layers,
                     components=tuple(specs), default_dtype=dtype)


def _architecture(t: ConfigTable, spec: ModelSpec, source: str) -> Architecture:
    """The weights/attention part of a custom model (docs/geometry.md, "Parameters")."""
    ints = {k: t.integer(k, lo=1, required=True) for k in _ARCH_INTS
            if t.has(k) and k != "experts"}
    experts = t.integer("experts", 0, lo=0)
    flags = {key: t.flag(key) for key in _ARCH_BOOLS}
    for key in ("hidden_size", "q_heads", "vocab_size"):
        if key not in ints:
            t.fail("required when any weight/attention figure is given", t.at(key))
    if "attn_head_dim" in ints:
        head_dim = ints["attn_head_dim"]
    elif spec.attention == "mha" and spec.head_dim:
        head_dim = spec.head_dim
    elif spec.qk_rope_head_dim is not None and "qk_nope_head_dim" in ints:
        head_dim = ints["qk_nope_head_dim"] + spec.qk_rope_head_dim
    else:
        missing = "qk_nope_head_dim" if spec.kv_lora_rank else "attn_head_dim"
        t.fail("required: the query/key head dimension attention multiplies with", t.at(missing))
    moe_layers = ints.get("moe_layers", spec.layers if experts else 0)
    total, active = ints.get("total_params"), ints.get("active_params")
    if total is None:
        countable = spec.attention == "mha" and spec.kv_heads and spec.head_dim and (
            "moe_intermediate_size" in ints if experts else "intermediate_size" in ints)
        if not countable:
            t.fail("required unless an MHA/GQA model gives intermediate_size (or its MoE "
                   "sizes) to count them from", t.at("total_params"))
        total, counted_active = decoder_params(
            layers=spec.layers, hidden_size=ints["hidden_size"], q_heads=ints["q_heads"],
            kv_heads=spec.kv_heads or 0, head_dim=spec.head_dim or 0,
            vocab_size=ints["vocab_size"], intermediate_size=ints.get("intermediate_size"),
            experts=experts, experts_per_token=ints.get("experts_per_token", 0),
            moe_intermediate_size=ints.get("moe_intermediate_size"),
            tie_word_embeddings=flags["tie_word_embeddings"],
            qkv_bias=flags["qkv_bias"], qk_norm=flags["qk_norm"])
        active = active or counted_active
    expert_dtype = t.text("expert_weight_dtype")
    return Architecture(
        hidden_size=ints["hidden_size"], q_heads=ints["q_heads"], head_dim=head_dim,
        vocab_size=ints["vocab_size"], total_params=total,
        active_params=active if active is not None else total, source=source,
        v_head_dim=ints.get("v_head_dim"), intermediate_size=ints.get("intermediate_size"),
        experts=experts, experts_per_token=ints.get("experts_per_token", 0),
        shared_experts=ints.get("shared_experts", 0),
        moe_intermediate_size=ints.get("moe_intermediate_size"), moe_layers=moe_layers,
        q_lora_rank=ints.get("q_lora_rank"),
        weight_dtype=weight_dtype(t.text("weight_dtype", "bf16")),
        expert_weight_dtype=None if expert_dtype is None else weight_dtype(
            expert_dtype, field="expert_weight_dtype"))


def _pick_dtype(dtype: str | None, dtype_bytes: int | None) -> str:
    if dtype is not None and dtype_bytes is not None:
        raise UsageError("give dtype or dtype_bytes, not both", field="dtype_bytes")
    if dtype_bytes is not None:
        if dtype_bytes not in _BYTES_TO_DTYPE:
            raise UsageError(f"must be 1, 2 or 4, got {dtype_bytes}", field="dtype_bytes")
        return _BYTES_TO_DTYPE[dtype_bytes]
    if dtype is None:
        return "bf16"
    canon = canonical_dtype(str(dtype), field="dtype")
    if canon not in DTYPE_BYTES:
        raise UsageError(f"{canon} needs a model-specific record size; use [[components]] with "
                         "entry_bytes", field="dtype")
    return canon


def _positive(value: int, field: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise UsageError(f"must be a positive integer, got {value!r}", field=field)
