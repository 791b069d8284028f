"""``kvtool store inspect``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from tests.conftest import run, run_json
from tests.helpers.cli import one_error_line as _one_error_line
from tests.store.conftest import flip_byte


def test_help_has_an_example() -> None:
    assert "xample" in run("store", "inspect", "--help").stdout
    assert "xample" in run("store", "--help").stdout


def test_inspect(blank_file: Callable[[int], Path]) -> None:
    path = blank_file(16 << 20)
    run_json("load", str(path), "--model", "deepseek-v4-flash", "--dtype", "fp8", "--count", "7")
    doc = run_json("store", "inspect", str(path), "--objects", "3")
    sb, ix = doc["superblock"], doc["index"]
    assert sb["object_bytes"] == 1_002_240 and sb["slot_bytes"] == 1_002_496
    assert sb["index_offset"] == 4096 and sb["data_offset"] == 1 << 20
    assert ix["live"] == 7 and ix["free"] == sb["slot_count"] - 7 and ix["problems"] == 0
    assert [o["slot"] for o in doc["objects"]] == [0, 1, 2]
    assert doc["objects"][1]["offset"] == (1 << 20) + 1_002_496
    human = run("store", "inspect", str(path))
    assert human.exit_code == 0 and "deepseek-v4-flash" in human.stdout
    _one_error_line(run("store", "inspect", str(path), "--objects", "-1"), "--objects")


def test_damaged_superblock_is_shown_and_fails(blank_file: Callable[[int], Path]) -> None:
    path = blank_file(4 << 20)
    run_json("load", str(path), "--object-bytes", "4096", "--count", "2")
    flip_byte(path, 50)
    r = run("store", "inspect", str(path))
    # the message may wrap at the terminal's width: compare words, not lines
    assert r.exit_code == 1 and "checksum mismatch" in " ".join(r.stdout.split())


def test_not_a_store(blank_file: Callable[[int], Path]) -> None:
    _one_error_line(run("store", "inspect", str(blank_file(1 << 20))), "not a kvtool store",
                    "all zeros")
