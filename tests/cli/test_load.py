"""``kvtool load`` through the CLI, on real O_DIRECT files (and a read-only loop device)."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import run, run_json
from tests.helpers.cli import digest as _digest
from tests.helpers.cli import one_error_line as _one_error_line

OBJ = "100000"  # 100,000 B: not a multiple of 512


def test_help_has_an_example() -> None:
    assert "xample" in run("load", "--help").stdout


def test_load_creates_resumes_and_reports(store_dir: Path) -> None:
    path = store_dir / "kv.img"
    doc = run_json("load", str(path), "--create", "64MiB", "--object-bytes", OBJ,
                   "--count", "40", "--qd", "4")
    for key in ("target", "engine", "store", "formatted", "requested", "already_present",
                "written", "objects", "free_slots", "commits", "bytes_written", "seconds",
                "gb_per_s", "objects_per_s", "qd", "io_path"):
        assert key in doc, key
    assert doc["formatted"] and doc["written"] == 40 and doc["io_path"] == "bounce"
    assert doc["store"]["object_bytes"] == 100_000 and doc["store"]["slot_bytes"] == 100_352
    again = run_json("load", str(path), "--object-bytes", OBJ, "--count", "50")
    assert not again["formatted"] and again["already_present"] == 40 and again["written"] == 10
    assert again["store"]["uuid"] == doc["store"]["uuid"]
    human = run("load", str(path), "--object-bytes", OBJ, "--fill", "50%")
    assert human.exit_code == 0 and "resumed" in human.stdout


def test_model_geometry_is_recorded(blank_file: Callable[[int], Path]) -> None:
    path = blank_file(32 << 20)
    doc = run_json("load", str(path), "--model", "deepseek-v4-flash", "--dtype", "fp8",
                   "--count", "5")
    sb = doc["store"]
    assert sb["object_bytes"] == 1_002_240 and sb["slot_bytes"] == 1_002_496
    assert sb["geometry"] == {"model": "deepseek-v4-flash", "dtype": "fp8",
                              "block_tokens": 256, "tp": 1}


def test_ack_file_lists_every_committed_key(store_dir: Path) -> None:
    path, acks = store_dir / "kv.img", store_dir / "acks.jsonl"
    run_json("load", str(path), "--create", "16MiB", "--object-bytes", OBJ, "--count", "23",
             "--batch", "5", "--ack-file", str(acks))
    lines = [json.loads(x) for x in acks.read_text().splitlines()]
    assert [len(x["keys"]) for x in lines] == [5, 5, 5, 5, 3]
    assert lines[-1]["objects"] == 23
    assert sorted(o for x in lines for o in x["ordinals"]) == list(range(23))
    listed = run_json("store", "inspect", str(path), "--objects", "100")["objects"]
    assert {o["key"] for o in listed} == {k for x in lines for k in x["keys"]}


def test_payload_file(store_dir: Path) -> None:
    tensor = store_dir / "kv.npy"
    np.save(tensor, np.random.default_rng(0).standard_normal(30_000).astype(np.float16))
    path = store_dir / "kv.img"
    doc = run_json("load", str(path), "--create", "8MiB", "--object-bytes", OBJ, "--count", "8",
                   "--payload-file", str(tensor))
    assert doc["store"]["payload"]["kind"] == "file"
    assert run_json("verify", str(path), "--payload-file", str(tensor))["ok"]


@pytest.mark.parametrize(("args", "words"), [
    (["--count", "1"], ["--model", "--block-bytes"]),
    (["--object-bytes", OBJ, "--model", "llama-3-8b", "--count", "1"], ["not both"]),
    (["--model", "no-such-model", "--count", "1"], ["unknown model", "--model"]),
    (["--object-bytes", "12 parsecs", "--count", "1"], ["--block-bytes"]),
    (["--object-bytes", OBJ, "--count", "1", "--fill", "10%"], ["--count"]),
    (["--object-bytes", OBJ, "--fill", "180%"], ["--fill"]),
    (["--object-bytes", OBJ, "--count", "0"], ["--count"]),
    (["--object-bytes", OBJ, "--count", "1", "--lba", "1000"], ["--lba"]),
])
def test_bad_options_write_nothing(blank_file: Callable[[int], Path], args: list[str],
                                   words: list[str]) -> None:
    path = blank_file(4 << 20)
    before = _digest(path)
    _one_error_line(run("load", str(path), *args), *words)
    assert _digest(path) == before


def test_missing_target(store_dir: Path) -> None:
    path = store_dir / "nope.img"
    _one_error_line(run("load", str(path), "--object-bytes", OBJ, "--count", "1"),
                    "no such file", "TARGET")
    assert not path.exists()


def test_too_small_for_one_object(blank_file: Callable[[int], Path]) -> None:
    path = blank_file(2 << 20)
    before = _digest(path)
    _one_error_line(run("load", str(path), "--object-bytes", "8MiB", "--count", "1"),
                    "too small")
    assert _digest(path) == before


def test_more_objects_than_fit(blank_file: Callable[[int], Path]) -> None:
    path = blank_file(4 << 20)
    before = _digest(path)
    _one_error_line(run("load", str(path), "--object-bytes", "1MiB", "--count", "9"),
                    "do not fit", "--count")
    assert _digest(path) == before


def test_refuses_foreign_data_unless_forced(blank_file: Callable[[int], Path]) -> None:
    path = blank_file(8 << 20)
    with open(path, "r+b") as f:
        f.seek(300_000)
        f.write(b"precious")
    before = _digest(path)
    _one_error_line(run("load", str(path), "--object-bytes", OBJ, "--count", "3"),
                    "non-zero data", "--force")
    assert _digest(path) == before
    doc = run_json("load", str(path), "--object-bytes", OBJ, "--count", "3", "--force")
    assert doc["written"] == 3 and "non-zero" in doc["replaced"]


@pytest.mark.integration
def test_refuses_a_filesystem(blank_file: Callable[[int], Path]) -> None:
    if shutil.which("mkfs.ext4") is None:
        pytest.skip("mkfs.ext4 (e2fsprogs) is not installed")
    path = blank_file(16 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(path)], check=True, capture_output=True)
    before = _digest(path)
    _one_error_line(run("load", str(path), "--object-bytes", OBJ, "--count", "3"),
                    "ext2/3/4 filesystem")
    assert _digest(path) == before


def test_incompatible_store_needs_force(blank_file: Callable[[int], Path]) -> None:
    path = blank_file(8 << 20)
    first = run_json("load", str(path), "--object-bytes", OBJ, "--count", "3")
    before = _digest(path)
    _one_error_line(run("load", str(path), "--object-bytes", "200000", "--count", "3"),
                    "100000 B", "--force")
    _one_error_line(run("load", str(path), "--object-bytes", OBJ, "--count", "3", "--seed",
                        "9"), "--seed 0")
    assert _digest(path) == before
    doc = run_json("load", str(path), "--object-bytes", "200000", "--count", "3", "--force")
    assert doc["formatted"] and doc["store"]["uuid"] != first["store"]["uuid"]


@pytest.mark.root
@pytest.mark.integration
def test_read_only_device(loop_device: Callable[..., str]) -> None:
    dev = loop_device(8 << 20, 512, read_only=True)
    _one_error_line(run("load", dev, "--object-bytes", OBJ, "--count", "1"), "read-only")


@pytest.mark.root
@pytest.mark.integration
def test_verify_works_on_a_device_made_read_only(loop_device: Callable[..., str]) -> None:
    if shutil.which("blockdev") is None:
        pytest.skip("blockdev (util-linux) is not installed")
    dev = loop_device(16 << 20, 4096)
    run_json("load", dev, "--object-bytes", OBJ, "--count", "5")
    subprocess.run(["blockdev", "--setro", dev], check=True)
    try:
        assert run_json("verify", dev)["ok"]
        _one_error_line(run("load", dev, "--object-bytes", OBJ, "--count", "6"), "read-only")
    finally:
        subprocess.run(["blockdev", "--setrw", dev], check=False)


@pytest.mark.root
@pytest.mark.integration
def test_device_in_exclusive_use_is_refused(loop_device: Callable[..., str]) -> None:
    import os

    dev = loop_device(8 << 20, 512)
    holder = os.open(dev, os.O_RDONLY | os.O_EXCL)  # what a mount or another load holds
    try:
        _one_error_line(run("load", dev, "--object-bytes", OBJ, "--count", "1"), "in use")
    finally:
        os.close(holder)
    assert run_json("load", dev, "--object-bytes", OBJ, "--count", "1")["written"] == 1
