"""emulator.nvmetcp.spawn: the target as a child process for the length of a ``with``."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from emulator.nvmetcp.spawn import TargetStartError, spawned

NQN = "nqn.2026-01.io.kvtool:spawn"


def test_ready_on_a_free_port_and_stopped_after_the_block(tmp_path: Path) -> None:
    with spawned(["--listen", "127.0.0.1:0", "--nqn", NQN, "--backing", "4MiB",
                  "--allow-any-host"], workdir=tmp_path) as target:
        assert target.url() == f"nvme+tcp://127.0.0.1:{target.port}/{NQN}/1"
        assert target.url(2).endswith(f"/{NQN}/2")
        with socket.create_connection(("127.0.0.1", target.port), timeout=5):
            pass  # it listens
        proc = target.proc
    assert proc.poll() is not None  # stopped (SIGTERM: a clean exit)
    assert proc.returncode == 0
    assert not list(tmp_path.iterdir())  # its ready file and log are gone


def test_a_target_that_cannot_start_raises_with_its_log(tmp_path: Path) -> None:
    with socket.socket() as squat:
        squat.bind(("127.0.0.1", 0))
        squat.listen(1)
        port = squat.getsockname()[1]
        with pytest.raises(TargetStartError, match="exited with status"), \
                spawned(["--listen", f"127.0.0.1:{port}", "--nqn", NQN, "--backing", "4MiB",
                         "--allow-any-host"], workdir=tmp_path):
            pytest.fail("the block must not run")


def test_the_target_is_stopped_when_the_block_raises(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="boom"), \
            spawned(["--listen", "127.0.0.1:0", "--nqn", NQN, "--backing", "4MiB",
                     "--allow-any-host"], workdir=tmp_path) as target:
        proc = target.proc
        raise RuntimeError("boom")
    assert proc.poll() is not None


def test_a_relative_workdir_is_the_callers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The child runs in the repository; a workdir relative to the caller's directory
    still names the caller's (as ``kvtool experiment run … --out out/exp`` gives it)."""
    monkeypatch.chdir(tmp_path)
    with spawned(["--listen", "127.0.0.1:0", "--nqn", NQN, "--backing", "4MiB",
                  "--allow-any-host"], workdir=Path("out") / "exp") as target:
        assert target.log.parent == tmp_path / "out" / "exp"
    assert (tmp_path / "out" / "exp").is_dir()
