"""A model's weights and attention shape: what a step-time model needs beyond the KV layout.

:class:`Architecture` holds the numbers of a model's ``config.json`` that set its compute
and its weight traffic (docs/geometry.md, "Parameters"), plus the published total and
active parameter counts. It is attached to a :class:`~kvtool.geometry.model.ModelSpec`
(``spec.arch``); the KV layout stays in the spec's components.

Invariants:

* ``0 < active_params <= total_params``;
* MoE (``experts > 0``): ``0 < experts_per_token <= experts``, ``moe_intermediate_size``
  and ``moe_layers`` are positive, and the routed experts fit inside the totals:
  ``routed_params <= total_params`` and ``routed_active_params <= active_params``;
* dense models have ``experts == experts_per_token == moe_layers == 0``.

Everything here is one full copy of the model (all ranks together); per-rank figures
are the roofline's business (kvtool/serving/roofline.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvtool.errors import UsageError

#: Bytes per weight element of the dtypes a checkpoint's weights are stored in.
WEIGHT_BYTES: dict[str, float] = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0,
                                  "int8": 1.0, "fp4": 0.5, "int4": 0.5}

_WEIGHT_ALIASES: dict[str, str] = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16",
                                   "float32": "fp32", "float8": "fp8", "fp8_e4m3": "fp8",
                                   "float8_e4m3fn": "fp8", "e4m3": "fp8", "mxfp4": "fp4",
                                   "nvfp4": "fp4", "w8a8": "fp8", "w4a16": "int4"}


def weight_dtype(name: str, *, field: str = "weight_dtype") -> str:
    """Canonical weight dtype (``"BF16"`` → ``"bf16"``); unknown → :class:`UsageError`."""
    key = str(name).strip().lower()
    key = _WEIGHT_ALIASES.get(key, key)
    if key not in WEIGHT_BYTES:
        raise UsageError(f"unknown weight dtype {name!r} (known: {', '.join(WEIGHT_BYTES)})",
                         field=field)
    return key


@dataclass(frozen=True)
class Architecture:
    """Sizes of one model's weights and attention (one full copy, all TP ranks together).

    ``head_dim`` is the query/key head dimension attention multiplies with (MLA:
    ``qk_nope_head_dim + qk_rope_head_dim``); ``v_head_dim`` the value head dimension when
    it differs. ``attn_pair_flops`` overrides the attention FLOPs per (new token, context
    token) pair summed over all layers, for models whose attention is not full (compressed
    or sparse attention); ``attn_token_flops`` adds attention FLOPs per new token that do
    not grow with the context (sliding windows, top-k selections).
    """

    hidden_size: int
    q_heads: int
    head_dim: int
    vocab_size: int
    total_params: int
    active_params: int
    source: str
    v_head_dim: int | None = None
    intermediate_size: int | None = None
    experts: int = 0
    experts_per_token: int = 0
    shared_experts: int = 0
    moe_intermediate_size: int | None = None
    moe_layers: int = 0
    q_lora_rank: int | None = None
    weight_dtype: str = "bf16"
    """Dtype of the published checkpoint's weights (the roofline's default)."""
    expert_weight_dtype: str | None = None
    """Dtype of the routed experts when the checkpoint stores them differently (V4: fp4)."""
    attn_pair_flops: float | None = None
    attn_token_flops: float = 0.0

    def __post_init__(self) -> None:
        for name in ("hidden_size", "q_heads", "head_dim", "vocab_size", "total_params",
                     "active_params"):
            _positive(getattr(self, name), name)
        if self.active_params > self.total_params:
            raise UsageError(f"active parameters ({self.active_params:,}) exceed the total "
                             f"({self.total_params:,})", field="active_params")
        if self.experts:
            for name in ("experts_per_token", "moe_intermediate_size", "moe_layers"):
                _positive(getattr(self, name), name)
            if self.experts_per_token > self.experts:
                raise UsageError(f"{self.experts_per_token} experts per token of only "
                                 f"{self.experts}", field="experts_per_token")
            if self.routed_params > self.total_params:
                raise UsageError(f"the routed experts alone ({self.routed_params:,} "
                                 f"parameters) exceed total_params ({self.total_params:,})",
                                 field="total_params")
            if self.routed_active_params > self.active_params:
                raise UsageError(f"the active routed experts alone "
                                 f"({self.routed_active_params:,} parameters) exceed "
                                 f"active_params ({self.active_params:,})", field="active_params")
        elif self.experts_per_token or self.moe_layers:
            raise UsageError("experts_per_token and moe_layers need experts", field="experts")
        weight_dtype(self.weight_dtype)
        if self.expert_weight_dtype is not None:
            weight_dtype(self.expert_weight_dtype, field="expert_weight_dtype")

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @property
    def expert_params(self) -> int:
        """One routed expert of one layer: gate, up and down projections (SwiGLU)."""
        return 3 * self.hidden_size * (self.moe_intermediate_size or 0) if self.is_moe else 0

    @property
    def routed_params(self) -> int:
        """All routed experts of all MoE layers."""
        return self.moe_layers * self.experts * self.expert_params

    @property
    def routed_active_params(self) -> int:
        """The routed experts one token uses (``experts_per_token`` per MoE layer)."""
        return self.moe_layers * self.experts_per_token * self.expert_params

    @property
    def shared_params(self) -> int:
        """Parameters every token uses: attention, dense FFNs, shared experts, embeddings."""
        return self.active_params - self.routed_active_params

    def expected_experts(self, tokens: float) -> float:
        """Expected distinct experts per MoE layer that ``tokens`` tokens route to.

        Modelled: each token picks ``k`` of ``E`` experts uniformly and independently of
        the others, so an expert is missed by all with probability ``(1 − k/E)^tokens``.
        Real routers are skewed, which touches fewer experts; this is the upper side.
        """
        if not self.is_moe or tokens <= 0:
            return 0.0
        if self.experts_per_token == self.experts:
            return float(self.experts)
        miss = math.exp(tokens * math.log1p(-self.experts_per_token / self.experts))
        return self.experts * (1.0 - miss)

    def weights_touched(self, tokens: float) -> float:
        """Parameters a forward pass over ``tokens`` tokens reads: shared + routed experts hit."""
        if tokens <= 0:
            return 0.0
        return self.shared_params + self.moe_layers * self.expert_params * \
            self.expected_experts(tokens)

    def pair_flops(self, layers: int) -> float:
        """Attention FLOPs per (new token, context token) pair over ``layers`` layers.

        ``2·d_qk`` for the score and ``2·d_v`` for the weighted sum, per query head:
        ``2·L·n_q·(d_qk + d_v)``, which is the usual ``4·L·n_q·d_head`` when the two dims
        are equal (docs/serving.md, "Step time").
        """
        if self.attn_pair_flops is not None:
            return self.attn_pair_flops
        return 2.0 * layers * self.q_heads * (self.head_dim + (self.v_head_dim or self.head_dim))

    def to_dict(self) -> dict[str, object]:
        """JSON-ready (docs/geometry.md)."""
        return {"hidden_size": self.hidden_size, "q_heads": self.q_heads,
                "head_dim": self.head_dim, "v_head_dim": self.v_head_dim,
                "vocab_size": self.vocab_size, "intermediate_size": self.intermediate_size,
                "total_params": self.total_params, "active_params": self.active_params,
                "experts": self.experts, "experts_per_token": self.experts_per_token,
                "shared_experts": self.shared_experts,
                "moe_intermediate_size": self.moe_intermediate_size,
                "moe_layers": self.moe_layers, "q_lora_rank": self.q_lora_rank,
                "weight_dtype": self.weight_dtype,
                "expert_weight_dtype": self.expert_weight_dtype, "source": self.source}


def decoder_params(*, layers: int, hidden_size: int, q_heads: int, kv_heads: int,
                   head_dim: int, vocab_size: int, intermediate_size: int | None = None,
                   experts: int = 0, experts_per_token: int = 0,
                   moe_intermediate_size: int | None = None, tie_word_embeddings: bool = False,
                   qkv_bias: bool = False, qk_norm: bool = False) -> tuple[int, int]:
    """(total, active) parameters of a Llama/Qwen-style decoder, counted from its config.

    Per layer: q and o projections ``2·h·n_q·d``, k and v ``2·h·n_kv·d`` (+ their biases
    when ``qkv_bias``, as Qwen2; + per-head q/k norms when ``qk_norm``, as Qwen3), two
    RMSNorms ``2·h``, and either a SwiGLU FFN ``3·h·i`` or ``experts`` routed experts of
    ``3·h·i_moe`` plus a router ``h·E`` (of which a token uses ``experts_per_token``); plus
    the embedding, the LM head (unless tied) and the final norm.
    """
    attn = 2 * hidden_size * q_heads * head_dim + 2 * hidden_size * kv_heads * head_dim
    if qkv_bias:
        attn += q_heads * head_dim + 2 * kv_heads * head_dim
    if qk_norm:
        attn += 2 * head_dim
    if experts:
        expert = 3 * hidden_size * (moe_intermediate_size or 0)
        ffn_total = experts * expert + hidden_size * experts
        ffn_active = experts_per_token * expert + hidden_size * experts
    else:
        ffn_total = ffn_active = 3 * hidden_size * (intermediate_size or 0)
    rest = vocab_size * hidden_size * (1 if tie_word_embeddings else 2) + hidden_size
    norms = 2 * hidden_size
    return (layers * (attn + ffn_total + norms) + rest, layers * (attn + ffn_active + norms) + rest)


def _positive(value: object, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise UsageError(f"must be a positive integer, got {value!r}", field=name)
