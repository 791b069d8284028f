"""Every preset against sizes computed by hand here (docs/geometry.md).

The arithmetic is written out in each case — not taken from the code under test.
"""

from __future__ import annotations

import pytest

from kvtool.errors import UsageError
from kvtool.geometry import MODELS, resolve

B = 256  # tokens per block

# (model, dtype, bytes/token written out, whole-block bytes written out)
GQA_CASES = [
    # b = 2 (K and V) · L · H_kv · d_head · bytes(dtype)
    ("llama-3-8b", "bf16", 2 * 32 * 8 * 128 * 2, 33_554_432),
    ("llama-3-8b", "fp8", 2 * 32 * 8 * 128 * 1, 16_777_216),
    ("llama-3-8b", "fp32", 2 * 32 * 8 * 128 * 4, 67_108_864),
    ("llama-3-70b", "bf16", 2 * 80 * 8 * 128 * 2, 83_886_080),
    ("llama-3-70b", "fp16", 2 * 80 * 8 * 128 * 2, 83_886_080),
    ("llama-3-70b", "fp8", 2 * 80 * 8 * 128 * 1, 41_943_040),
    ("qwen2.5-32b", "bf16", 2 * 64 * 8 * 128 * 2, 67_108_864),
    ("qwen2.5-32b", "fp8", 2 * 64 * 8 * 128 * 1, 33_554_432),
    ("qwen3-235b-a22b", "bf16", 2 * 94 * 4 * 128 * 2, 49_283_072),
    ("qwen3-235b-a22b", "fp8", 2 * 94 * 4 * 128 * 1, 24_641_536),
    ("qwen3-coder-480b-a35b", "bf16", 2 * 62 * 8 * 128 * 2, 65_011_712),
    ("qwen3-coder-480b-a35b", "fp8", 2 * 62 * 8 * 128 * 1, 32_505_856),
]


@pytest.mark.parametrize(("model", "dtype", "per_token", "block"), GQA_CASES)
def test_gqa_presets(model: str, dtype: str, per_token: int, block: int) -> None:
    g = resolve(model, dtype=dtype, block_tokens=B)
    assert g.bytes_per_token == per_token
    assert g.block_bytes == g.copy_block_bytes == per_token * B == block
    assert g.block_bytes % 4096 == 0  # docs/geometry.md: every MHA model is 4 KiB-aligned at 256 tokens
    # per-layer object: one layer's K and V for the block
    layers = {"llama-3-8b": 32, "llama-3-70b": 80, "qwen2.5-32b": 64, "qwen3-235b-a22b": 94,
              "qwen3-coder-480b-a35b": 62}[model]
    assert g.object_bytes("layer") == (block // layers,) * layers


def test_table_per_layer_figures() -> None:
    assert resolve("llama-3-8b").object_bytes("layer")[0] == 1_048_576
    assert resolve("qwen3-235b-a22b", dtype="fp8").object_bytes("layer")[0] == 262_144
    assert resolve("llama-3-70b").bytes_per_token == 320 * 1024  # Mooncake paper: 320 KiB


MLA_CASES = [
    # DeepSeek-V3/R1: 61 layers × (512 latent + 64 rope) elements
    ("deepseek-v3", "bf16", 61 * 576 * 2, 1152),
    ("deepseek-r1", "bf16", 61 * 576 * 2, 1152),
    ("deepseek-v3", "fp8", 61 * 576 * 1, 576),
    # vLLM fp8_ds_mla: 512 fp8 + 4 fp32 scales + 64 bf16 rope = 656 B per layer
    ("deepseek-v3", "fp8_ds_mla", 61 * (512 + 4 * 4 + 64 * 2), 656),
    # V3.2: + indexer 128 fp8 + 4-B scale = 132 B per layer; fp8 means fp8_ds_mla
    ("deepseek-v3.2", "fp8", 61 * (656 + 132), 788),
    ("deepseek-v3.2", "fp8_ds_mla", 61 * (656 + 132), 788),
    ("deepseek-v3.2", "bf16", 61 * (1152 + 132), 1284),
]


@pytest.mark.parametrize(("model", "dtype", "per_token", "per_layer_token"), MLA_CASES)
def test_mla_presets(model: str, dtype: str, per_token: int, per_layer_token: int) -> None:
    g = resolve(model, dtype=dtype)
    assert g.bytes_per_token == per_token == 61 * per_layer_token
    assert g.block_bytes == per_token * B
    assert sum(g.object_bytes("layer")) == g.block_bytes


def test_mla_table_block_figures() -> None:
    assert resolve("deepseek-v3", dtype="bf16").block_bytes == 17_989_632
    assert resolve("deepseek-v3", dtype="fp8").block_bytes == 8_994_816
    assert resolve("deepseek-v3", dtype="fp8_ds_mla").block_bytes == 10_244_096
    g = resolve("deepseek-v3.2", dtype="fp8")
    assert g.block_bytes == 12_305_408 and g.block_bytes % 4096 == 1024
    assert resolve("deepseek-v3.2", dtype="bf16").block_bytes == 20_050_944
    # the indexer is its own per-layer cache: 256 × 132 = 33,792 B ≡ 1024 (mod 4096)
    assert sorted(set(g.object_bytes("layer"))) == [256 * 132, 256 * 656]


def test_deepseek_v4_flash_fp8() -> None:
    g = resolve("deepseek-v4-flash", dtype="fp8")
    # per CSA layer: 256/4 = 64 entries × 584 B = 37,376 → 576·65 = 37,440
    csa = -(-64 * 584 // 576) * 576
    # its indexer: 64 × 132 = 8,448 → 576·15 = 8,640
    idx = -(-64 * 132 // 576) * 576
    # per HCA layer: 256/128 = 2 entries × 584 = 1,168 → 576·3 = 1,728
    hca = -(-2 * 584 // 576) * 576
    assert (csa, idx, hca) == (37_440, 8_640, 1_728)
    assert g.block_bytes == 21 * (csa + idx) + 20 * hca == 1_002_240 == 576 * 1740
    assert g.bytes_per_token == 3915
    assert g.block_bytes % 512 == 256 and g.block_bytes % 4096 == 2816
    assert g.unpadded_block_bytes == 21 * (64 * 584 + 64 * 132) + 20 * 2 * 584 == 985_664
    assert g.layers == 43
    assert g.object_bytes("layer") == (csa,) * 21 + (idx,) * 21 + (hca,) * 20


def test_deepseek_v4_flash_scales_with_block_tokens() -> None:
    # 512 tokens: CSA 128 × 584 = 74,752 → 576·130 = 74,880; idx 128 × 132 = 16,896 →
    # 576·30 = 17,280; HCA 4 × 584 = 2,336 → 576·5 = 2,880
    g = resolve("deepseek-v4-flash", block_tokens=512)
    assert g.block_bytes == 21 * (74_880 + 17_280) + 20 * 2_880
    assert g.bytes_per_token == pytest.approx((21 * (74_880 + 17_280) + 20 * 2_880) / 512)
    # 128 tokens: CSA 32 × 584 = 18,688 → 576·33 = 19,008; idx 32 × 132 = 4,224 → 576·8;
    # HCA 1 × 584 → 576·2 = 1,152.  Padding makes bytes/token block-size dependent.
    g = resolve("deepseek-v4-flash", block_tokens=128)
    assert g.block_bytes == 21 * (19_008 + 4_608) + 20 * 1_152 == 518_976
    assert g.bytes_per_token == 4054.5
    with pytest.raises(UsageError) as err:
        resolve("deepseek-v4-flash", block_tokens=64)
    assert err.value.field == "block_tokens" and "128" in str(err.value)


def test_v4_rejects_dtypes_it_has_no_layout_for() -> None:
    with pytest.raises(UsageError) as err:
        resolve("deepseek-v4-flash", dtype="bf16")
    assert err.value.field == "dtype" and "fp8" in str(err.value)


def test_tp_sharding_and_replication() -> None:
    # Llama-3-70B has 8 KV heads: TP 4 → 2 heads per rank, no duplication
    g = resolve("llama-3-70b", tp=4)
    assert g.block_bytes == 83_886_080 // 4 and g.per_rank_duplication == 1
    assert g.copy_block_bytes == 83_886_080
    # TP 16 > 8 heads: one head per rank, each head on 2 ranks
    g = resolve("llama-3-70b", tp=16)
    assert g.block_bytes == 83_886_080 // 8 and g.per_rank_duplication == 2
    assert g.all_ranks_block_bytes == 2 * 83_886_080
    # Qwen3-235B has 4 KV heads: TP 8 replicates each head twice
    g = resolve("qwen3-235b-a22b", tp=8)
    assert g.block_bytes == 49_283_072 // 4 and g.per_rank_duplication == 2
    # MLA: every rank holds the full copy
    g = resolve("deepseek-v3", tp=8)
    assert g.block_bytes == 17_989_632 and g.per_rank_duplication == 8
    assert g.bytes_per_token == 70_272  # per stored copy, independent of TP
    with pytest.raises(UsageError) as err:
        resolve("llama-3-70b", tp=3)
    assert err.value.field == "tp"


def test_names_are_case_insensitive_with_aliases() -> None:
    for alias, name in [("DeepSeek-V4-Flash", "deepseek-v4-flash"), ("LLAMA-3-70B", "llama-3-70b"),
                        ("meta-llama/Llama-3.1-8B-Instruct", "llama-3-8b"),
                        ("Qwen/Qwen2.5-32B-Instruct", "qwen2.5-32b"), ("deepseek-r1", "deepseek-v3"),
                        ("deepseek-ai/DeepSeek-V3.2-Exp", "deepseek-v3.2"),
                        ("qwen3-coder-480b-a35b", "qwen3-coder-480b-a35b"),
                        ("Qwen3-235B-A22B", "qwen3-235b-a22b")]:
        assert resolve(alias).model == name


def test_unknown_model_lists_known_names() -> None:
    with pytest.raises(UsageError) as err:
        resolve("gpt-17")
    assert err.value.field == "model"
    for name in MODELS:
        assert name in str(err.value)


@pytest.mark.parametrize(("kw", "field"), [({"dtype": "int3"}, "dtype"),
                                           ({"block_tokens": 0}, "block_tokens"),
                                           ({"tp": 0}, "tp")])
def test_bad_values_name_the_option(kw: dict[str, object], field: str) -> None:
    with pytest.raises(UsageError) as err:
        resolve("llama-3-8b", **kw)  # type: ignore[arg-type]
    assert err.value.field == field


def test_every_preset_has_a_source_and_resolves_all_its_dtypes() -> None:
    for name, spec in MODELS.items():
        assert spec.source and len(spec.source) > 20, name
        assert spec.supported_dtypes(), name
        for dtype in spec.supported_dtypes():
            g = resolve(name, dtype=dtype)
            assert g.block_bytes == sum(g.object_bytes("layer")) > 0
            assert g.copy_block_bytes == g.block_bytes * g.shards


def test_default_dtypes() -> None:
    assert resolve("llama-3-8b").dtype == "bf16"
    assert resolve("deepseek-v4-flash").dtype == "fp8"
    assert resolve("llama-3-8b", dtype="BFloat16").dtype == "bf16"
