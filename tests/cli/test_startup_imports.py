"""What short commands import (bench/startup.py, bench/replay_speed.py time them).

Start-up is mostly imports: each command must load only what it uses. These tests run the
real CLI in a fresh interpreter and read ``sys.modules`` when it exits; they assert on
modules, never on time (the time is measured in bench/, BENCHMARKS.md "Start-up").
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# Runs kvtool's entry point, then writes the imported module names to the file named
# by the first argument (at exit, so a command that exits with SystemExit still reports).
PROBE = """
import atexit, json, sys
out = sys.argv[1]
atexit.register(lambda: open(out, "w").write(json.dumps(sorted(sys.modules))))
sys.argv = ["kvtool", *sys.argv[2:]]
from kvtool.cli.main import main
main()
"""


def imported(tmp_path: Path, *args: str) -> set[str]:
    """Modules loaded by ``kvtool ARGS`` (which must succeed), in a fresh interpreter."""
    out = tmp_path / "modules.json"
    proc = subprocess.run([sys.executable, "-c", PROBE, str(out), *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return set(json.loads(out.read_text()))


def loaded(modules: set[str], *packages: str) -> list[str]:
    """The ``packages`` (or their sub-modules) among ``modules``."""
    return sorted(p for p in packages if any(m == p or m.startswith(p + ".") for m in modules))


# Never needed by a metadata-only replay: the data path (numpy, the store, the NVMe host,
# the data tiers), rich (--json prints no tables), modules of options not given (--tiers
# TOML, --csv, token hashing, the nvme logger) and the serving model's timing run.
NOT_FOR_SIMULATE = ("numpy", "rich", "kvtool.store", "kvtool.nvme", "kvtool.tiers.base",
                    "kvtool.replay.data", "kvtool.serving.sim", "tomllib", "csv", "hashlib",
                    "logging", "subprocess")


def test_replay_simulate_imports_only_the_replayer(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps({"timestamp": 0, "input_length": 1024, "output_length": 8,
                                 "hash_ids": [1, 2]}) + "\n")
    mods = imported(tmp_path, "--json", "replay", "--simulate", str(trace), "--format",
                    "mooncake", "--dram", "10blk", "--no-times")
    assert "kvtool.cache.replayer" in mods  # the probe saw the replay itself
    assert loaded(mods, *NOT_FOR_SIMULATE) == []


def test_replay_simulate_with_the_serving_model_of_a_short_trace_imports_no_numpy(
        tmp_path: Path) -> None:
    """The default ``--simulate`` runs the serving model for the report's times; its
    statistics come without numpy for samples this small (kvtool.serving.report)."""
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps({"timestamp": 0, "input_length": 3072, "output_length": 256,
                                 "hash_ids": list(range(6))}) + "\n")
    mods = imported(tmp_path, "--json", "replay", "--simulate", str(trace), "--format",
                    "mooncake", "--dram", "10blk")
    assert "kvtool.serving.sim" in mods  # the probe saw the serving model run
    assert loaded(mods, "numpy", "rich", "kvtool.store", "kvtool.nvme") == []


def test_version_imports_no_command(tmp_path: Path) -> None:
    mods = imported(tmp_path, "--version")
    assert loaded(mods, "numpy", "rich", "msgspec", "kvtool.cache", "kvtool.store",
                  "kvtool.trace", "kvtool.replay") == []


def test_help_imports_no_command(tmp_path: Path) -> None:
    """``kvtool --help`` lists every command without loading one (kvtool.cli.main.COMMANDS)."""
    from kvtool.cli.main import COMMANDS

    mods = imported(tmp_path, "--help")
    assert loaded(mods, "numpy", "rich", "msgspec", *(f"kvtool.cli.{c}" for c in COMMANDS)) == []


@pytest.mark.parametrize("json_output", [True, False], ids=["json", "human"])
def test_load_imports_the_store_not_the_replay(store_dir: Path, tmp_path: Path,
                                                json_output: bool) -> None:
    store = store_dir / "one.img"
    with open(store, "wb") as f:
        f.truncate(4 << 20)
    args = ["load", str(store), "--object-bytes", "4096", "--count", "1"]
    mods = imported(tmp_path, *(["--json", *args] if json_output else args))
    assert "kvtool.store.objectstore" in mods
    # subprocess: finding libc with ctypes.util runs ldconfig (tens of ms); the emoji
    # table: rich loads it only when a console renders :emoji: codes
    unwanted = ["msgspec", "kvtool.cache", "kvtool.replay", "kvtool.trace.reader", "tomllib",
                "subprocess", "rich._emoji_codes"]
    if json_output:
        unwanted.append("rich")
    else:
        assert "rich.console" in mods
    assert loaded(mods, *unwanted) == []
