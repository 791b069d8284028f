"""The emulator on SPDK: ``kvtool target up CONFIG --runtime spdk`` / ``[emulator] runtime``.

kvtool starts nvmf_tgt (no hugepages) as a background process, configures it through the
spdk backend, records it (status, load, replay and down find it) and stops it on ``down``.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

import pytest

from kvtool.target import state as st
from kvtool.target.spdk.install import SpdkInstall
from tests.conftest import FIXTURES, free_port, run, run_json

pytestmark = [pytest.mark.spdk, pytest.mark.integration, pytest.mark.slow]

NQN = "nqn.2026-01.io.kvtool:spdk-runtime"


def config(port: int, files: Path, *, runtime_table: bool, extra_ns: bool = False) -> str:
    text = f"""
backend = "emulator"
name = "spdk-runtime"
{'[emulator]' if runtime_table else ''}
{'runtime = "spdk"' if runtime_table else ''}

[[subsystem]]
nqn = "{NQN}"
hosts = ["@local"]
  [[subsystem.namespace]]
  nsid = 1
  size = "48MiB"
  lba = 512
  [[subsystem.namespace]]
  nsid = 2
  backing = "file"
  path = "{files}/ns2.img"
  create = true
  size = "16MiB"
  lba = 4096
"""
    if extra_ns:
        text += """
  [[subsystem.namespace]]
  nsid = 3
  size = "8MiB"
  lba = 4096
"""
    return text + f"""
[[listener]]
address = "127.0.0.1"
port = {port}
"""


@pytest.fixture
def env(spdk: SpdkInstall, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("KVTOOL_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("KVTOOL_SPDK_DIR", str(spdk.root))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path


def test_up_status_load_change_down(env: Path) -> None:
    port = free_port()
    path = env / "t.toml"
    path.write_text(config(port, env, runtime_table=False))
    up = run_json("target", "up", str(path), "--runtime", "spdk")
    steps = [(s["action"], s["kind"]) for s in up["plan"]["steps"]]
    assert steps[0] == ("start", "process") and ("create", "listener") in steps
    status = run_json("target", "status", "--name", "spdk-runtime")
    pid = status["pid"]
    assert (status["runtime"], status["state"]) == ("spdk", "up") and st.pid_alive(pid)
    assert status["spdk_version"].startswith("SPDK v26.05")  # SPDK's own view
    got = {r["nsid"]: (r["size"], r["block_size"]) for r in status["registrations"]}
    assert got == {1: (48 << 20, 512), 2: (16 << 20, 4096)}
    try:
        url = status["registrations"][1]["url"]
        loaded = run_json("load", url, "--model", "deepseek-v4-flash", "--dtype", "fp8",
                          "--count", "6")
        assert (loaded["written"], loaded["io_path"]) == (6, "bounce")
        assert run_json("verify", url)["ok"] is True

        again = run_json("target", "up", str(path), "--runtime", "spdk")
        assert again["applied"] == 0
        # a changed config is applied to the running nvmf_tgt, not by a restart
        path.write_text(config(port, env, runtime_table=False, extra_ns=True))
        changed = run_json("target", "up", str(path), "--runtime", "spdk")
        assert [(s["action"], s["kind"]) for s in changed["plan"]["steps"]] == [
            ("create", "bdev"), ("create", "namespace")]
        status = run_json("target", "status", "--name", "spdk-runtime")
        assert status["pid"] == pid and len(status["registrations"]) == 3
        assert run_json("verify", url)["ok"] is True  # the data stayed
    finally:
        down = run_json("target", "down", "--name", "spdk-runtime")
    assert down["changed"] is True and not st.pid_alive(pid)
    assert st.names() == []
    assert run_json("target", "status", str(path), "--runtime", "spdk")["state"] == "down"


def test_runtime_from_the_emulator_table_and_replay_finds_it(env: Path) -> None:
    """The default target on SPDK (``target up --runtime spdk``): data-mode replay puts its
    NVMe tier there; and ``[emulator] runtime = "spdk"`` in a file works the same way."""
    port = free_port()
    run_json("target", "up", "--runtime", "spdk", "--port", str(port))
    try:
        status = run_json("target", "status", "--name", "kvtool")
        assert (status["runtime"], status["state"]) == ("spdk", "up")
        report = run_json("replay", str(FIXTURES / "traces" / "multiturn-8x12.jsonl"),
                          "--block-bytes", "4096", "--gpu", "20blk", "--dram", "60blk",
                          "--nvme", "600blk")
        nvme = report["tiers"][-1]
        assert (nvme["name"], nvme["url"]) == (
            "nvme", f"nvme+tcp://127.0.0.1:{port}/nqn.2026-01.io.kvtool:default/1")
        assert report["hit_tokens"]["nvme"] > 0 and report["verified_blocks"] > 0
        assert report["corrupt_blocks"] == report["lost_blocks"] == 0
    finally:
        run_json("target", "down", "--name", "kvtool")
    port2 = free_port()
    path = env / "table.toml"
    path.write_text(config(port2, env, runtime_table=True))
    run_json("target", "up", str(path))
    try:
        assert run_json("target", "status", str(path))["runtime"] == "spdk"
    finally:
        run_json("target", "down", str(path))


def test_failed_start_rolls_back_and_leaves_nothing(env: Path) -> None:
    """The listener's address cannot be bound: the plan fails after nvmf_tgt started; the
    rollback stops it and nothing is recorded."""
    path = env / "bad.toml"
    before = set(os.listdir("/tmp"))
    port = free_port()
    with socket.socket() as squat:
        squat.bind(("127.0.0.1", port))
        squat.listen(1)
        path.write_text(config(port, env, runtime_table=True))
        result = run("target", "up", str(path))
    assert result.exit_code == 1, result.stdout + result.stderr
    assert "rolled back" in result.stderr and "nvmf_subsystem_add_listener" in result.stderr
    assert st.names() == []
    leftovers = [d for d in set(os.listdir("/tmp")) - before if d.startswith("kvtool-spdk-")]
    assert leftovers == []


def test_a_killed_nvmf_tgt_leaves_nothing_after_down(env: Path) -> None:
    """SIGKILL skips nvmf_tgt's own clean-up of its trace buffer in /dev/shm; ``down``
    (which finds the process gone) removes it with the process record."""
    path = env / "t.toml"
    path.write_text(config(free_port(), env, runtime_table=True))
    pid = run_json("target", "up", str(path))["status"]["pid"]
    trace = Path(f"/dev/shm/nvmf_trace.pid{pid}")
    try:
        assert trace.exists()  # SPDK's trace buffer, named after the pid
        os.kill(pid, signal.SIGKILL)
        for _ in range(200):
            if not st.pid_alive(pid):
                break
            time.sleep(0.05)
        assert trace.exists()  # nobody removed it
    finally:
        down = run("target", "down", str(path))
    assert down.exit_code == 0, down.stderr
    assert not trace.exists() and st.names() == []


def test_spdk_missing_is_one_line(env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTOOL_SPDK_DIR", str(env / "nowhere"))
    path = env / "t.toml"
    path.write_text(config(free_port(), env, runtime_table=True))
    result = run("target", "up", str(path))
    assert result.exit_code == 2
    assert result.stderr.strip().count("\n") == 0 and "KVTOOL_SPDK_DIR" in result.stderr
