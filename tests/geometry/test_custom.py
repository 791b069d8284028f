"""Custom geometry from explicit numbers and from TOML files."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtool.errors import InputError, UsageError
from kvtool.geometry import custom, from_toml
from tests.conftest import FIXTURES

MODELS = FIXTURES / "models"


def test_custom_gqa_from_numbers() -> None:
    g = custom(layers=32, kv_heads=8, head_dim=128, dtype="fp16").geometry(tp=2)
    assert g.copy_block_bytes == 2 * 32 * 8 * 128 * 2 * 256
    assert g.block_bytes == g.copy_block_bytes // 2
    assert g.per_rank_duplication == 1


def test_custom_dtype_bytes() -> None:
    spec = custom(layers=10, kv_heads=2, head_dim=64, dtype_bytes=4)
    assert spec.geometry().bytes_per_token == 2 * 10 * 2 * 64 * 4


def test_custom_mla_from_numbers() -> None:
    g = custom(layers=27, kv_lora_rank=512, qk_rope_head_dim=64).geometry(dtype="fp8", tp=4)
    assert g.bytes_per_token == 27 * 576
    assert g.block_bytes == 27 * 576 * 256 and g.per_rank_duplication == 4


@pytest.mark.parametrize(("kw", "field"), [
    ({"layers": 0, "kv_heads": 8, "head_dim": 128}, "layers"),
    ({"layers": 4, "kv_heads": 8}, "head_dim"),
    ({"layers": 4}, "kv_heads"),
    ({"layers": 4, "kv_heads": 8, "head_dim": 128, "kv_lora_rank": 512}, "kv_lora_rank"),
    ({"layers": 4, "kv_heads": 8, "head_dim": 128, "dtype_bytes": 3}, "dtype_bytes"),
])
def test_custom_errors_name_the_parameter(kw: dict[str, int], field: str) -> None:
    with pytest.raises(UsageError) as err:
        custom(**kw)  # type: ignore[arg-type]
    assert err.value.field == field


def test_toml_gqa_fixture() -> None:
    spec = from_toml(MODELS / "custom-gqa.toml")
    assert spec.name == "my-gqa-7b" and "Mistral" in spec.source
    assert spec.geometry().block_bytes == 2 * 32 * 8 * 128 * 2 * 256


def test_toml_mla_fixture() -> None:
    g = from_toml(MODELS / "custom-mla.toml").geometry(tp=8)
    assert g.bytes_per_token == 27 * (512 + 64) * 2 and g.per_rank_duplication == 8


def test_toml_records_reproduce_v4_flash() -> None:
    g = from_toml(MODELS / "custom-records.toml").geometry()
    assert g.block_bytes == 1_002_240
    assert g.object_bytes("layer")[:1] == (37_440,)


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "model.toml"
    p.write_text(text)
    return p


def test_toml_typo_names_file_line_and_key(tmp_path: Path) -> None:
    p = _write(tmp_path, 'name = "x"\nlayers = 4\nkv_heads = 8\nhead_dims = 128\n')
    with pytest.raises(InputError) as err:
        from_toml(p)
    assert (err.value.file, err.value.line, err.value.field) == (str(p), 4, "head_dims")


def test_toml_bad_value_names_line(tmp_path: Path) -> None:
    p = _write(tmp_path, 'name = "x"\nlayers = -4\nkv_heads = 8\nhead_dim = 128\n')
    with pytest.raises(InputError) as err:
        from_toml(p)
    assert (err.value.line, err.value.field) == (2, "layers")


def test_toml_missing_head_dim(tmp_path: Path) -> None:
    p = _write(tmp_path, 'name = "x"\nlayers = 4\nkv_heads = 8\n')
    with pytest.raises(InputError) as err:
        from_toml(p)
    assert err.value.field == "head_dim" and err.value.file == str(p)


def test_toml_syntax_error_has_line(tmp_path: Path) -> None:
    p = _write(tmp_path, 'name = "x"\nlayers = = 4\n')
    with pytest.raises(InputError) as err:
        from_toml(p)
    assert err.value.line == 2


def test_toml_missing_file(tmp_path: Path) -> None:
    with pytest.raises(InputError) as err:
        from_toml(tmp_path / "absent.toml")
    assert err.value.file == str(tmp_path / "absent.toml") and "no such file" in str(err.value)


def test_toml_bad_component(tmp_path: Path) -> None:
    p = _write(tmp_path, 'name = "x"\nlayers = 4\n[[components]]\nlayers = 4\nentry_byte = 10\n')
    with pytest.raises(InputError) as err:
        from_toml(p)
    assert err.value.field == "components[0].entry_byte" and err.value.line == 5


def test_toml_errors_name_the_line_inside_its_table(tmp_path: Path) -> None:
    """The same key at the top and in a [[components]] table: the error names the right one."""
    p = _write(tmp_path, 'name = "x"\nlayers = 4\n[[components]]\nlayers = 2\nentry_bytes = 10\n'
                         '[[components]]\nlayers = 0\nentry_bytes = 10\n')
    with pytest.raises(InputError) as err:
        from_toml(p)
    assert (err.value.field, err.value.line) == ("components[1].layers", 7)
