"""``kvtool replay`` in data mode as a user runs it, in its own process: the NVMe/TCP
target killed mid-run, and Ctrl-C."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, free_port, run

pytestmark = pytest.mark.integration
NQN = "nqn.2026-01.io.kvtool:replay-cli"


@pytest.fixture(scope="module")
def long_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("trace") / "long.jsonl"
    r = run("trace", "gen", "--sessions", "16", "--rounds", "30", "--input-tokens", "1024",
            "--output-tokens", "256", "--system-prompt-tokens", "2048", "--block-tokens", "256",
            "--seed", "2", "--format", "hash_ids", "-o", path)
    assert r.exit_code == 0, r.stderr
    return path


def _default_sigint() -> None:
    # A test run started in the background (CI, `cmd &`) inherits SIGINT ignored, and
    # Python then installs no Ctrl-C handler: give the child the terminal's default.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _kvtool(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "kvtool", *args], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, **(env or {})}, preexec_fn=_default_sigint)


def _wait_rows(csv: Path, rows: int, proc: subprocess.Popen[str]) -> None:
    """Until the replay has served ``rows`` requests (its --requests-csv grows as it goes)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if csv.exists() and csv.read_text().count("\n") > rows:
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    raise AssertionError("the replay made no progress")


def test_target_killed_mid_run_is_one_line_exit_1(long_trace: Path, tmp_path: Path) -> None:
    port = free_port()
    target = subprocess.Popen([sys.executable, "-m", "emulator.nvmetcp", "--listen",
                               f"127.0.0.1:{port}", "--nqn", NQN, "--backing", "256MiB",
                               "--allow-any-host", "--ready-file", str(tmp_path / "ready")],
                              cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "ready").exists():
            assert time.monotonic() < deadline and target.poll() is None
            time.sleep(0.05)
        url = f"nvme+tcp://127.0.0.1:{port}/{NQN}/1"
        csv = tmp_path / "req.csv"
        proc = _kvtool("replay", str(long_trace), "--gpu", "20MiB", "--dram", "40MiB",
                       "--nvme", url, "--block-bytes", "262144", "--requests-csv", str(csv))
        _wait_rows(csv, 60, proc)
        target.kill()  # kill -9: no goodbye to the host
        _out, err = proc.communicate(timeout=120)
    finally:
        target.kill()
        target.wait()
    assert proc.returncode == 1, err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"kvtool: error: nvme tier ({url}): ")
    assert last.endswith("stopped (--on-tier-error recompute goes on without the tier)")
    assert "reconnecting" not in err and "Traceback" not in err


def test_ctrl_c_stops_cleanly_with_a_partial_report(long_trace: Path, tmp_path: Path) -> None:
    csv = tmp_path / "req.csv"
    proc = _kvtool("--json", "replay", str(long_trace), "--gpu", "8MiB", "--dram", "16MiB",
                   "--nvme", f"256MiB@{tmp_path / 'nvme.img'}", "--block-bytes", "262144",
                   "--requests-csv", str(csv))
    _wait_rows(csv, 30, proc)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    doc = json.loads(out)
    assert doc["interrupted"] is True and doc["schema"] == "kvtool.replay/2"
    assert 30 <= doc["requests"] < 480 and doc["corrupt_blocks"] == 0
    assert "Traceback" not in err
    # the clean stop committed the NVMe tier's store: verify checks every block it held
    held = next(t for t in doc["tiers"] if t["name"] == "nvme")["committed_objects"]
    v = run("--json", "verify", tmp_path / "nvme.img")
    assert v.exit_code == 0, v.stderr
    found = json.loads(v.stdout)
    assert held > 0 and found["objects_checked"] == found["content_checked"] == held
