"""``kvtool bench``: the result schema and its guards (never timing assertions)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

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


def test_a_rerun_needs_no_force_and_load_names_what_bench_left(
        blank_file: Callable[[int], Path]) -> None:
    path = str(blank_file(16 << 20))
    args = ("bench", path, "--object-bytes", "100000", "--ops", "3", "--qd", "1",
            "--pattern", "seq-write", "--repeat", "1")
    assert run_json(*args)["wrote"] is True
    again = run(*args)  # the target holds only what bench wrote: no --force
    assert again.exit_code == 0, again.stderr
    _one_error_line(run("load", path, "--object-bytes", "100000", "--count", "2"),
                    "kvtool bench data", "--force")


def test_runs_spread_and_verdicts(blank_file: Callable[[int], Path]) -> None:
    path = str(blank_file(16 << 20))
    base = ("bench", path, "--object-bytes", "1MiB", "--ops", "4", "--qd", "1",
            "--pattern", "rand-read", "--read-only")
    doc = run_json(*base, "--repeat", "3", "--need", "0.000001")
    row = doc["results"][0]
    assert doc["repeat"] == 3 and row["runs"] == 3 and len(row["iops_runs"]) == 3
    lo, hi = row["iops_range"]
    assert lo <= row["iops"] <= hi and sorted(row["iops_runs"])[1] == row["iops"]
    assert [v["verdict"] for v in doc["verdicts"]] == ["meets"]
    short = run(*base, "--repeat", "2", "--need", "1000000")
    assert short.exit_code == 1 and "rand-read falls short of 1e+06 GB/s" in short.stdout
    one = run_json(*base, "--repeat", "1", "--path", "aligned")
    assert one["results"][0]["runs"] == 1 and one["verdicts"] is None


def test_ctrl_c_prints_the_runs_done(blank_file: Callable[[int], Path],
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from kvtool.store import bench as lib

    real, calls = lib.run_case, []

    def interrupted_on_the_third(*a: Any, **kw: Any) -> dict[str, Any]:
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(lib, "run_case", interrupted_on_the_third)
    path = str(blank_file(16 << 20))
    r = run("bench", path, "--object-bytes", "1MiB", "--ops", "2", "--qd", "1,2",
            "--read-only", "--repeat", "1")
    assert r.exit_code == 130
    assert "interrupted" in r.stdout and "seq-read" in r.stdout
    assert "rand-read" not in r.stdout  # never reached
