"""Target killed (SIGKILL) and restarted mid-run: the host reconnects and loses nothing.

The target runs as a real process (``python -m emulator.nvmetcp``) on a file backing; a
writer thread keeps writing distinct 64 KiB blocks and records each write that returned
(= acknowledged by the target). After the run every acknowledged block must read back
exactly — through a fresh controller, so nothing is served from host-side state.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvtool.nvme import host
from kvtool.nvme.queue import TransportError
from tests.conftest import REPO, free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]

NQN = "nqn.2026-01.io.kvtool:restart"
HOSTNQN = "nqn.2026-01.io.kvtool:restart-host"
BLOCK = 64 * 1024


def start_target(port: int, backing: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "emulator.nvmetcp", "--listen", f"127.0.0.1:{port}", "--nqn", NQN,
         "--backing", str(backing), "--size", "16MiB", "--host", HOSTNQN],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("ready nvme+tcp://127.0.0.1:"), line + proc.stderr.read()
    return proc


def block(i: int) -> bytes:
    return bytes([i % 251]) * (BLOCK - 8) + i.to_bytes(8, "little")


@pytest.mark.parametrize("poll", [False, True], ids=["interrupt", "polled"])
def test_restart_mid_run_reconnects_without_loss(tmp_path: Path, poll: bool) -> None:
    port = free_port()
    backing = tmp_path / "ns.img"
    proc = start_target(port, backing)
    acked: list[int] = []
    errors: list[BaseException] = []
    total = 160
    ctrl = host.connect("127.0.0.1", port, NQN, hostnqn=HOSTNQN, io_queues=2, reconnect=20.0,
                        timeout=5.0, poll=poll)

    def writer() -> None:
        try:
            for i in range(total):
                ctrl.write(1, i * BLOCK // 512, block(i))
                acked.append(i)
                time.sleep(0.005)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        while len(acked) < 40 and thread.is_alive():
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)  # crash: no flush, no goodbye
        proc.wait(10)
        killed_at = len(acked)
        time.sleep(0.3)
        proc = start_target(port, backing)
        thread.join(60)
        assert not thread.is_alive()
        assert not errors, errors
        assert acked == list(range(total))
        assert ctrl.reconnects >= 1, "the host should have reconnected"
        assert killed_at < total
        ctrl.close()
        with host.connect("127.0.0.1", port, NQN, hostnqn=HOSTNQN) as fresh:
            for i in acked:
                assert fresh.read(1, i * BLOCK // 512, BLOCK // 512) == block(i), i
    finally:
        ctrl.close()
        proc.send_signal(signal.SIGTERM)
        proc.wait(10)
    assert proc.returncode == 0


def test_target_never_returns_fails_cleanly(tmp_path: Path) -> None:
    port = free_port()
    proc = start_target(port, tmp_path / "ns.img")
    ctrl = host.connect("127.0.0.1", port, NQN, hostnqn=HOSTNQN, reconnect=1.5, timeout=2.0)
    try:
        ctrl.write(1, 0, block(1))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        started = time.monotonic()
        with pytest.raises(TransportError, match="not re-established"):
            ctrl.write(1, 128, block(2))  # not acknowledged: the caller is told so
        assert time.monotonic() - started < 10
    finally:
        ctrl.close()
