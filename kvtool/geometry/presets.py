"""Preset model geometries, each with the source its numbers come from.

Numbers follow docs/geometry.md (copied into
docs/geometry.md so the project does not depend on ../shared at run time).
"""

from __future__ import annotations

import re

from kvtool.errors import UsageError, param
from kvtool.geometry.model import ComponentSpec, KVGeometry, ModelSpec
from kvtool.geometry.params import Architecture, decoder_params

_LMCACHE_CALC = ("LMCache examples/kv_cache_calculator/modelconfig.json "
                 "(num_hidden_layers, num_key_value_heads, head_dim)")


def _gqa(name: str, layers: int, kv_heads: int, head_dim: int, source: str,
         aliases: tuple[str, ...], notes: str = "", arch: Architecture | None = None) -> ModelSpec:
    """An MHA/GQA model: per layer and token, K and V of ``kv_heads × head_dim`` elements."""
    return ModelSpec(
        name=name, source=source, attention="mha", layers=layers,
        components=(ComponentSpec("kv", "kv", layers, elements=2 * kv_heads * head_dim),),
        kv_heads=kv_heads, head_dim=head_dim, aliases=aliases, notes=notes, arch=arch)


def _counted(source: str, *, layers: int, hidden_size: int, q_heads: int, kv_heads: int,
             head_dim: int, vocab_size: int, intermediate_size: int | None = None,
             experts: int = 0, experts_per_token: int = 0,
             moe_intermediate_size: int | None = None, qkv_bias: bool = False,
             qk_norm: bool = False) -> Architecture:
    """A Llama/Qwen-style architecture whose parameter counts are counted from its config
    (:func:`~kvtool.geometry.params.decoder_params`; tests check them against the
    published totals)."""
    total, active = decoder_params(
        layers=layers, hidden_size=hidden_size, q_heads=q_heads, kv_heads=kv_heads,
        head_dim=head_dim, vocab_size=vocab_size, intermediate_size=intermediate_size,
        experts=experts, experts_per_token=experts_per_token,
        moe_intermediate_size=moe_intermediate_size, qkv_bias=qkv_bias, qk_norm=qk_norm)
    return Architecture(
        hidden_size=hidden_size, q_heads=q_heads, head_dim=head_dim, vocab_size=vocab_size,
        total_params=total, active_params=active, source=source,
        intermediate_size=intermediate_size, experts=experts,
        experts_per_token=experts_per_token, moe_intermediate_size=moe_intermediate_size,
        moe_layers=layers if experts else 0)


# DeepSeek MLA: kv_lora_rank 512 + qk_rope_head_dim 64 = 576 elements per layer and token.
_DS_LATENT = 512 + 64
# vLLM fp8_ds_mla (V3/V3.2): 512 fp8 latent + 4 fp32 tile scales (16 B) + 64 bf16 rope (128 B).
_DS_MLA_V3_RECORD = 512 + 16 + 64 * 2
# DeepSeek sparse-attention indexer key per layer and token: 128 fp8 + one fp32 scale.
_DSA_INDEXER = 128 + 4
# vLLM fp8_ds_mla record for V4 (vLLM PR #56893: "656 B for V3.2 and 584 B for V4").
_DS_MLA_V4_RECORD = 584
# vLLM V4 pages are rounded up to the TMA stride (PR #56893: "576 B for V4").
_V4_TMA_STRIDE = 576

_DEEPSEEK_V3_SOURCE = ("DeepSeek-V3 config.json (61 layers, kv_lora_rank 512, qk_rope_head_dim 64) "
                       "via LMCache kv_cache_calculator; fp8_ds_mla 656 B from vLLM PR #56893")

_LLAMA2_7B_SRC = ("meta-llama/Llama-2-7b-hf config.json (32 layers, hidden 4096, 32 heads = 32 KV "
                  "heads x 128, intermediate 11008, vocab 32000), as quoted in public code "
                  "(e.g. a DenseModelConfigs table citing huggingface.co/meta-llama/Llama-2-7b); "
                  "6.74B parameters counted")
_LLAMA3_8B_ARCH_SRC = ("Llama-3.1-8B config.json (hidden 4096, 32 heads, 8 KV heads, intermediate "
                       "14336, vocab 128256; recalled, not re-verified); 8.03B counted = published")
_LLAMA3_70B_ARCH_SRC = ("Llama-3.1-70B config.json (hidden 8192, 64 heads, 8 KV heads, intermediate "
                        "28672, vocab 128256; recalled, not re-verified); 70.6B counted = published")
_QWEN25_32B_SRC = ("Qwen2.5-32B model card (64 layers, 40 Q / 8 KV heads, 32.5B parameters) as "
                   "mirrored in ZHUI/paddlenlp_model_readme; hidden 5120, intermediate 27648, "
                   "vocab 152064, QKV bias from its config.json (recalled, not re-verified); "
                   "32.76B counted (Hugging Face lists 32.8B)")
_QWEN3_235B_ARCH_SRC = ("Qwen3-235B-A22B config.json (hidden 4096, 64 heads, 4 KV heads, 128 experts "
                        "top-8, moe_intermediate 1536, vocab 151936) as in THUDM/slime "
                        "scripts/models/qwen3-235B-A22B.sh; 235.1B / 22.2B counted (published "
                        "235B / 22B)")
_QWEN3_CODER_ARCH_SRC = ("Qwen3-Coder-480B-A35B-Instruct config.json: hidden 6144, 96 heads, 8 KV "
                         "heads x 128, 62 layers, vocab 151936 (THUDM/slime "
                         "scripts/models/qwen3-coder-480B-A35B.sh); 160 experts top-8, "
                         "moe_intermediate_size 2560 (a public deployment note quoting the config); "
                         "480.2B / 35.5B counted (published 480B / 35B)")
_DEEPSEEK_V3_ARCH_SRC = ("DeepSeek-V3 config.json (hidden 7168, 128 heads, q_lora_rank 1536, "
                         "qk_nope 128 + rope 64, v_head_dim 128, 256 routed experts top-8 + 1 "
                         "shared, moe_intermediate 2048, first_k_dense_replace 3, intermediate "
                         "18432, vocab 129280); 671B total / 37B active from the model card")
_DEEPSEEK_V4_ARCH_SRC = (
    "deepseek-ai/DeepSeek-V4-Flash config.json as quoted in public code (hidden 4096, 43 layers, "
    "64 heads, head_dim 512, qk_rope 64, q_lora_rank 1024, o_lora_rank 1024, 256 routed experts "
    "top-6 + 1 shared, moe_intermediate 2048, vocab 129280, index_n_heads 64 x index_head_dim 128, "
    "index_topk 512, sliding_window 128, compress_ratios 2x0 + 21x4 + 20x128, fp8 weights with "
    "fp4 experts); 284B total / 13B active from the model card")

# DeepSeek-V4-Flash attention FLOPs (modelled, docs/geometry.md): full attention over one
# context token costs 2·n_q·(d_qk + d_v) = 2·64·1024 = 131,072 FLOPs per layer.
_V4_FULL = 2 * 64 * (512 + 512)
# Growing with the context: HCA layers attend ctx/128 entries; CSA layers' indexer scores
# ctx/4 entries with 64 heads of 128 dims (2·64·128 FLOPs each).
_V4_PAIR = 20 * _V4_FULL / 128 + 21 * (2 * 64 * 128) / 4
# Fixed per new token: CSA attends its top-512 entries + the 128-token window; HCA and the
# 2 sliding-window layers attend the 128-token window.
_V4_TOKEN = _V4_FULL * (21 * (512 + 128) + 20 * 128 + 2 * 128)

PRESETS: tuple[ModelSpec, ...] = (
    _gqa("llama-2-7b", 32, 32, 128, _LLAMA2_7B_SRC,
         ("llama2-7b", "llama-2-7b-hf", "llama-2-7b-chat", "llama-2-7b-chat-hf"),
         arch=_counted(_LLAMA2_7B_SRC, layers=32, hidden_size=4096, q_heads=32, kv_heads=32,
                       head_dim=128, vocab_size=32000, intermediate_size=11008)),
    _gqa("llama-3-8b", 32, 8, 128, _LMCACHE_CALC + " for Llama-3.1-8B",
         ("llama-3.1-8b", "llama3-8b", "llama3.1-8b", "meta-llama-3-8b", "meta-llama-3.1-8b",
          "llama-3-8b-instruct", "llama-3.1-8b-instruct", "meta-llama-3.1-8b-instruct"),
         arch=_counted(_LLAMA3_8B_ARCH_SRC, layers=32, hidden_size=4096, q_heads=32, kv_heads=8,
                       head_dim=128, vocab_size=128256, intermediate_size=14336)),
    _gqa("llama-3-70b", 80, 8, 128,
         _LMCACHE_CALC + " for Llama-3.1-70B; 320 KiB/token bf16 matches the Mooncake paper",
         ("llama-3.1-70b", "llama3-70b", "llama3.1-70b", "meta-llama-3-70b", "meta-llama-3.1-70b",
          "llama-3-70b-instruct", "llama-3.1-70b-instruct", "meta-llama-3.1-70b-instruct"),
         arch=_counted(_LLAMA3_70B_ARCH_SRC, layers=80, hidden_size=8192, q_heads=64,
                       kv_heads=8, head_dim=128, vocab_size=128256, intermediate_size=28672)),
    _gqa("qwen2.5-32b", 64, 8, 128,
         "Qwen2.5-32B model card (64 layers, 40 Q / 8 KV heads) as mirrored in "
         "ZHUI/paddlenlp_model_readme; head_dim 128 = 5120 / 40",
         ("qwen2.5-32b-instruct", "qwen-2.5-32b", "qwen25-32b"),
         arch=_counted(_QWEN25_32B_SRC, layers=64, hidden_size=5120, q_heads=40, kv_heads=8,
                       head_dim=128, vocab_size=152064, intermediate_size=27648, qkv_bias=True)),
    _gqa("qwen3-235b-a22b", 94, 4, 128, _LMCACHE_CALC + " for Qwen3-235B-A22B",
         ("qwen3-235b", "qwen-3-235b-a22b", "qwen3-235b-a22b-instruct-2507"),
         arch=_counted(_QWEN3_235B_ARCH_SRC, layers=94, hidden_size=4096, q_heads=64,
                       kv_heads=4, head_dim=128, vocab_size=151936, experts=128,
                       experts_per_token=8, moe_intermediate_size=1536, qk_norm=True)),
    _gqa("qwen3-coder-480b-a35b", 62, 8, 128, _LMCACHE_CALC + " for Qwen3-Coder-480B-A35B",
         ("qwen3-coder-480b", "qwen3-coder-480b-a35b-instruct"),
         arch=_counted(_QWEN3_CODER_ARCH_SRC, layers=62, hidden_size=6144, q_heads=96,
                       kv_heads=8, head_dim=128, vocab_size=151936, experts=160,
                       experts_per_token=8, moe_intermediate_size=2560, qk_norm=True)),
    ModelSpec(
        name="deepseek-v3", attention="mla", layers=61, kv_lora_rank=512, qk_rope_head_dim=64,
        source=_DEEPSEEK_V3_SOURCE,
        components=(ComponentSpec("latent", "latent", 61, elements=_DS_LATENT,
                                  records={"fp8_ds_mla": _DS_MLA_V3_RECORD}),),
        aliases=("deepseek-r1", "deepseek-v3-0324", "deepseek-r1-0528", "deepseek-v3.1",
                 "deepseek-v3-base"),
        notes="fp8 = per-tensor-scaled fp8 latent (576 B/layer); fp8_ds_mla = vLLM's FlashMLA "
              "record (656 B/layer).",
        arch=Architecture(
            hidden_size=7168, q_heads=128, head_dim=128 + 64, v_head_dim=128, vocab_size=129280,
            total_params=671_000_000_000, active_params=37_000_000_000,
            source=_DEEPSEEK_V3_ARCH_SRC, intermediate_size=18432, experts=256,
            experts_per_token=8, shared_experts=1, moe_intermediate_size=2048, moe_layers=58,
            q_lora_rank=1536, weight_dtype="fp8")),
    ModelSpec(
        name="deepseek-v3.2", attention="mla", layers=61, kv_lora_rank=512, qk_rope_head_dim=64,
        source=_DEEPSEEK_V3_SOURCE + "; DSA indexer key 128 fp8 + 4 B scale = 132 B/layer "
               "(recalled, docs/geometry.md)",
        components=(ComponentSpec("latent", "latent", 61, elements=_DS_LATENT,
                                  records={"fp8_ds_mla": _DS_MLA_V3_RECORD}),
                    ComponentSpec("indexer", "indexer", 61, fixed_bytes=_DSA_INDEXER)),
        dtype_aliases={"fp8": "fp8_ds_mla"},
        aliases=("deepseek-v3.2-exp",),
        notes="Sparse FlashMLA stores fp8 KV only as fp8_ds_mla, so fp8 means fp8_ds_mla; the "
              "indexer key is always fp8 and is a separate per-layer cache. The roofline "
              "models its attention as full (DSA's top-k selection is not modelled).",
        arch=Architecture(
            hidden_size=7168, q_heads=128, head_dim=128 + 64, v_head_dim=128, vocab_size=129280,
            total_params=671_000_000_000, active_params=37_000_000_000,
            source=_DEEPSEEK_V3_ARCH_SRC + " (V3.2 keeps V3's sizes)", intermediate_size=18432,
            experts=256, experts_per_token=8, shared_experts=1, moe_intermediate_size=2048,
            moe_layers=58, q_lora_rank=1536, weight_dtype="fp8")),
    ModelSpec(
        name="deepseek-v4-flash", attention="mla", layers=43, default_dtype="fp8",
        source="vLLM PR #56893 (fp8_ds_mla V4 record 584 B, pages rounded up to the 576-B TMA "
               "stride); layer mix 2 SWA + 21 CSA (ratio 4, with indexer) + 20 HCA (ratio 128) "
               "from sglang-jax RFC #1678 / tenstorrent #54945; decomposition of 1,002,240 B per "
               "256-token block is a strong hypothesis (docs/geometry.md)",
        components=(
            ComponentSpec("csa", "latent", 21, records={"fp8_ds_mla": _DS_MLA_V4_RECORD},
                          tokens_per_entry=4, pad_to=_V4_TMA_STRIDE),
            ComponentSpec("csa-indexer", "indexer", 21, fixed_bytes=_DSA_INDEXER,
                          tokens_per_entry=4, pad_to=_V4_TMA_STRIDE),
            ComponentSpec("hca", "latent", 20, records={"fp8_ds_mla": _DS_MLA_V4_RECORD},
                          tokens_per_entry=128, pad_to=_V4_TMA_STRIDE),
        ),
        dtype_aliases={"fp8": "fp8_ds_mla"},
        aliases=("deepseek-v4", "deepseek-v4-flash-fp8"),
        notes="Only the fp8 V4 record is known. The 2 sliding-window layers keep per-sequence "
              "state, not per-block, and are not counted. Each component's page is padded to "
              "576 B, so bytes/token depends on the block size; block tokens must be a multiple "
              "of 128 (one HCA entry per 128 tokens).",
        arch=Architecture(
            hidden_size=4096, q_heads=64, head_dim=512, vocab_size=129280,
            total_params=284_000_000_000, active_params=13_000_000_000,
            source=_DEEPSEEK_V4_ARCH_SRC, experts=256, experts_per_token=6, shared_experts=1,
            moe_intermediate_size=2048, moe_layers=43, q_lora_rank=1024, weight_dtype="fp8",
            expert_weight_dtype="fp4", attn_pair_flops=_V4_PAIR, attn_token_flops=_V4_TOKEN)),
)

#: Preset registry by canonical name.
MODELS: dict[str, ModelSpec] = {m.name: m for m in PRESETS}


def _norm(name: str) -> str:
    s = name.strip().lower()
    if "/" in s:  # Hugging Face id: org/model
        s = s.rsplit("/", 1)[1]
    return re.sub(r"[\s_]+", "-", s)


_BY_NAME: dict[str, ModelSpec] = {}
for _m in PRESETS:
    for _n in (_m.name, *_m.aliases):
        _BY_NAME[_norm(_n)] = _m


def lookup(model: str) -> ModelSpec:
    """The preset called ``model`` (case-insensitive; aliases and ``org/`` prefixes accepted)."""
    spec = _BY_NAME.get(_norm(model))
    if spec is None:
        raise UsageError(f"unknown model {model!r} (known: {', '.join(MODELS)}; or use "
                         f"{param('geometry')} FILE.toml for a custom model)", field="model")
    return spec


def resolve(model: str, *, dtype: str | None = None, block_tokens: int = 256,
            tp: int = 1) -> KVGeometry:
    """Concrete geometry of a preset model at ``dtype`` (default: the preset's)."""
    return lookup(model).geometry(dtype=dtype, block_tokens=block_tokens, tp=tp)
