"""Model parameters (kvtool.geometry.params): preset counts against published totals,
MoE bookkeeping, and the weight/attention fields of custom TOML models."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtool.errors import InputError, UsageError
from kvtool.geometry import MODELS, from_toml, lookup, resolve
from kvtool.geometry.params import Architecture, decoder_params, weight_dtype

# Published totals / active parameters (model cards), in billions.
PUBLISHED = {
    "llama-2-7b": (6.74, 6.74), "llama-3-8b": (8.03, 8.03), "llama-3-70b": (70.6, 70.6),
    "qwen2.5-32b": (32.5, 32.5), "qwen3-235b-a22b": (235, 22),
    "qwen3-coder-480b-a35b": (480, 35), "deepseek-v3": (671, 37),
    "deepseek-v4-flash": (284, 13),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_counts_match_the_published_ones(name: str) -> None:
    arch = lookup(name).arch
    assert arch is not None
    total, active = PUBLISHED[name]
    assert arch.total_params / 1e9 == pytest.approx(total, rel=0.01)
    # "A35B"-style names round to whole billions
    assert abs(arch.active_params / 1e9 - active) <= max(0.5, 0.01 * active)


def test_every_preset_has_parameters_with_a_source() -> None:
    for spec in MODELS.values():
        assert spec.arch is not None and spec.arch.source, spec.name


@pytest.mark.parametrize("name", ["qwen3-235b-a22b", "qwen3-coder-480b-a35b", "deepseek-v3",
                                  "deepseek-v4-flash"])
def test_moe_totals_are_consistent_with_the_config(name: str) -> None:
    """What is not a routed expert is used by every token: total − routed ≈ shared."""
    arch = lookup(name).arch
    assert arch is not None and arch.is_moe
    non_routed = arch.total_params - arch.routed_params
    assert non_routed == pytest.approx(arch.shared_params, rel=0.10)


def test_llama_2_7b_kv_geometry() -> None:
    g = resolve("llama-2-7b")
    assert (g.layers, g.kv_heads, g.attention) == (32, 32, "mha")
    assert g.bytes_per_token == 2 * 32 * 32 * 128 * 2 == 524_288
    assert g.block_bytes == 524_288 * 256
    assert resolve("meta-llama/Llama-2-7b-hf").model == "llama-2-7b"


def test_decoder_params_by_hand() -> None:
    # 1 layer, h 8, 2 q heads / 1 kv head of 4, FFN 16, vocab 10, untied
    attn = 2 * 8 * 2 * 4 + 2 * 8 * 1 * 4
    per_layer = attn + 3 * 8 * 16 + 2 * 8
    total, active = decoder_params(layers=1, hidden_size=8, q_heads=2, kv_heads=1, head_dim=4,
                                   vocab_size=10, intermediate_size=16)
    assert total == active == per_layer + 2 * 10 * 8 + 8
    total, active = decoder_params(layers=1, hidden_size=8, q_heads=2, kv_heads=1, head_dim=4,
                                   vocab_size=10, experts=4, experts_per_token=1,
                                   moe_intermediate_size=16)
    assert total - active == 3 * 3 * 8 * 16


def test_expected_experts() -> None:
    arch = lookup("qwen3-coder-480b-a35b").arch
    assert arch is not None
    assert arch.expected_experts(0) == 0 and arch.expected_experts(1) == pytest.approx(8)
    assert arch.expected_experts(2) == pytest.approx(160 * (1 - (152 / 160) ** 2))
    assert 159.9 < arch.expected_experts(10_000) <= 160
    assert arch.weights_touched(1) == pytest.approx(arch.active_params)
    assert lookup("llama-3-8b").arch.weights_touched(7) == 8_030_261_248  # type: ignore[union-attr]


@pytest.mark.parametrize(("kw", "field"), [
    ({"active_params": 20}, "active_params"),
    ({"experts": 4, "experts_per_token": 5, "moe_intermediate_size": 1, "moe_layers": 1},
     "experts_per_token"),
    ({"experts_per_token": 2}, "experts"),
    ({"experts": 4, "experts_per_token": 1, "moe_intermediate_size": 100, "moe_layers": 1},
     "total_params"),
    ({"weight_dtype": "fp7"}, "weight_dtype"),
])
def test_architecture_invariants(kw: dict[str, object], field: str) -> None:
    base: dict[str, object] = {"hidden_size": 8, "q_heads": 2, "head_dim": 4, "vocab_size": 10,
                               "total_params": 10, "active_params": 10, "source": "t"}
    with pytest.raises(UsageError) as err:
        Architecture(**{**base, **kw})  # type: ignore[arg-type]
    assert err.value.field == field


def test_weight_dtype_aliases() -> None:
    assert weight_dtype("BFloat16") == "bf16" and weight_dtype("MXFP4") == "fp4"


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "model.toml"
    p.write_text(text)
    return p


def test_toml_dense_model_counts_its_parameters(tmp_path: Path) -> None:
    p = _write(tmp_path, 'name = "l2"\nlayers = 32\nkv_heads = 32\nhead_dim = 128\n'
                         'hidden_size = 4096\nq_heads = 32\nvocab_size = 32000\n'
                         'intermediate_size = 11008\n')
    spec = from_toml(p)
    assert spec.arch is not None
    assert spec.arch.total_params == spec.arch.active_params == 6_738_415_616
    assert spec.arch.head_dim == 128 and spec.geometry().bytes_per_token == 524_288


def test_toml_moe_model(tmp_path: Path) -> None:
    p = _write(tmp_path, 'name = "m"\nlayers = 62\nkv_heads = 8\nhead_dim = 128\n'
                         'hidden_size = 6144\nq_heads = 96\nvocab_size = 151936\n'
                         'experts = 160\nexperts_per_token = 8\nmoe_intermediate_size = 2560\n'
                         'qk_norm = true\nweight_dtype = "FP8"\n')
    arch, preset = from_toml(p).arch, lookup("qwen3-coder-480b-a35b").arch
    assert arch is not None and preset is not None
    assert (arch.total_params, arch.active_params) == (preset.total_params, preset.active_params)
    assert arch.total_params == 480_154_875_392 and arch.moe_layers == 62
    assert arch.weight_dtype == "fp8"


def test_toml_mla_model_needs_totals_and_nope_dim(tmp_path: Path) -> None:
    head = 'name = "d"\nlayers = 27\nkv_lora_rank = 512\nqk_rope_head_dim = 64\n' \
           'hidden_size = 2048\nq_heads = 16\nvocab_size = 102400\n'
    with pytest.raises(InputError) as err:
        from_toml(_write(tmp_path, head + "total_params = 15700000000\n"))
    assert err.value.field == "qk_nope_head_dim"
    with pytest.raises(InputError) as err:
        from_toml(_write(tmp_path, head + "qk_nope_head_dim = 128\n"))
    assert err.value.field == "total_params"
    arch = from_toml(_write(tmp_path, head + "qk_nope_head_dim = 128\nv_head_dim = 128\n"
                            "total_params = 15700000000\nactive_params = 2400000000\n")).arch
    assert arch is not None and arch.head_dim == 192 and arch.pair_flops(27) == \
        2 * 27 * 16 * (192 + 128)


@pytest.mark.parametrize(("extra", "field", "line"), [
    ("hidden_size = 0\nq_heads = 32\nvocab_size = 32000\nintermediate_size = 1\n",
     "hidden_size", 5),
    ("q_heads = 32\nvocab_size = 32000\ntotal_params = 10\n", "hidden_size", None),
    ("hidden_size = 64\nq_heads = 2\nvocab_size = 9\ntotal_params = 10\nactive_params = 11\n",
     "active_params", 9),
    ("hidden_size = 64\nq_heads = 2\nvocab_size = 9\ntotal_params = 10\nqkv_bias = 1\n",
     "qkv_bias", 9),
    ("hidden_size = 64\nq_heads = 2\nvocab_size = 9\ntotal_params = 10\nweight_dtype = 'x'\n",
     "weight_dtype", 9),
])
def test_toml_parameter_errors_name_the_key(tmp_path: Path, extra: str, field: str,
                                            line: int | None) -> None:
    p = _write(tmp_path, 'name = "x"\nlayers = 4\nkv_heads = 8\nhead_dim = 128\n' + extra)
    with pytest.raises(InputError) as err:
        from_toml(p)
    assert err.value.field == field and err.value.file == str(p)
    if line is not None:
        assert err.value.line == line
