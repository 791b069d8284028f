"""Preset model geometries, each with the source its numbers come from.

Numbers follow docs/geometry.md (copied into
docs/geometry.md so the project does not depend on ../shared at run time).
"""

from __future__ import annotations

import re

from kvtool.errors import UsageError, param
from kvtool.geometry.model import ComponentSpec, KVGeometry, ModelSpec

_LMCACHE_CALC = ("LMCache examples/kv_cache_calculator/modelconfig.json "
                 "(num_hidden_layers, num_key_value_heads, head_dim)")


def _gqa(name: str, layers: int, kv_heads: int, head_dim: int, source: str,
         aliases: tuple[str, ...], notes: str = "") -> ModelSpec:
    """An MHA/GQA model: per layer and token, K and V of ``kv_heads × head_dim`` elements."""
    return ModelSpec(
        name=name, source=source, attention="mha", layers=layers,
        components=(ComponentSpec("kv", "kv", layers, elements=2 * kv_heads * head_dim),),
        kv_heads=kv_heads, head_dim=head_dim, aliases=aliases, notes=notes)


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

PRESETS: tuple[ModelSpec, ...] = (
    _gqa("llama-3-8b", 32, 8, 128, _LMCACHE_CALC + " for Llama-3.1-8B",
         ("llama-3.1-8b", "llama3-8b", "llama3.1-8b", "meta-llama-3-8b", "meta-llama-3.1-8b",
          "llama-3-8b-instruct", "llama-3.1-8b-instruct", "meta-llama-3.1-8b-instruct")),
    _gqa("llama-3-70b", 80, 8, 128,
         _LMCACHE_CALC + " for Llama-3.1-70B; 320 KiB/token bf16 matches the Mooncake paper",
         ("llama-3.1-70b", "llama3-70b", "llama3.1-70b", "meta-llama-3-70b", "meta-llama-3.1-70b",
          "llama-3-70b-instruct", "llama-3.1-70b-instruct", "meta-llama-3.1-70b-instruct")),
    _gqa("qwen2.5-32b", 64, 8, 128,
         "Qwen2.5-32B config.json (64 layers, 8 KV heads, head_dim 128); recalled, not "
         "re-verified (docs/geometry.md)",
         ("qwen2.5-32b-instruct", "qwen-2.5-32b", "qwen25-32b")),
    _gqa("qwen3-235b-a22b", 94, 4, 128, _LMCACHE_CALC + " for Qwen3-235B-A22B",
         ("qwen3-235b", "qwen-3-235b-a22b", "qwen3-235b-a22b-instruct-2507")),
    _gqa("qwen3-coder-480b-a35b", 62, 8, 128, _LMCACHE_CALC + " for Qwen3-Coder-480B-A35B",
         ("qwen3-coder-480b", "qwen3-coder-480b-a35b-instruct")),
    ModelSpec(
        name="deepseek-v3", attention="mla", layers=61, kv_lora_rank=512, qk_rope_head_dim=64,
        source=_DEEPSEEK_V3_SOURCE,
        components=(ComponentSpec("latent", "latent", 61, elements=_DS_LATENT,
                                  records={"fp8_ds_mla": _DS_MLA_V3_RECORD}),),
        aliases=("deepseek-r1", "deepseek-v3-0324", "deepseek-r1-0528", "deepseek-v3.1",
                 "deepseek-v3-base"),
        notes="fp8 = per-tensor-scaled fp8 latent (576 B/layer); fp8_ds_mla = vLLM's FlashMLA "
              "record (656 B/layer)."),
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
              "indexer key is always fp8 and is a separate per-layer cache."),
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
              "of 128 (one HCA entry per 128 tokens)."),
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
