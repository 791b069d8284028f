"""GPU presets, name resolution, and user GPUs from TOML tables."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtool.configfile import ConfigDocument, read_config
from kvtool.errors import InputError, UsageError
from kvtool.serving.gpus import GPU, GPUS, gpu_from_table, resolve_gpu


def test_required_presets_with_sources() -> None:
    for name in ("a100-sxm", "h100-sxm", "h200-sxm", "h20", "rtx-pro-6000", "ascend-910b"):
        gpu = GPUS[name]
        assert gpu.source and gpu.bf16_tflops > 0 and gpu.memory_bytes > 0
    a100 = GPUS["a100-sxm"]
    assert (a100.bf16_tflops, a100.hbm_gbps, a100.interconnect_gbps) == (312.0, 2039.0, 300.0)
    assert a100.memory_bytes == 80 * 2**30 and a100.fp8_tflops is None
    assert GPUS["h200-sxm"].hbm_gbps == 4800.0 and GPUS["h20"].bf16_tflops == 148.0
    # no NVLink on the RTX PRO 6000: TP all-reduce runs over PCIe
    rtx = GPUS["rtx-pro-6000"]
    assert rtx.interconnect_gbps == rtx.pcie_gbps


def test_every_registered_gpu_has_a_source_and_resolves_by_its_name() -> None:
    for name, gpu in GPUS.items():
        assert gpu.name == name and len(gpu.source) > 20, name
        assert resolve_gpu(name.upper()) is gpu


def test_peak_by_weight_dtype() -> None:
    h100, a100 = GPUS["h100-sxm"], GPUS["a100-sxm"]
    assert h100.peak_tflops("fp8") == 1979.0 and h100.peak_tflops("bf16") == 989.0
    assert a100.peak_tflops("fp8") == 312.0


def test_resolve_is_case_insensitive_and_user_gpus_win() -> None:
    assert resolve_gpu("H100_SXM") is GPUS["h100-sxm"]
    mine = GPU("h100-sxm", 1.0, None, 2**30, 1.0, 1.0, 1.0, "mine")
    assert resolve_gpu("h100-sxm", {"h100-sxm": mine}) is mine
    assert resolve_gpu("rtx-6000d", {"rtx-6000d": mine}) is mine


def test_unknown_gpu_lists_choices() -> None:
    with pytest.raises(UsageError) as err:
        resolve_gpu("b300", {"my-card": GPUS["h20"]})
    assert err.value.field == "gpu"
    for name in ("a100-sxm", "ascend-910b", "my-card"):
        assert name in err.value.message


def _doc(tmp_path: Path, text: str) -> ConfigDocument:
    p = tmp_path / "cluster.toml"
    p.write_text(text)
    return read_config(p)


def test_gpu_from_a_toml_table(tmp_path: Path) -> None:
    doc = _doc(tmp_path, '[gpu.rtx-6000d]\nbase = "rtx-pro-6000"\nmemory_gib = 83.6\n'
                         'bf16_tflops = 300\nsource = "GP7000 report"\n')
    gpu = gpu_from_table(doc.data["gpu"]["rtx-6000d"], (doc, ("gpu", "rtx-6000d")))
    assert gpu.name == "rtx-6000d" and gpu.memory_bytes == int(83.6 * 2**30)
    assert gpu.bf16_tflops == 300.0 and gpu.hbm_gbps == GPUS["rtx-pro-6000"].hbm_gbps
    assert gpu.source == "GP7000 report"


def test_gpu_from_table_without_base_needs_every_figure(tmp_path: Path) -> None:
    doc = _doc(tmp_path, '[gpu.x]\nbf16_tflops = 100\nmemory_gib = 40\nhbm_gbps = 1000\n'
                         'pcie_gbps = 32\n')
    with pytest.raises(InputError) as err:
        gpu_from_table(doc.data["gpu"]["x"], (doc, ("gpu", "x")))
    assert err.value.field == "gpu.x.interconnect_gbps" and err.value.line == 1


@pytest.mark.parametrize(("body", "field", "line"), [
    ('bf16_tflops = 100\nhbm_gbps = -5\n', "gpu.x.hbm_gbps", 4),
    ('hbm_gbps = "fast"\n', "gpu.x.hbm_gbps", 3),
    ('hbm_gbs = 100\n', "gpu.x.hbm_gbs", 3),
    ('memory_gib = 0\n', "gpu.x.memory_gib", 3),
    ('memory_bytes = 1.5\n', "gpu.x.memory_bytes", 3),
    ('base = "b300"\n', "gpu.x.base", 3),
])
def test_gpu_toml_errors_name_the_field_and_line(tmp_path: Path, body: str, field: str,
                                                 line: int) -> None:
    doc = _doc(tmp_path, '[gpu.x]\nbase = "h100-sxm"\n' + body if "base" not in body
               else "[gpu.x]\n\n" + body)
    with pytest.raises(InputError) as err:
        gpu_from_table(doc.data["gpu"]["x"], (doc, ("gpu", "x")))
    assert err.value.field == field and err.value.line == line
    assert err.value.file == str(tmp_path / "cluster.toml")


def test_gpu_from_table_with_a_callable_or_file_name() -> None:
    with pytest.raises(InputError) as err:
        gpu_from_table({"name": "x", "base": "h20", "pcie_gbps": 0}, "c.toml")
    assert (err.value.file, err.value.field) == ("c.toml", "pcie_gbps")
    gpu = gpu_from_table({"name": "y", "base": "h20"},
                         lambda key, msg: InputError(msg, field=key))
    assert gpu.hbm_gbps == GPUS["h20"].hbm_gbps and gpu.name == "y"
