"""``kvtool verify`` through the CLI: sampling, payload files, bad input."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import run, run_json
from tests.helpers.cli import one_error_line as _one_error_line
from tests.store.conftest import flip_byte

OBJ = "100000"


@pytest.fixture
def loaded(blank_file: Callable[[int], Path]) -> Path:
    path = blank_file(16 << 20)
    run_json("load", str(path), "--object-bytes", OBJ, "--count", "60", "--seed", "4")
    return path


def test_help_has_an_example() -> None:
    assert "xample" in run("verify", "--help").stdout


def test_full_verify_schema(loaded: Path) -> None:
    doc = run_json("verify", str(loaded), "--qd", "3")
    for key in ("target", "ok", "store", "engine", "objects_indexed", "objects_checked",
                "content_checked", "sampled", "bytes_checked", "seconds", "gb_per_s",
                "objects_per_s", "qd", "bad", "index"):
        assert key in doc, key
    assert doc["ok"] and doc["objects_checked"] == 60 and doc["bad"] == []
    assert doc["bytes_checked"] == 60 * 100_000


@pytest.mark.parametrize(("sample", "n"), [("7", 7), ("10%", 6), ("1000", 60)])
def test_sample(loaded: Path, sample: str, n: int) -> None:
    doc = run_json("verify", str(loaded), "--sample", sample, "--sample-seed", "1")
    assert doc["objects_checked"] == n and doc["sampled"]


def test_sample_catches_corruption_when_it_reads_the_object(loaded: Path) -> None:
    info = run_json("store", "inspect", str(loaded), "--objects", "60")
    for o in info["objects"]:
        flip_byte(loaded, o["offset"] + 5)  # every object damaged: any sample finds them
    r = run("--json", "verify", str(loaded), "--sample", "5")
    assert r.exit_code == 1
    assert len({b["key"] for b in json.loads(r.stdout)["bad"]}) == 5


def test_checksums_only_skips_content(loaded: Path) -> None:
    doc = run_json("verify", str(loaded), "--checksums-only")
    assert doc["ok"] and doc["content_checked"] == 0


@pytest.mark.parametrize("bad", ["0", "-3", "abc", "0%", "150%"])
def test_bad_sample(loaded: Path, bad: str) -> None:
    _one_error_line(run("verify", str(loaded), "--sample", bad), "--sample")


def test_not_a_store(blank_file: Callable[[int], Path]) -> None:
    _one_error_line(run("verify", str(blank_file(1 << 20))), "not a kvtool store")


@pytest.mark.parametrize("nbytes", [0, 100, 4095])
def test_smaller_than_a_superblock(store_dir: Path, nbytes: int) -> None:
    tiny = store_dir / "tiny.bin"
    tiny.write_bytes(b"x" * nbytes)
    for cmd in (["verify"], ["store", "inspect"]):
        _one_error_line(run(*cmd, str(tiny)), "not a kvtool store")


def test_missing_target(store_dir: Path) -> None:
    _one_error_line(run("verify", str(store_dir / "nope")), "no such file")


def test_payload_file_must_match(store_dir: Path) -> None:
    a, b = store_dir / "a.npy", store_dir / "b.npy"
    np.save(a, np.arange(5000, dtype=np.int32))
    np.save(b, np.arange(5001, dtype=np.int32))
    path = store_dir / "kv.img"
    run_json("load", str(path), "--create", "8MiB", "--object-bytes", OBJ, "--count", "4",
             "--payload-file", str(a))
    _one_error_line(run("verify", str(path)), "--payload-file")
    _one_error_line(run("verify", str(path), "--payload-file", str(b)), "not the file")
    assert run_json("verify", str(path), "--payload-file", str(a))["ok"]
    assert run_json("verify", str(path), "--checksums-only")["ok"]


def test_wrong_content_with_a_matching_checksum_is_caught(loaded: Path) -> None:
    """An object whose bytes and CRC were both rewritten consistently (e.g. a stale or
    misdirected write of another object) passes the checksum but fails the content."""
    from kvtool.store.engine import open_engine
    from kvtool.store.objectstore import ObjectStore

    e = open_engine(str(loaded), write=True)
    try:
        s = ObjectStore.open(e)
        key_a, key_b = sorted(s.by_key)[:2]
        slot_a, slot_b = s.by_key[key_a], s.by_key[key_b]
        # give slot A the entry of key A but the bytes and CRC of object B
        raw = bytearray(s.get(key_b))
        with open(loaded, "r+b") as f:
            f.seek(s.sb.slot_offset(slot_a))
            f.write(raw)
        s.entries["data_crc"][slot_a] = s.entries["data_crc"][slot_b]
        from kvtool.store import layout

        layout.seal(s.entries[slot_a:slot_a + 1])
        s.write_index([slot_a])
        e.flush()
    finally:
        e.close()
    r = run("--json", "verify", str(loaded))
    assert r.exit_code == 1
    bad = json.loads(r.stdout)["bad"]
    assert [(b["check"], b["key"]) for b in bad] == [("content", f"{key_a:#018x}")]


def test_stored_checksum_wrong_but_bytes_right(loaded: Path) -> None:
    """Only the index's CRC is wrong: the checksum check fails, the content check passes."""
    from kvtool.store import layout
    from kvtool.store.engine import open_engine
    from kvtool.store.objectstore import ObjectStore

    e = open_engine(str(loaded), write=True)
    try:
        s = ObjectStore.open(e)
        key = sorted(s.by_key)[3]
        slot = s.by_key[key]
        s.entries["data_crc"][slot] ^= 1
        layout.seal(s.entries[slot:slot + 1])
        s.write_index([slot])
        e.flush()
    finally:
        e.close()
    r = run("--json", "verify", str(loaded))
    assert r.exit_code == 1
    bad = json.loads(r.stdout)["bad"]
    assert [(b["check"], b["key"]) for b in bad] == [("checksum", f"{key:#018x}")]
