"""``kvtool audit`` through the CLI (CliRunner), including real loop devices."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from kvtool.align.audit import SCHEMA, audit
from kvtool.align.probe import probe_device
from kvtool.geometry import ObjectSize
from tests.conftest import FIXTURES, run, run_json


def _check(doc: dict, lba: int, obj: str | None = None) -> dict:
    found = [c for c in doc["checks"] if c["lba"] == lba and (obj is None or c["object"] == obj)]
    assert len(found) == 1, found
    return found[0]


def test_object_bytes_512_report_example() -> None:
    doc = run_json("audit", "--object-bytes", "1002240", "--lba", "512")
    assert doc["schema"] == SCHEMA and doc["lbas"] == [512]
    c = _check(doc, 512)
    assert (c["residue"], c["padded_bytes"], c["lbas"]) == (256, 1_002_496, 1958)
    assert c["strategy"] == "bounce" and c["ok"] is False
    assert c["bounce"]["copy_back_bytes"] == 1_002_240
    assert doc["ok"] is False


def test_object_bytes_4096_report_example() -> None:
    result = run("audit", "--object-bytes", "1002240", "--lba", "4096", "--json")
    assert result.exit_code == 0
    c = _check(json.loads(result.stdout), 4096)
    assert (c["residue"], c["padded_bytes"], c["lbas"]) == (2816, 1_003_520, 245)


def test_default_lbas_are_512_and_4096() -> None:
    doc = run_json("audit", "--object-bytes", "979KiB")
    assert doc["lbas"] == [512, 4096]
    assert _check(doc, 512)["ok"] and _check(doc, 4096)["residue"] == 979 * 1024 % 4096


def test_model_v4_flash_human_output() -> None:
    result = run("audit", "--model", "deepseek-v4-flash", "--dtype", "fp8", "--lba", "512")
    assert result.exit_code == 0, result.stderr
    out = result.stdout
    for text in ("deepseek-v4-flash", "3,915 B/token", "1,002,240", "256", "1,002,496", "1,958",
                 "bounce", "copy back only"):
        assert text in out, text


def test_model_json_carries_geometry() -> None:
    doc = run_json("audit", "--model", "DeepSeek-V3", "--dtype", "fp8_ds_mla", "--tp", "8")
    g = doc["geometry"]
    assert g["model"] == "deepseek-v3" and g["bytes_per_token"] == 61 * 656
    assert g["per_rank_duplication"] == 8 and g["block_bytes"] == 61 * 656 * 256
    assert all(c["ok"] for c in doc["checks"]) and doc["ok"]


def test_layer_layout_lists_each_component() -> None:
    doc = run_json("audit", "--model", "deepseek-v3.2", "--layout", "layer", "--lba", "4096")
    assert doc["object_layout"] == "layer"
    by_name = {c["object"]: c for c in doc["checks"]}
    # latent 256 × 1152 = 294,912 = 72 × 4096; indexer 256 × 132 = 33,792 ≡ 1024
    assert by_name["layer:latent"]["ok"] and by_name["layer:latent"]["count"] == 61
    assert by_name["layer:indexer"]["residue"] == 1024


def test_strict_exits_1_when_padding_is_needed() -> None:
    result = run("audit", "--object-bytes", "1002240", "--strict", "--json")
    assert result.exit_code == 1
    assert json.loads(result.stdout)["ok"] is False
    assert "audit failed" in result.stderr
    assert run("audit", "--model", "llama-3-70b", "--strict").exit_code == 0


def test_layout_rule_names_first_misaligned_extent() -> None:
    doc = run_json("audit", "--object-bytes", "4096", "--lba", "4096",
                   "--layout", "packed:offset=512,count=100")
    lay = doc["layouts"][0]
    assert lay["misaligned"] == 100 and lay["first_misaligned"]["index"] == 0
    assert lay["first_misaligned"]["problems"] == ["offset"]
    result = run("audit", "--object-bytes", "4096", "--lba", "4096", "--layout",
                 "packed:offset=512,count=100", "--strict")
    assert result.exit_code == 1 and "extent 0" in result.stdout
    assert "[object]" in result.stdout  # names printed literally, not eaten as rich markup


def test_layout_extents_file(tmp_path: Path) -> None:
    p = tmp_path / "extents.csv"
    p.write_text("offset,length,buffer\n0,1002496,0x7f0000000000\n1002496,1002496,0x7f0000100200\n")
    doc = run_json("audit", "--layout", str(p), "--lba", "512", "--mem-align", "4096")
    lay = doc["layouts"][0]
    assert lay["first_misaligned"]["index"] == 1
    assert lay["first_misaligned"]["problems"] == ["buffer"]


def test_geometry_toml() -> None:
    doc = run_json("audit", "--geometry", str(FIXTURES / "models" / "custom-records.toml"),
                   "--lba", "512")
    assert doc["geometry"]["block_bytes"] == 1_002_240 and _check(doc, 512)["residue"] == 256


def test_custom_flags() -> None:
    doc = run_json("audit", "--layers", "32", "--kv-heads", "8", "--head-dim", "128",
                   "--dtype", "fp8", "--lba", "4096")
    assert doc["geometry"]["block_bytes"] == 2 * 32 * 8 * 128 * 256


@pytest.mark.parametrize(("args", "field"), [
    (["--model", "gpt-17"], "--model"),
    (["--object-bytes", "1002240", "--lba", "0"], "--lba"),
    (["--object-bytes", "1002240", "--lba", "1000"], "--lba"),
    (["--object-bytes", "-5"], "--block-bytes"),
    (["--object-bytes", "0"], "--block-bytes"),
    (["--object-bytes", "12 parsecs"], "--block-bytes"),
    (["--object-bytes", "1.5"], "--block-bytes"),
    (["--model", "llama-3-8b", "--lba", "4kb"], "--lba"),
    (["--model", "llama-3-8b", "--dtype", "int3"], "--dtype"),
    (["--model", "llama-3-8b", "--tp", "3"], "--tp"),
    (["--model", "deepseek-v4-flash", "--block-tokens", "100"], "--block-tokens"),
    (["--device", "/nonexistent/nvme0n1"], "--device"),
    (["--model", "llama-3-8b", "--object-bytes", "4096"], "--block-bytes"),
    (["--object-bytes", "4096", "--layout", "packed:count=zero"], "--layout"),
    (["--object-bytes", "4096", "--layout", "layer"], "--layout"),
    (["--object-bytes", "4096", "--layout", "/nonexistent/extents.csv"], "--layout"),
    ([], "--model"),
    (["--model", "llama-3-8b", "--layers", "4"], "--layers"),
    (["--object-bytes", "4096", "--dtype", "fp8"], "--block-bytes"),
    (["--tp", "2"], "--tp"),
    (["--kv-heads", "8", "--head-dim", "128"], "--layers"),
    (["--layers", "4", "--kv-heads", "8", "--head-dim", "128", "--rope-dim", "64"],
     "--kv-lora-rank"),
])
def test_bad_input_one_line_exit_2(args: list[str], field: str) -> None:
    result = run("audit", *args)
    assert result.exit_code == 2, (args, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr and "internal error" not in result.stderr
    assert f"'{field}'" in lines[0], lines[0]
    assert result.stdout == ""


def test_bad_toml_names_file_and_line(tmp_path: Path) -> None:
    p = tmp_path / "m.toml"
    p.write_text('name = "m"\nlayers = 4\nkv_heads = 8\nhead_dimm = 64\n')
    result = run("audit", "--geometry", str(p))
    assert result.exit_code == 2
    line = result.stderr.strip()
    assert line.startswith(f"kvtool: error: {p}:4: field 'head_dimm': unknown key 'head_dimm' "
                           "(allowed here: active_params, aliases, attention, "), line
    assert line.endswith(", vocab_size, weight_dtype)") and "\n" not in line


def test_regular_file_device(tmp_path: Path) -> None:
    img = tmp_path / "ns.img"
    img.write_bytes(b"\0" * (8 << 20))
    doc = run_json("audit", "--object-bytes", "1002240", "--device", str(img))
    dev = doc["device"]
    assert dev["kind"] == "file" and dev["size_bytes"] == 8 << 20
    c = doc["checks"][0]
    assert c["lba"] == dev["dio_offset_align"] and c["lba_source"] == "device"
    assert c["objects_fit"] == (8 << 20) // c["padded_bytes"]


@pytest.mark.root
@pytest.mark.integration
@pytest.mark.parametrize(("sector", "residue", "padded", "n_lbas"),
                         [(512, 256, 1_002_496, 1958), (4096, 2816, 1_003_520, 245)])
def test_loop_device_audit(loop_device: Callable[..., str], sector: int, residue: int, padded: int,
                           n_lbas: int) -> None:
    dev = loop_device(64 << 20, sector)
    doc = run_json("audit", "--model", "deepseek-v4-flash", "--device", dev,
                   "--layout", "packed:offset=0,count=64,stride=1003520")
    assert doc["device"]["logical_block_size"] == sector
    assert doc["lbas"] == [sector]
    c = doc["checks"][0]
    assert (c["residue"], c["padded_bytes"], c["lbas"]) == (residue, padded, n_lbas)
    assert c["objects_fit"] == (64 << 20) // padded
    lay = doc["layouts"][0]
    assert lay["first_misaligned"]["problems"] == ["length"]
    # library path gives the same answer
    rep = audit([ObjectSize("block", 1_002_240, 1)], device=probe_device(dev))
    assert rep.checks[0].plan.residue == residue
    human = run("audit", "--model", "deepseek-v4-flash", "--device", dev)
    assert human.exit_code == 0 and f"{sector} B" in human.stdout and dev in human.stdout
