"""``kvtool bench``: the result schema and its guards (never timing assertions)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from tests.conftest import run, run_json
from tests.helpers.cli import digest as _digest
from tests.helpers.cli import one_error_line as _one_error_line


def test_help_has_an_example() -> None:
    assert "xample" in run("bench", "--help").stdout


def test_bench_sweep_schema(blank_file: Callable[[int], Path]) -> None:
    path = blank_file(32 << 20)
    doc = run_json("bench", str(path), "--object-bytes", "1002240", "--qd", "1,2",
                   "--ops", "12", "--seconds", "5", "--region", "16MiB")
    rows = doc["results"]
    assert len(rows) == 4 * 2 * 2
    assert [r["pattern"] for r in rows[:4]] == ["seq-write"] * 4  # writes first
    for r in rows:
        assert r["ops"] == 12
        assert r["path"] in ("aligned", "bounce")
        assert r["object_bytes"] == (1_002_240 if r["path"] == "bounce" else 1_002_496)
        assert r["padded_bytes"] == 1_002_496
        assert r["gb_per_s"] > 0 and r["iops"] > 0
        assert 0 < r["lat_us"]["p50"] <= r["lat_us"]["p99"] <= r["lat_us"]["p99_9"]
    assert {(b["pattern"], b["qd"]) for b in doc["bounce_cost"]} == {
        (p, q) for p in ("seq-write", "rand-write", "seq-read", "rand-read") for q in (1, 2)}
    human = run("bench", str(path), "--object-bytes", "1MiB", "--qd", "2", "--ops", "4",
                "--pattern", "rand-read", "--force")
    assert human.exit_code == 0 and "rand-read" in human.stdout


def test_writes_refuse_a_store_and_read_only_writes_nothing(
        blank_file: Callable[[int], Path]) -> None:
    path = blank_file(16 << 20)
    run_json("load", str(path), "--object-bytes", "100000", "--count", "10")
    before = _digest(path)
    _one_error_line(run("bench", str(path), "--object-bytes", "100000", "--ops", "2"),
                    "kvtool store", "--force")
    doc = run_json("bench", str(path), "--object-bytes", "100000", "--ops", "3", "--qd", "2",
                   "--read-only")
    assert {r["pattern"] for r in doc["results"]} == {"seq-read", "rand-read"}
    assert _digest(path) == before
    assert run_json("verify", str(path))["ok"]


def test_bad_options(blank_file: Callable[[int], Path]) -> None:
    path = str(blank_file(8 << 20))
    _one_error_line(run("bench", path, "--object-bytes", "1MiB", "--path", "bounce"),
                    "no bounce path")
    _one_error_line(run("bench", path, "--object-bytes", "1MiB", "--qd", "0"), "--qd")
    _one_error_line(run("bench", path, "--object-bytes", "1MiB", "--pattern", "zigzag"),
                    "--pattern")
    _one_error_line(run("bench", path, "--object-bytes", "1MiB", "--region", "4KiB"),
                    "--region")
    for seconds in ("0", "nan", "inf"):
        _one_error_line(run("bench", path, "--object-bytes", "1MiB", "--seconds", seconds),
                        "--seconds")
